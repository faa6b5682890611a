"""Standalone tools: memory-history snapshots, the memory one block adds, OOM post-mortems,
torch.profiler's memory timeline, and output folders.

Each is usable without a :class:`~pytorch_mem_profiler.MemoryProfiler`. They read the
device only through :mod:`pytorch_mem_profiler.measure` (counters, the allocator's
statistics, history and OOM observer).

May import torch, ``measure`` and the top-level vocabulary; never ``analysis``.
Loaded on first use by the package's ``__init__``.
"""
