"""How the CUDA caching allocator rounds requests and carves segments, and what lives beside it.

The rules of ``c10/cuda/CUDACachingAllocator.cpp`` (default settings: no
``expandable_segments``, no ``max_split_size_mb``, no round-up divisions):

- every block is a multiple of 512 bytes (``kMinBlockSize``), at least 512; an
  empty tensor takes no block. ``torch.cuda.memory_allocated()`` counts these
  rounded sizes, so an estimate of it rounds each storage the same way;
- requests up to 1 MiB (``kSmallSize``) come from 2 MiB segments
  (``kSmallBuffer``); requests under 10 MiB (``kMinLargeAlloc``) from 20 MiB
  segments (``kLargeBuffer``); larger ones get a segment of their size rounded up
  to 2 MiB (``kRoundLarge``). A free block is split when what remains is at least
  512 bytes (small pool) or more than 1 MiB (large pool); freed neighbours merge.
  :func:`simulate_reserved` replays a step's allocations through these rules to
  estimate ``torch.cuda.max_memory_reserved()``.

Outside the allocator, the device also holds the CUDA context, the kernels'
modules and the libraries' handles: :data:`CUDA_CONTEXT_ALLOWANCE`.

Example::

    >>> block_size(1), block_size(512), block_size(513), block_size(0)
    (512, 512, 1024, 0)
    >>> segment_size(100), segment_size(3 << 20), segment_size(11 << 20) == 12 << 20
    (2097152, 20971520, True)
"""

from __future__ import annotations

import bisect
import os
from typing import Iterable

__all__ = [
    "MIN_BLOCK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "CUDA_CONTEXT_ALLOWANCE",
    "block_size",
    "segment_size",
    "cublas_workspace_bytes",
    "simulate_reserved",
]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

#: Device memory outside PyTorch's allocator that an estimate adds for a CUDA device:
#: the CUDA context with the loaded kernels of torch, cuBLAS and cuDNN. Measured with
#: ``nvidia-smi`` minus ``memory_reserved()`` after a first training step it is about
#: 0.5 GB on older GPUs and CUDA versions and up to 1.5 GB on an H200 with CUDA 12/13
#: (lazy module loading keeps it at the low end until many kernels have run): 1 GiB,
#: the middle of that range. Pass ``outside=`` to use your own figure.
CUDA_CONTEXT_ALLOWANCE = 1 << 30


def block_size(nbytes: int) -> int:
    """Bytes the caching allocator gives a request of ``nbytes``: a multiple of 512, at least 512."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(nbytes: int) -> int:
    """Bytes of the segment the caching allocator asks the driver for, for a request of ``nbytes``."""
    size = block_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def cublas_workspace_bytes(capability: tuple[int, int] | None = None) -> int:
    """Bytes of cuBLAS's workspace, which torch takes from the caching allocator at the first matmul.

    ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[:SIZE:COUNT...]`` (KiB) when set; else
    torch's default: 32 MiB on Hopper and newer (compute capability 9.0 and up,
    and on unknown devices), 4096 KiB x 2 + 16 KiB x 8 before. cuBLASLt shares it.

    Example::

        >>> cublas_workspace_bytes((9, 0)) == 32 << 20, cublas_workspace_bytes((8, 0))
        (True, 8519680)
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        parts = [p for p in config.split(":") if p]
        try:
            sizes = [int(parts[i]) for i in range(0, len(parts) - 1, 2)]
            if sizes:
                return sum(sizes) * 1024
        except ValueError:
            pass
        return 4096 * 1024
    if capability is not None and capability[0] < 9:
        return 4096 * 1024 * 2 + 16 * 1024 * 8
    return 32 << 20


