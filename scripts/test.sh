#!/usr/bin/env bash
# The test command: set up, lint, type-check, check import layers, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check radixserve tests examples scripts
mypy
lint-imports
python -m pytest "$@"
