#!/usr/bin/env bash
# Set everything up, then run the linter and the test suite (about 25 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
