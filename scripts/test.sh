#!/usr/bin/env bash
# The test command: set up, lint, type-check, check import layers, run the tests.
#   bash scripts/test.sh           the full suite (what CI runs), with the 25 slowest tests listed
#   bash scripts/test.sh --fast    the inner loop: every test but those marked slow (real servers,
#                                  long runs of the real model); a few minutes
# Other arguments go to pytest (e.g. a test file, -k NAME, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
    fast=1
    shift
fi
bash scripts/setup.sh
. .venv/bin/activate
ruff check radixserve tests examples scripts
mypy
lint-imports
if [ "$fast" = 1 ]; then
    python -m pytest -m "not slow" "$@"
else
    python -m pytest --durations=25 "$@"
fi
