"""This process on this host: the CPU's flags, the thread count, and the heap's behaviour."""

from __future__ import annotations

import os

import torch


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def configure_threads(num_threads: int | None) -> int:
    """Use ``num_threads`` if given; else respect OMP_NUM_THREADS / an explicit earlier setting;
    else one thread per CPU this process may run on."""
    if num_threads is not None:
        torch.set_num_threads(max(1, num_threads))
    elif "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            n = os.cpu_count() or 1
        if torch.get_num_threads() > n:
            torch.set_num_threads(n)
    return torch.get_num_threads()


_MALLOC_TUNED = False


def tune_malloc() -> bool:
    """Keep freed memory in the glibc heap instead of handing it back to the kernel.

    A CPU step allocates many multi-MB temporaries (logits, softmax, gathers); by default glibc
    serves them with ``mmap`` and returns them on free, so every step pays page faults on fresh
    memory. Measured here at batch 64 x 49152: top-p sampling over a flat distribution 88 -> 48 ms,
    an early sampler version 26 -> 9 ms; the model forward itself showed no measurable change.
    Process-wide and idempotent; a no-op off glibc. Returns whether it applied.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        return False
    _MALLOC_TUNED = bool(ok)
    return _MALLOC_TUNED
