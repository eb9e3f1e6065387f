"""radixserve: an SGLang-shaped LLM serving engine. ``radixserve.Engine`` is the in-process engine
(as ``sglang.Engine``); it is imported on first use, so ``import radixserve`` stays light."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
