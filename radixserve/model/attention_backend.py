"""Attention backends: write the new K/V into the pool, attend over each request's cached KV.

The model calls, once per forward, ``backend.init_forward_metadata(forward_batch, req_to_token_pool)``
and then, per layer, ``backend.forward(q, k, v, layer_id, forward_batch, kv_pool, req_to_token_pool)``
with ``q: [T, H, D]``, ``k, v: [T, KVH, D]`` for the ``T`` new tokens of the batch; it returns
``[T, H * D]``. Everything that only depends on the batch (gather indices, masks) belongs in the
metadata, so the per-layer work is a handful of tensor ops.

A backend may also attend over a sliding window (each token sees the ``window`` latest positions,
itself included; the positions before it are never read) and soft-cap the scores (``cap *
tanh(score / cap)``), as Gemma's layers do. Both backends have windows; only ``torch_native`` caps
scores, and ``auto`` picks it for a model that needs that (Gemma 2).

Backends register by name (``@register_attention_backend("name")``); ``create_attention_backend``
builds one. A GPU kernel (FlashInfer, Triton...) is one more subclass. Backends in their own module
are listed in ``_LAZY_BACKENDS`` and imported only when asked for: ``torch_native`` (``attention.py``)
and ``cpu_paged`` (``paged_attention.py``, a C++ kernel that compiles on first use).
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from radixserve.mem.forward_batch import ForwardBatch
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    # whether the model pairs this backend with the C++ small ops (fused_ops.py): the backends that
    # need a compiler anyway
    fused_small_ops = False
    # whether it implements ``window`` and ``softcap``
    has_windows = False
    has_softcap = False

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run here (a kernel that does not build), or None."""
        return None

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scaling = scaling if scaling is not None else head_dim**-0.5
        if (window and not self.has_windows) or (softcap and not self.has_softcap):
            raise ValueError(f"the {type(self).__name__} backend has no score soft-capping, which this model "
                             "needs; use --attention-backend torch_native (or auto)" if softcap else
                             f"the {type(self).__name__} backend has no sliding window, which this model needs")
        self.window = window
        self.softcap = softcap
        self._init_state()

    def _init_state(self) -> None:  # noqa: B027
        """A backend's own state, set up after the fields above (optional)."""

    def init_forward_metadata(self, forward_batch: ForwardBatch, req_to_token_pool: ReqToTokenPool) -> None:  # noqa: B027
        """Precompute what every layer of this forward shares. Optional for a backend."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
    ) -> torch.Tensor:
        """Store ``k, v`` at ``forward_batch.out_cache_loc`` in layer ``layer_id``; return attention
        output ``[T, H * D]`` where new token ``i`` of a request at prefix ``p`` sees keys ``0..p+i``."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}
# name -> the module whose import registers it
_LAZY_BACKENDS = {"torch_native": "radixserve.model.attention", "cpu_paged": "radixserve.model.paged_attention"}


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return deco


def available_attention_backends() -> list[str]:
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def resolve_auto_backend(needs_softcap: bool = False) -> str:
    """What ``auto`` means here: the paged kernel if its extension builds, else the torch path (and
    the torch path for a model with soft-capped scores, which the kernel lacks)."""
    if needs_softcap:
        return "torch_native"
    err = _backend_class("cpu_paged").unavailable()
    if err is None:
        return "cpu_paged"
    logger.warning("attention backend auto: the cpu_paged kernel is unavailable (%s); using torch_native", err)
    return "torch_native"


def create_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> AttentionBackend:
    """Raises ``ValueError`` for an unknown name or one without the ``window`` / ``softcap`` asked
    for; a backend that cannot run here (``cpu_paged`` without its compiled extension) raises
    ``RuntimeError`` saying why. ``auto``: ``cpu_paged`` where its kernel builds, else (or when
    ``softcap`` is asked for) ``torch_native``."""
    if name == "auto":
        name = resolve_auto_backend(bool(softcap))
    return _backend_class(name)(num_heads, num_kv_heads, head_dim, scaling, window, softcap)


def _backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[name])
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_attention_backends()}")
    return _BACKENDS[name]
