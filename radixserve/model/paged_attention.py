"""``cpu_paged``: decode attention that reads K/V in place from the paged pool (a C++ kernel).

``TorchNativeAttention`` gathers every decode request's K and V out of the pool into contiguous
tensors and then runs SDPA over them: the KV is read, written and read again, and on this CPU that
memory traffic is most of a decode step. ``csrc/paged_attention.cpp`` walks each request's slots
through ``req_to_token[req_pool_idx, :seq_len]`` instead and reads K/V where they are, once, with
an online softmax in float32 (the file's header has the algorithm). Prefill and extend rows keep
the torch path (their SDPA calls are GEMM-bound, not gather-bound).

Sliding windows: a windowed layer's decode rows attend their last ``window`` slots only (the
kernel's ``window``); the positions before are never read, so the pool may have freed them.

Shared prefixes: the kernel attends every decode row, grouped or not, and the torch
``cascade.py`` grouping is off for this backend (``share_prefixes = False``). Measured
(docs/benchmarks.md, "Where a decode step goes"): a shared prefix read once per member by the kernel
is still faster than the cascade's gather-once + GEMM (3.5 against 13.3 ms for 128 rows in 8
groups sharing a 512-token prefix, one layer, one thread), since the rows of a group run one after
the other on a thread and the prefix is in cache for all but the first.

The extension is compiled on first use (cpp_build.py: ``-O3 -march=native``) into ``.build/`` at
the repository root (``RADIXSERVE_BUILD_DIR`` overrides); ``scripts/setup.sh`` builds it ahead.
If it cannot be built (no compiler), importing this module still works: the backend is listed, and choosing it raises an error that says why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.mem.kv_pool import KVPool
from radixserve.model.attention import TorchNativeAttention, _DecodeGroup
from radixserve.model.attention_backend import register_attention_backend
from radixserve.model.cpp_build import build_dir, load_extension

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str | None]:
    """(the extension module, None), or (None, why it could not be built). Built once per process."""
    return load_extension("radixserve_paged_attention", _SOURCE)


# Builds of the same source with a vector path switched off: what CPUs without AVX512-BF16 / AVX-512 /
# AVX2 run, built here so the tests can check each against the main build (scripts/test.sh builds
# them in the background while the linters run).
VARIANTS: dict[str, list[str]] = {
    "widen": ["-DRADIXSERVE_NO_BF16_DOT"],
    "avx2": ["-DRADIXSERVE_NO_AVX512"],
    "plain": ["-DRADIXSERVE_NO_AVX512", "-DRADIXSERVE_NO_AVX2"],
}


def variant(name: str) -> tuple[Any, str | None]:
    """(the ``VARIANTS[name]`` build of the extension, None), or (None, why it could not be built)."""
    return load_extension(f"radixserve_paged_attention_{name}", _SOURCE, VARIANTS[name])


def extension() -> Any:
    """The compiled extension; raises ``RuntimeError`` saying why if it cannot be built."""
    ext, err = _load()
    if ext is None:
        raise RuntimeError(
            f"attention backend 'cpu_paged' is unavailable: its C++ extension could not be built ({err}). "
            "It needs g++ and ninja (bash scripts/setup.sh installs both); --attention-backend torch_native "
            "works without them."
        )
    return ext


def extension_error() -> str | None:
    """None when the extension builds, else the reason it does not."""
    return _load()[1]


def paged_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``q: [B, H, D]`` (one new token per row) attends over ``seq_lens[b]`` tokens whose KV slots
    are ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` (with a ``window``, the last ``window`` of
    them) in ``k_buf, v_buf: [S, KVH, D]``
    (float32, bfloat16, float8 e4m3 / e5m2 or int8; a one-byte pool may come with ``k_scale,
    v_scale: [S, KVH]`` float32, and int8 and e4m3 pools do: the formats of ``mem/kv_format.py``).
    Returns ``[B, H * D]`` in ``q``'s dtype."""
    out: torch.Tensor = extension().paged_decode_attention(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, float(scale), k_scale, v_scale, window or 0
    )
    return out


