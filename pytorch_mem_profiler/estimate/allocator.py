"""How the CUDA caching allocator rounds requests and carves segments, and what lives beside it.

The rules of ``c10/cuda/CUDACachingAllocator.cpp`` (default settings: no
``expandable_segments``, no ``max_split_size_mb``, no round-up divisions, no
garbage-collection threshold), which :class:`AllocatorReplay` follows:

- every block is a multiple of 512 bytes (``kMinBlockSize``), at least 512; an
  empty tensor takes no block. ``torch.cuda.memory_allocated()`` counts these
  rounded sizes, so an estimate of it rounds each storage the same way
  (``round_size``), and counts a block whole where less than it was asked and the
  rest was not split off (below; :func:`replay_whole_blocks`);
- requests up to 1 MiB (``kSmallSize``) come from the small pool's 2 MiB segments
  (``kSmallBuffer``), larger ones from the large pool; a new segment for a request
  under 10 MiB (``kMinLargeAlloc``) is 20 MiB (``kLargeBuffer``), a larger one its
  size rounded up to 2 MiB (``kRoundLarge``) (``get_pool``, ``get_allocation_size``);
- a request takes the smallest free block of its pool and stream that holds it, the
  lowest address among equals (``get_free_block``: a ``std::set`` ordered by stream,
  size, address); a block is split when what remains is at least 512 bytes (small
  pool) or more than 1 MiB (large pool) (``should_split``), the request at the
  block's start; a freed block merges with free neighbours of its segment
  (``free_block``, ``try_merge_blocks``);
- with no free block, a new segment (``alloc_block``); under
  ``torch.cuda.set_per_process_memory_fraction`` a segment that would take the
  segments' total (``total_allocated_memory``) past the allowed bytes is refused,
  the allocator then gives back every segment that is one free block, of both pools
  (``release_cached_blocks``), and tries once more; out of memory if it still does
  not fit.

Segment addresses come from ``cudaMalloc``, which the replay cannot know exactly: it
gives each new segment an address below every segment it holds, so that among free
blocks of the same size the newest segment's is taken. The driver was seen to place
successive segments downwards (an H100, torch 2.11, CUDA 13: 16 models' first two
training steps, fresh processes; their real requests replayed so reserve what the
device reserved, to the byte, in all 16, where the opposite order missed by up to
3.6%). :class:`AllocatorReplay` takes real addresses where it is given them.
:func:`simulate_reserved` replays a step's allocations through these rules to estimate
``torch.cuda.max_memory_reserved()``, and whether the step runs under a limit.

Outside the allocator, the device also holds the CUDA context, the kernels'
modules and the libraries' handles: :data:`CUDA_CONTEXT_ALLOWANCE`.

Example::

    >>> block_size(1), block_size(512), block_size(513), block_size(0)
    (512, 512, 1024, 0)
    >>> segment_size(100), segment_size(3 << 20), segment_size(11 << 20) == 12 << 20
    (2097152, 20971520, True)
    >>> replay = AllocatorReplay(record=True).run([(1, 1000), (2, 3 << 20), (1, -1000)])
    >>> [entry.action for entry in replay.trace], replay.peak_reserved == (2 << 20) + (20 << 20)
    (['segment_alloc', 'alloc', 'segment_alloc', 'alloc', 'free'], True)
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Collection, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "MIN_BLOCK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "CUDA_CONTEXT_ALLOWANCE",
    "LAYOUT_ALLOWANCE",
    "PROCESSES",
    "block_size",
    "segment_size",
    "cublas_workspace_bytes",
    "cublas_thread",
    "simulate_reserved",
    "AllocatorReplay",
    "ReplayEntry",
    "StepEvents",
    "with_headroom",
    "workspaces_at_first_use",
    "replay_whole_blocks",
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

#: Share of a memory limit that a batch search leaves free beyond the estimate's stated bounds, for
#: where the device's blocks come out otherwise than the replay's. The replay follows the caching
#: allocator's rules and gives a run's reserved to the byte from that run's own requests; the
#: estimate's requests are the same sizes in a slightly different order (a kernel's scratch taken
#: earlier or later, a view's copy), and near the limit that decides whether a freed segment serves
#: a later request. Measured on H200s (torch 2.11): three predicted batches that ran out of memory
#: (a checkpointed decoder, Qwen2, DistilBERT) fitted the replay with 0.26%, 0.14% and 0.05% of the
#: limit left, while every 1.1x batch that ran out was over it by 6% or more: 0.5% is about twice the
#: largest miss and a twelfth of the smallest step up.
LAYOUT_ALLOWANCE = 0.005


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


#: ATen operators whose CUDA kernels call cuBLAS or cuBLASLt (by name, an in-place or ``out=``
#: variant too): the first in a thread takes that thread's workspace (``getCurrentCUDABlasHandle``
#: sets it). Convolutions (cuDNN), the flash and memory-efficient attention kernels, recurrent
#: layers (cuDNN), reductions and element-wise kernels take none; nor does a step without them.
CUBLAS_OPERATORS = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
        "_scaled_mm", "_int_mm", "_grouped_mm", "_trilinear", "matmul", "linear", "triangular_solve",
    }
)  # fmt: skip


#: ``linalg_*`` operators that are element-wise kernels, reductions or views, not cuBLAS's: a norm
#: (``clip_grad_norm_``'s, ``F.normalize``'s; a matrix norm that needs one runs ``linalg_svd``)
#: takes no workspace (an H200: gradient clipping allocated nothing, the first matmul the 32 MiB)
NOT_CUBLAS_LINALG = frozenset({"linalg_vector_norm", "linalg_norm", "linalg_matrix_norm", "linalg_cross", "linalg_diagonal"})


def runs_cublas(name: str) -> bool:
    """Whether the ATen operator ``name`` (``aten.mm.default``'s is ``"mm"``) runs cuBLAS on CUDA:
    one of :data:`CUBLAS_OPERATORS`, its in-place form, or a linear-algebra routine (``linalg_*``)
    but the norms and the other element-wise ones (:data:`NOT_CUBLAS_LINALG`).

    Example::

        >>> runs_cublas("addmm_"), runs_cublas("linalg_solve_triangular"), runs_cublas("convolution")
        (True, True, False)
        >>> runs_cublas("linalg_vector_norm")       # clip_grad_norm_'s
        False
    """
    routine = name.lstrip("_")
    return name.rstrip("_") in CUBLAS_OPERATORS or (routine.startswith("linalg_") and routine not in NOT_CUBLAS_LINALG)


def cublas_workspaces(phases: Iterable[str] | None) -> int:
    """How many cuBLAS workspaces a training step takes, from the phases its cuBLAS operators ran in
    (:func:`runs_cublas`): cuBLAS keeps one per thread, so one for the script's thread (forward,
    loss, optimizer step) and one for autograd's thread on the device (``"backward"``); both where
    the phases are unknown (``None``: compiled code ran, whose operators the count does not see).

    Example::

        >>> cublas_workspaces({"forward", "backward"}), cublas_workspaces(set()), cublas_workspaces(None)
        (2, 0, 2)
        >>> cublas_workspaces({"optimizer"})      # a matmul in the update only (Muon), the script's thread
        1
    """
    if phases is None:
        return 2
    return len({cublas_thread(phase) for phase in phases})


def cublas_thread(phase: str) -> str:
    """The thread a phase's cuBLAS operators run in, each with a workspace of its own: autograd's
    device thread for ``"backward"``, the script's for the others (forward, loss, optimizer step).

    Example::

        >>> cublas_thread("backward"), cublas_thread("optimizer")
        ('autograd', 'script')
    """
    return "autograd" if phase == "backward" else "script"


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


@dataclass(frozen=True)
class ReplayEntry:
    """One thing :class:`AllocatorReplay` did, named as torch's allocator history names it.

    Attributes:
        action: ``"segment_alloc"`` (a new segment), ``"alloc"`` (a block handed out),
            ``"free"`` (a block given back to its pool), ``"segment_free"`` (a wholly free
            segment given back under a limit), ``"oom"`` (the request that did not fit),
            ``"fallback"`` (a workspace that did not fit and that its library does without).
        index: the event it happened at (``-1``: before the events, :meth:`AllocatorReplay.add_segment`).
        key: the allocation's key (``None`` for segments).
        size: bytes of the block (a multiple of 512, more than asked where the rest was too small to
            split off), of the segment, or requested (``"oom"``).
        address: where: the segment's address plus the block's offset.
        reserved: bytes of segments after it; allocated: bytes of blocks handed out after it (as
            ``torch.cuda.memory_allocated()`` counts them: whole blocks).
        requested: the bytes asked for (``"alloc"``, ``"oom"``, ``"fallback"``; 0 otherwise).
    """

    action: str
    index: int
    key: int | None
    size: int
    address: int
    reserved: int
    allocated: int
    requested: int = 0


@dataclass(frozen=True)
class StepEvents:
    """A step's allocations and frees as the replay takes them, with where each one came from.

    Attributes:
        events: ``(key, nbytes)`` in time order: ``nbytes > 0`` allocates a block for
            ``key``, ``nbytes < 0`` frees it (see :func:`simulate_reserved`).
        marks: ``(first event index, step, phase)`` where each phase of each step begins
            (step 0: before the first step: the weights, the libraries' workspaces).
        sources: what made each key's storage: ``"aten.addmm.default; forward; activations"``
            (the operator, the phase it was made in, what it was at the peak's accounting).

    Example::

        >>> ev = StepEvents(((1, 512), (2, 512), (1, -512)), marks=((0, 1, "forward"), (2, 1, "backward")))
        >>> ev.phase_at(1), ev.phase_at(2)
        ((1, 'forward'), (1, 'backward'))
    """

    events: tuple[tuple[int, int], ...]
    marks: tuple[tuple[int, int, str], ...] = ()
    sources: Mapping[int, str] = field(default_factory=dict)
    #: the event index before which each thread's cuBLAS workspace is made in a fresh process (just
    #: after its first cuBLAS operator's outputs), in first-use order (the script's thread, then
    #: autograd's; empty: none ran, or compiled code hid them)
    blas_first: tuple[int, ...] = ()
    #: the keys of workspaces a library does without when the allocator refuses them (cuDNN's
    #: convolutions run another plan): the replay under a limit skips them then
    fallback: frozenset[int] = frozenset()

    def phase_at(self, index: int) -> tuple[int, str]:
        """``(step, phase)`` of the event at ``index`` (``(0, "")`` before the first mark)."""
        starts = [m[0] for m in self.marks]
        i = bisect.bisect_right(starts, index) - 1
        if i < 0:
            return 0, ""
        return self.marks[i][1], self.marks[i][2]

    def __add__(self, other: StepEvents) -> StepEvents:
        """These events, then ``other``'s (its marks shifted after them)."""
        shift = len(self.events)
        marks = self.marks + tuple((i + shift, s, p) for i, s, p in other.marks)
        blas_first = self.blas_first or tuple(i + shift for i in other.blas_first)
        return StepEvents(self.events + other.events, marks, {**self.sources, **other.sources}, blas_first,
                          self.fallback | other.fallback)  # fmt: skip


#: Where a process has cuBLAS's workspaces when the step it is asked about begins (see
#: :func:`workspaces_at_first_use`): ``"fresh"``, made at each thread's first cuBLAS operator (a new
#: process's first step: a user's training run, the batch search's default); ``"warmed"``, made
#: already (after a warm-up step, a validation loop, an earlier run: as the profiler's measurements
#: and the estimate's reserved take it); ``"either"``, both replayed.
PROCESSES = ("warmed", "fresh", "either")


def with_headroom(events: Sequence[tuple[int, int]], headroom: Mapping[int, int]) -> list[tuple[int, int]]:
    """``events`` with each block of ``headroom``'s keys asking that many bytes more, its free the same:
    the step as it runs where each kernel block takes what its rule's bound allows
    (``MemoryEstimate.reserved_bound``). The order stays: a block's size never orders its events.

    Example::

        >>> with_headroom([(0, 512), (1, 4096), (1, -4096), (0, -512)], {1: 1024})
        [(0, 512), (1, 5120), (1, -5120), (0, -512)]
    """
    return [(key, n + headroom[key] if n > 0 else n - headroom[key]) if key in headroom else (key, n) for key, n in events]


def workspaces_at_first_use(workspace_events: Sequence[tuple[int, int]], events: Sequence[tuple[int, int]],
                            first_use: Sequence[int]) -> list[tuple[int, int]]:
    """``events`` with each cuBLAS workspace made where a fresh process makes it: the ``i``-th of
    ``workspace_events`` just before event ``first_use[i]``, the event after the ``i``-th thread's
    first cuBLAS operator's outputs (the kernel asks for its workspace when it calls cuBLAS, its
    output made: an H200's allocator trace shows it so for an MLP's ``addmm`` and ``mm`` and for
    Qwen2's first matrix products, forward and backward); workspaces without a first use (unknown)
    stay before the step, as in a warmed process.

    In a fresh process the workspace is made inside the step, amid its blocks, and near a limit that
    lays the later blocks out otherwise: two steps of Qwen2 at batch 17 reserve 1.08 GB more in a
    fresh process on an H200 than after a warm-up step. Placed before the output instead, the
    workspace takes a free block the output then lacks: an MLP's replay reserved 29 MB more than the
    fresh process did, which gave the same as a warmed one.

    Example::

        >>> workspaces_at_first_use([(-1, 8), (-2, 8)], [(0, 4), (1, 4), (0, -4)], [1, 3])
        [(0, 4), (-1, 8), (1, 4), (0, -4), (-2, 8)]
    """
    placed: dict[int, list[tuple[int, int]]] = {}
    for at, event in zip(first_use, workspace_events):
        placed.setdefault(at, []).append(event)
    out = list(workspace_events[len(first_use):])
    for i, event in enumerate(events):
        out += placed.get(i, ())
        out.append(event)
    out += placed.get(len(events), ())
    return out


#: Apart enough that addresses made up from creation order never overlap a segment.
_SYNTHETIC_SPACING = 1 << 44
#: Where made-up addresses start, going down (a segment given an address is left above them or below).
_SYNTHETIC_TOP = 1 << 62


class _Segment:
    __slots__ = ("number", "address", "size", "small", "blocks", "offsets")

    def __init__(self, number: int, address: int, size: int, small: bool) -> None:
        self.number, self.address, self.size, self.small = number, address, size, small
        #: offset -> [bytes, key of the allocation holding it (None: free)]
        self.blocks: dict[int, list] = {0: [size, None]}
        self.offsets: list[int] = [0]


class AllocatorReplay:
    """The CUDA caching allocator's default rules (see the module), replayed over a step's
    allocations and frees on one stream.

    Args:
        limit: the bytes the segments may total (``set_per_process_memory_fraction``
            times the device's memory); ``None``: no limit.
        record: keep :attr:`trace`, every action as a :class:`ReplayEntry`.
        addresses: the addresses of the segments to make, in order (a real run's, to
            take its tie-breaks); past them, and by default, each new segment is placed
            below all the others, as ``cudaMalloc`` was seen to place them (see the module).
        fallback: keys of workspaces a library does without when refused (cuDNN's convolutions
            catch the ``OutOfMemoryError`` and run another plan, :attr:`StepEvents.fallback`):
            one that does not fit under ``limit`` is skipped, not an out-of-memory.

    Attributes:
        reserved, allocated: bytes of segments and of blocks handed out now;
        peak_reserved, peak_allocated: the most of each;
        oom: ``(event index, bytes requested)`` of the request that did not fit, or ``None``;
        releases: how often a refused segment made it give back its wholly free segments;
        fallbacks: how many ``fallback`` workspaces were refused and skipped;
        trace: what it did, when ``record``.

    Example::

        >>> mib = 1 << 20
        >>> replay = AllocatorReplay(limit=22 * mib).run([(1, 3 * mib), (1, -3 * mib), (2, 1000), (3, 21 * mib)])
        >>> replay.oom, replay.releases, replay.reserved == 2 * mib
        ((3, 22020096), 1, True)
        >>> replay = AllocatorReplay(limit=22 * mib, fallback={3}).run([(2, 1000), (3, 21 * mib), (3, -21 * mib), (4, 1000)])
        >>> replay.oom, replay.fallbacks, replay.reserved == 2 * mib
        (None, 1, True)
    """

    def __init__(
        self, *, limit: int | None = None, record: bool = False, addresses: Iterable[int] | None = None,
        fallback: Collection[int] = frozenset(),
    ) -> None:  # fmt: skip
        self.limit = limit
        self.record = record
        self.trace: list[ReplayEntry] = []
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.oom: tuple[int, int] | None = None
        self.releases = self.fallbacks = 0
        self._fallback = fallback
        self._pools: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}  # (size, address, segment, offset)
        self._segments: dict[int, _Segment] = {}
        self._where: dict[int, tuple[int, int]] = {}
        self._addresses: Iterator[int] | None = iter(addresses) if addresses is not None else None
        self._made = 0
        self._index = -1

    # -- what a caller sees ------------------------------------------------------------
    @property
    def segments(self) -> list[tuple[int, int, bool, list[tuple[int, int | None]]]]:
        """Each segment as ``(address, bytes, small, [(block bytes, key or None if free), ...])``, by address."""
        out = []
        for seg in sorted(self._segments.values(), key=lambda s: s.address):
            out.append((seg.address, seg.size, seg.small, [(seg.blocks[o][0], seg.blocks[o][1]) for o in seg.offsets]))
        return out

    def run(self, events: Iterable[tuple[int, int]]) -> AllocatorReplay:
        """Replay ``events`` (``(key, +bytes)`` allocates, ``(key, -bytes)`` frees); stops at an out-of-memory."""
        for index, (key, nbytes) in enumerate(events):
            self._index = index
            if nbytes > 0:
                if not self.malloc(key, nbytes):
                    break
            elif nbytes < 0:
                self.free(key)
        return self

    # -- the allocator's moves -----------------------------------------------------------
    def malloc(self, key: int, nbytes: int) -> bool:
        """Hand ``key`` a block of ``nbytes`` (rounded); ``False``: out of memory under the limit."""
        size = block_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1, -1))
        if i < len(pool):
            _, _, number, offset = pool.pop(i)
            seg = self._segments[number]
        else:
            seg_bytes = segment_size(nbytes)
            if self.limit is not None and self.reserved + seg_bytes > self.limit:
                self.release_cached()
                if self.reserved + seg_bytes > self.limit:
                    if key in self._fallback:  # the library runs without it; its free finds nothing
                        self.fallbacks += 1
                        self._note("fallback", key, nbytes, 0, nbytes)
                        return True
                    self.oom = (self._index, nbytes)
                    self._note("oom", key, nbytes, 0, nbytes)
                    return False
            seg, offset = self._new_segment(seg_bytes, small), 0
        block = seg.blocks[offset]
        rest = block[0] - size
        if rest >= (MIN_BLOCK if small else SMALL_SIZE + 1):
            block[0] = size
            seg.blocks[offset + size] = [rest, None]
            bisect.insort(seg.offsets, offset + size)
            bisect.insort(pool, (rest, seg.address + offset + size, seg.number, offset + size))
        block[1] = key
        self._where[key] = (seg.number, offset)
        self.allocated += block[0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._note("alloc", key, block[0], seg.address + offset, nbytes)
        return True

    def free(self, key: int) -> None:
        """Give ``key``'s block back to its pool, merged with its free neighbours (unknown keys: nothing)."""
        found = self._where.pop(key, None)
        if found is None:
            return
        number, offset = found
        seg = self._segments[number]
        pool = self._pools[seg.small]
        size = seg.blocks[offset][0]
        self.allocated -= size
        self._note("free", key, size, seg.address + offset)
        i = bisect.bisect_left(seg.offsets, offset)
        after = seg.offsets[i + 1] if i + 1 < len(seg.offsets) else None
        if after is not None and seg.blocks[after][1] is None:
            self._unpool(pool, seg, after)
            size += seg.blocks.pop(after)[0]
            seg.offsets.pop(i + 1)
        before = seg.offsets[i - 1] if i > 0 else None
        if before is not None and seg.blocks[before][1] is None:
            self._unpool(pool, seg, before)
            del seg.blocks[offset]
            seg.offsets.pop(i)
            size += seg.blocks[before][0]
            offset = before
        seg.blocks[offset] = [size, None]
        bisect.insort(pool, (size, seg.address + offset, seg.number, offset))

    def release_cached(self) -> int:
        """Give back every segment that is one free block, of both pools (``release_cached_blocks``); the bytes."""
        self.releases += 1
        freed = 0
        for seg in sorted(self._segments.values(), key=lambda s: (s.small, s.size, s.address)):
            if len(seg.offsets) == 1 and seg.blocks[0][1] is None:
                self._unpool(self._pools[seg.small], seg, 0)
                del self._segments[seg.number]
                self.reserved -= seg.size
                freed += seg.size
                self._note("segment_free", None, seg.size, seg.address)
        return freed

    def add_segment(self, size: int, blocks: Iterable[tuple[int, int | None]], *, small: bool, address: int | None = None) -> None:
        """A segment that exists before the events (a real run's, the libraries' workspaces): its
        blocks ``(bytes, key)`` in address order, ``key`` ``None`` for a free one."""
        seg = self._new_segment(size, small, address)
        pool = self._pools[small]
        seg.blocks, seg.offsets = {}, []
        offset = 0
        for nbytes, key in blocks:
            seg.blocks[offset] = [nbytes, key]
            seg.offsets.append(offset)
            if key is None:
                bisect.insort(pool, (nbytes, seg.address + offset, seg.number, offset))
            else:
                self._where[key] = (seg.number, offset)
                self.allocated += nbytes
            offset += nbytes
        if offset != size:
            raise ValueError(f"the blocks of a segment of {size} bytes add up to {offset}")
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    # -- inside ------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool, address: int | None = None) -> _Segment:
        if address is None and self._addresses is not None:
            address = next(self._addresses, None)
        if address is None:
            # below every segment held, and below every made-up address before it
            lowest = min((s.address for s in self._segments.values()), default=_SYNTHETIC_TOP)
            address = min(lowest, _SYNTHETIC_TOP - self._made * _SYNTHETIC_SPACING) - _SYNTHETIC_SPACING
            address = address // _SYNTHETIC_SPACING * _SYNTHETIC_SPACING
        seg = _Segment(self._made, address, size, small)
        self._made += 1
        self._segments[seg.number] = seg
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._note("segment_alloc", None, size, address)
        return seg

    @staticmethod
    def _unpool(pool: list[tuple[int, int, int, int]], seg: _Segment, offset: int) -> None:
        entry = (seg.blocks[offset][0], seg.address + offset, seg.number, offset)
        i = bisect.bisect_left(pool, entry)
        if i < len(pool) and pool[i] == entry:
            pool.pop(i)

    def _note(self, action: str, key: int | None, size: int, address: int, requested: int = 0) -> None:
        if self.record:
            self.trace.append(ReplayEntry(action, self._index, key, size, address, self.reserved, self.allocated, requested))


def replay_whole_blocks(workspace_events: Sequence[tuple[int, int]], events: Sequence[tuple[int, int]],
                        at: Iterable[int]) -> tuple[int, dict[int, int]]:  # fmt: skip
    """The workspaces' blocks (made before the step, never freed), then a step's ``events``, replayed
    without a limit: the most bytes of segments (as :func:`simulate_reserved`), and for each ``n`` in
    ``at`` the bytes of blocks handed out after the step's first ``n`` events, counted as
    ``torch.cuda.memory_allocated()`` counts them (whole blocks), the workspaces' left out.

    A block is split only where what remains is at least 512 bytes (small pool) or more than 1 MiB
    (large pool): an 11 MiB request takes all of a new 12 MiB segment, a 125 MiB one all of 126 MiB,
    and the allocator counts the whole block as allocated. These remainders are what separates a
    step's requests from ``torch.cuda.max_memory_allocated()`` (80 MiB of a Llama step's 5.9 GB on
    an H200: 1.4%).

    Example::

        >>> mib = 1 << 20
        >>> reserved, whole = replay_whole_blocks([], [(1, 11 * mib), (2, 600), (2, -600)], at=[1, 2])
        >>> reserved == 12 * mib + (2 << 20), whole[1] == 12 * mib, whole[2] == 12 * mib + 1024
        (True, True, True)
    """
    replay = AllocatorReplay().run(workspace_events)
    base = replay.allocated
    whole: dict[int, int] = {}
    done = 0
    for n in sorted({min(max(n, 0), len(events)) for n in at}):
        replay.run(events[done:n])
        done = n
        whole[n] = replay.allocated - base
    replay.run(events[done:])
    return replay.peak_reserved, whole


def simulate_reserved(events: Iterable[tuple[int, int]], *, limit: int | None = None, fallback: Collection[int] = frozenset()) -> int | None:
    """The most bytes of segments the caching allocator would hold over ``events``.

    ``events`` are ``(key, nbytes)`` pairs in time order: a positive ``nbytes``
    allocates a block for ``key``, a negative one frees it. Replayed by
    :class:`AllocatorReplay`: best fit in each pool, splitting and merging as the
    allocator does. Without ``limit`` no segment is ever given back
    (``torch.cuda.empty_cache()`` is never called during a step). With ``limit``
    (what ``torch.cuda.set_per_process_memory_fraction`` allows), a segment that
    would take the reserved bytes past it first makes the allocator give back its
    wholly free segments and try again, as it does before raising an out-of-memory
    error; ``None`` if it still does not fit, unless its key is in ``fallback``: a workspace
    its library does without (:attr:`StepEvents.fallback`), skipped.

    Approximations: one stream, default settings; ties between free blocks of one
    size go to the newer segment (the real allocator takes the lower address, which
    ``cudaMalloc`` chose, and it was seen to choose lower ones for later segments);
    of the memory a kernel takes for itself inside an operator, only what
    :mod:`~.scratch`'s rules give is in ``events`` (an allocation and a free around
    the operator).

    Example::

        >>> simulate_reserved([(1, 1000), (2, 3 << 20), (1, -1000), (3, 1000)]) == (2 << 20) + (20 << 20)
        True
        >>> simulate_reserved([(1, 3 << 20), (1, -(3 << 20)), (2, 12 << 20)], limit=20 << 20) == 20 << 20
        True
        >>> simulate_reserved([(1, 3 << 20), (2, 19 << 20)], limit=30 << 20) is None  # 20 MiB + 20 MiB
        True
    """
    replay = AllocatorReplay(limit=limit, fallback=fallback).run(events)
    return None if replay.oom is not None else replay.peak_reserved