class _Pool:
    """The free blocks of one pool (small or large), kept sorted by (size, segment, offset)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: list[tuple[int, int, int]] = []  # (size, segment, offset)

    def take(self, size: int) -> tuple[int, int, int] | None:
        i = bisect.bisect_left(self.free, (size, -1, -1))
        if i == len(self.free):
            return None
        return self.free.pop(i)

    def put(self, block: tuple[int, int, int]) -> None:
        bisect.insort(self.free, block)

    def remove(self, block: tuple[int, int, int]) -> None:
        i = bisect.bisect_left(self.free, block)
        if i < len(self.free) and self.free[i] == block:
            self.free.pop(i)


def simulate_reserved(events: Iterable[tuple[int, int]], *, limit: int | None = None) -> int | None:
    """The most bytes of segments the caching allocator would hold over ``events``.

    ``events`` are ``(key, nbytes)`` pairs in time order: a positive ``nbytes``
    allocates a block for ``key``, a negative one frees it. Best fit in each pool,
    splitting and merging as the allocator does. Without ``limit`` no segment is
    ever given back (``torch.cuda.empty_cache()`` is never called during a step).
    With ``limit`` (what ``torch.cuda.set_per_process_memory_fraction`` allows), a
    segment that would take the reserved bytes past it first makes the allocator
    give back its wholly free segments and try again, as it does before raising
    an out-of-memory error; ``None`` if it still does not fit.

    Approximations: one stream, default settings (no ``expandable_segments``, no
    ``max_split_size_mb``); of the memory a kernel takes for itself inside an
    operator, only what :mod:`~.scratch`'s rules give is in ``events`` (an
    allocation and a free around the operator).

    Example::

        >>> simulate_reserved([(1, 1000), (2, 3 << 20), (1, -1000), (3, 1000)]) == (2 << 20) + (20 << 20)
        True
        >>> simulate_reserved([(1, 3 << 20), (1, -(3 << 20)), (2, 12 << 20)], limit=20 << 20) == 20 << 20
        True
        >>> simulate_reserved([(1, 3 << 20), (2, 19 << 20)], limit=30 << 20) is None  # 20 MiB + 20 MiB
        True
    """
    pools = {True: _Pool(True), False: _Pool(False)}
    # segment -> {offset: [size, free]}; a block is (segment, offset)
    segments: dict[int, dict[int, list]] = {}
    where: dict[int, tuple[int, int, bool]] = {}
    reserved = peak = 0
    made = 0
    for key, nbytes in events:
        if nbytes > 0:
            size = block_size(nbytes)
            small = size <= SMALL_SIZE
            pool = pools[small]
            found = pool.take(size)
            if found is None:
                seg_bytes = segment_size(nbytes)
                if limit is not None and reserved + seg_bytes > limit:
                    reserved -= _release_free_segments(segments, pools)
                    if reserved + seg_bytes > limit:
                        return None
                seg = made
                made += 1
                segments[seg] = {0: [seg_bytes, False]}
                reserved += seg_bytes
                peak = max(peak, reserved)
                found = (seg_bytes, seg, 0)
            else:
                segments[found[1]][found[2]][1] = False
            block_bytes, seg, offset = found
            rest = block_bytes - size
            if rest >= (MIN_BLOCK if small else SMALL_SIZE + 1):
                segments[seg][offset][0] = size
                segments[seg][offset + size] = [rest, True]
                pool.put((rest, seg, offset + size))
            where[key] = (seg, offset, small)
        elif nbytes < 0 and key in where:
            seg, offset, small = where.pop(key)
            pool = pools[small]
            blocks = segments[seg]
            size = blocks[offset][0]
            # merge with a free neighbour after, then before
            after = offset + size
            if after in blocks and blocks[after][1]:
                pool.remove((blocks[after][0], seg, after))
                size += blocks.pop(after)[0]
            before = next((o for o, b in blocks.items() if b[1] and o + b[0] == offset), None)
            if before is not None:
                pool.remove((blocks[before][0], seg, before))
                del blocks[offset]
                size += blocks[before][0]
                offset = before
            blocks[offset] = [size, True]
            pool.put((size, seg, offset))
    return peak


def _release_free_segments(segments: dict[int, dict[int, list]], pools: dict[bool, _Pool]) -> int:
    """Give back every segment that is one free block (what ``release_cached_blocks`` frees); the bytes."""
    freed = 0
    for seg in [s for s, blocks in segments.items() if len(blocks) == 1 and blocks[0][1]]:
        size = segments.pop(seg)[0][0]
        for pool in pools.values():
            pool.remove((size, seg, 0))
        freed += size
    return freed
