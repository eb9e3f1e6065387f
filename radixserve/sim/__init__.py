"""Serving simulator: the real scheduler, radix cache and allocators over a cost-model runner on a
virtual clock (``radixserve simulate``; docs/simulator.md)."""
