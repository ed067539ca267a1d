#!/usr/bin/env bash
# Set everything up, then run the linter and the test suite (20-30 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# two pytest processes side by side on the two cores: the tests that start Flower or Ray
# processes (marker flower_processes) one after another in one, every other test in the
# other; the first's output follows the second's. Arguments (e.g. -k, files) go to both.
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
APP_LOG="$TMP/flower-processes.log"
# each its own temporary folder, and one pytest cache writer
.venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$TMP/app" -m flower_processes \
  "$@" > "$APP_LOG" 2>&1 &
APP_PID=$!
set +e
.venv/bin/python -m pytest -q --basetemp="$TMP/lib" -m "not flower_processes" "$@"
LIB_RC=$?
wait "$APP_PID"
APP_RC=$?
set -e
echo "=== the tests that start Flower or Ray processes (pytest -m flower_processes) ==="
cat "$APP_LOG"
# 5: that half collected no test (the arguments selected none of it)
[ "$LIB_RC" -eq 5 ] && LIB_RC=0
[ "$APP_RC" -eq 5 ] && APP_RC=0
exit $(( LIB_RC != 0 || APP_RC != 0 ))
