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
# the attention kernel's test-only variants (a minute of compiling each) build while the linters run;
# a variant that fails to build fails its tests, which say why
mkdir -p .build
python -m radixserve.model.paged_attention --variant avx2 --variant widen > .build/variants-1.log 2>&1 &
lane1=$!
python -m radixserve.model.paged_attention --variant plain > .build/variants-2.log 2>&1 &
lane2=$!
ruff check radixserve tests examples scripts
mypy
lint-imports
wait "$lane1" || cat .build/variants-1.log >&2
wait "$lane2" || cat .build/variants-2.log >&2
if [ "$fast" = 1 ]; then
    python -m pytest -m "not slow" "$@"
else
    python -m pytest --durations=25 "$@"
fi
