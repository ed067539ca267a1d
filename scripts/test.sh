#!/usr/bin/env bash
# Set everything up, then run the linter and the test suite (about 25 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# two pytest-xdist workers: the tests that start Flower processes run one after another on
# one of them (tests/conftest.py), the library tests spread over both
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