@dataclass
class _PagedDecode(_DecodeGroup):
    """The decode rows of a batch as the kernel takes them: no gather indices, only where to look.

    NOTE: the kernel reads ``req_to_token`` during the forward, not a copy taken here as the torch
    path's gather indices are. That is safe under the overlap loop: while a step is in flight the
    scheduler only writes slots past its rows' ``seq_lens`` (the next step's tokens) and never
    retracts or frees one of its requests (``SchedulerCore.can_build_ahead``, ``PrefillFirst.may_build_ahead``)."""

    req_to_token: torch.Tensor | None = None  # the whole [R, C] table
    req_pool_indices: torch.Tensor | None = None  # [n]
    seq_lens: torch.Tensor | None = None  # [n]


@register_attention_backend("cpu_paged")
class CpuPagedAttention(TorchNativeAttention):
    """``TorchNativeAttention`` with its decode path replaced by the paged C++ kernel.

    Prefill / extend rows (and the KV write) are the parent's. Decode rows, grouped by a shared
    prefix or not, go to the kernel in one call per layer (see the module docstring for why the
    cascade grouping is off)."""

    fused_small_ops = True

    has_windows = True
    has_softcap = False  # the kernel has no score capping

    @classmethod
    def unavailable(cls) -> str | None:
        return extension_error()

    def _init_state(self) -> None:
        super()._init_state()
        extension()  # fail at construction, with the reason, not at the first decode step
        self.share_prefixes = False

    def _decode_group(
        self, r2t: torch.Tensor, rows_rpi: torch.Tensor, lens: list[int], token_idx: torch.Tensor | None
    ) -> _DecodeGroup:
        lens_t = torch.tensor(lens, dtype=torch.int64)
        return _PagedDecode(token_idx, len(lens), [], 0, r2t, rows_rpi.to(torch.int64), lens_t)

    def _window_decode_group(
        self, r2t: torch.Tensor, rows_rpi: torch.Tensor, lens: list[int], token_idx: torch.Tensor | None,
        window: int,
    ) -> _DecodeGroup:
        return self._decode_group(r2t, rows_rpi, lens, token_idx)  # the kernel starts each row at its window

    def _store(self, kv_pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The extension writes the pool in one call, the same bytes as ``KVPool.write`` (which takes
        two indexed copies, and for a one-byte pool a dozen tensor ops more)."""
        extension().store_kv(kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id], *kv_pool.scales(layer_id),
                             loc, k, v, kv_pool.format.top)

    def _decode(self, q: torch.Tensor, dec: _DecodeGroup, kv_pool: KVPool, layer_id: int) -> torch.Tensor:
        assert isinstance(dec, _PagedDecode)
        assert dec.req_to_token is not None and dec.req_pool_indices is not None and dec.seq_lens is not None
        k_scale, v_scale = kv_pool.scales(layer_id)
        return paged_decode_attention(
            q, kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id], dec.req_to_token, dec.req_pool_indices,
            dec.seq_lens, self.scaling, k_scale, v_scale, self.window,
        )


if __name__ == "__main__":
    # python -m radixserve.model.paged_attention: build it now (scripts/setup.sh);
    # ... --variant NAME [--variant NAME]: build those test variants instead (scripts/test.sh)
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="Build the cpu_paged attention extension.")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS), default=[],
                    help="build this variant of it (for the tests) instead; may be repeated")
    names = ap.parse_args().variant
    failed = False
    for label, err in ([(f"variant {n}", variant(n)[1]) for n in names] if names else [("extension", extension_error())]):
        print(f"cpu_paged {label}: {'built in ' + str(build_dir()) if err is None else 'unavailable: ' + err}")
        failed = failed or err is not None
    sys.exit(1 if failed else 0)
