"""Device memory counters: a reader (with :mod:`.allocator` and :mod:`.outside`, the only
modules that call a device's memory API; they know nothing of iterations).

Every backend answers the same four questions through :class:`MemoryCounter`:
bytes allocated to tensors now, the most allocated since the previous mark,
bytes the caching allocator holds (reserved; the seed's "cached"), and its peak since
the previous mark. Where a backend has no such counter the answer is ``None``
(shown as "n/a"), never a made-up zero.

On CPU PyTorch keeps no counters, so :class:`CpuCounter` counts live tensor
storages itself with a dispatch mode and weak references (one mode for the
whole process: :mod:`.storage_counting`).

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.measure.devices import make_counter
    >>> counter = make_counter(torch.device("cpu"))
    >>> counter.start()
    >>> x = torch.zeros(256)            # 1024 bytes of float32
    >>> counter.read().allocated >= 1024
    True
    >>> counter.stop()
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Iterable, NamedTuple

import torch

from .storage_counting import Tally, shared_registry

__all__ = [
    "Reading",
    "MemoryCounter",
    "CudaCounter",
    "MpsCounter",
    "XpuCounter",
    "AcceleratorCounter",
    "CpuCounter",
    "make_counter",
    "usable_device",
    "resolve_device",
    "parse_device",
    "current_device",
    "device_index",
    "device_capacity",
    "cuda_multiprocessors",
    "accelerator_device",
    "rank_device",
]

_log = logging.getLogger("pytorch_mem_profiler")


class Reading(NamedTuple):
    """One look at a device's counters, in bytes.

    ``peak_allocated`` and ``peak_reserved`` cover the interval since the
    counter's previous :meth:`MemoryCounter.mark` (or since it started).
    ``None`` means the device has no such counter.
    """

    allocated: int
    peak_allocated: int | None
    reserved: int | None
    peak_reserved: int | None


class MemoryCounter:
    """The interface every device backend implements.

    ``mark()`` reads the counters and starts a new peak interval; it is called
    at phase boundaries (forward start, backward end, ...), so the peak of each
    interval is known exactly. Resetting peaks is global to the device: after
    ``mark()``, ``torch.cuda.max_memory_allocated()`` reports the peak since
    that mark, not since the program started. Several counters of one device
    (a profiler and a ``memory_usage`` block inside it, say) stay right
    together: before one resets the device's peaks, the others fold the peak
    reached so far into their own interval.
    """

    device: torch.device
    #: whether ``peak_allocated`` is ever known on this device
    has_peak: bool = True
    #: whether ``reserved`` (the allocator's cache) is known on this device
    has_reserved: bool = True
    #: whether resetting this counter's peak resets it for every counter of the device
    shares_peaks: bool = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._folded_allocated: int | None = None
        self._folded_reserved: int | None = None
        self._peer_set: weakref.WeakSet | None = None
        if self.shares_peaks:
            self._peer_set = _peers(device)
            self._peer_set.add(self)

    @property
    def failed(self) -> bool:
        """Whether a fault of its own stopped the counter: its figures no longer follow the
        device (the device's own counters never stop)."""
        return False

    def start(self) -> None:
        """Begin counting (a no-op where the device counts by itself)."""

    def stop(self) -> None:
        """Stop counting and release what :meth:`start` installed.

        A stopped counter no longer takes part in its device's peak folding.
        """
        if self._peer_set is not None:
            self._peer_set.discard(self)

    def _read_device(self) -> Reading:
        """The device's own counters, peaks since the device's last reset by anyone."""
        raise NotImplementedError

    def read(self) -> Reading:
        """Current counters; peaks since this counter's previous mark."""
        return self._merge(self._read_device())

    def mark(self) -> Reading:
        """Read the counters, then start a new peak interval."""
        # On the hot path (several times per training iteration): keep it lean.
        raw = self._read_device()
        reading = raw
        if self._folded_allocated is not None or self._folded_reserved is not None:
            reading = self._merge(raw)
            self._folded_allocated = self._folded_reserved = None
        peers = self._peer_set
        if peers is not None and len(peers) > 1 and raw.peak_allocated is not None:
            for peer in list(peers):
                if peer is not self:
                    peer._fold(raw)
        self.reset_peak()
        return reading

    def _merge(self, raw: Reading) -> Reading:
        """``raw`` with the peaks other counters' resets folded into this interval."""
        if self._folded_allocated is None and self._folded_reserved is None:
            return raw
        return Reading(
            raw.allocated,
            _max(raw.peak_allocated, self._folded_allocated),
            raw.reserved,
            _max(raw.peak_reserved, self._folded_reserved),
        )

    def _fold(self, raw: Reading) -> None:
        self._folded_allocated = _max(self._folded_allocated, raw.peak_allocated)
        self._folded_reserved = _max(self._folded_reserved, raw.peak_reserved)

    def reset_peak(self) -> None:
        """Start a new peak interval on the device (use :meth:`mark` to keep peers right)."""

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before :meth:`start` (CPU only)."""


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


_PEERS: dict[tuple[str, int], weakref.WeakSet] = {}


def _peers(device: torch.device) -> weakref.WeakSet:
    """The live counters of one device, which share its peak statistics."""
    key = (device.type, device.index or 0)
    peers = _PEERS.get(key)
    if peers is None:
        peers = _PEERS[key] = weakref.WeakSet()
    return peers


def device_index(device: torch.device) -> int:
    """The device's index, 0 for an index-less one (``cuda`` is ``cuda:0`` to the counters)."""
    return device.index if device.index is not None else 0


class CudaCounter(MemoryCounter):
    """CUDA and ROCm (HIP builds of torch expose the same ``torch.cuda`` API)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._idx = device_index(device)
        # One nested-dict call gives all four numbers; the public
        # ``torch.cuda.memory_allocated()`` flattens ~150 entries per call.
        self._nested = getattr(torch._C, "_cuda_memoryStats", None)
        self._reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)

    def _read_device(self) -> Reading:
        if self._nested is not None:
            return _nested_reading(self._nested(self._idx))
        idx = self._idx
        return Reading(
            torch.cuda.memory_allocated(idx),
            torch.cuda.max_memory_allocated(idx),
            torch.cuda.memory_reserved(idx),
            torch.cuda.max_memory_reserved(idx),
        )

    def reset_peak(self) -> None:
        if self._reset is not None:
            self._reset(self._idx)
        else:
            torch.cuda.reset_peak_memory_stats(self._idx)

    def mark(self) -> Reading:
        # Several times per reported iteration: when it is the device's only counter
        # and nothing is folded in, one read and one reset, no further call.
        nested, reset = self._nested, self._reset
        if (
            nested is None
            or reset is None
            or self._folded_allocated is not None
            or self._folded_reserved is not None
            or len(self._peer_set or ()) > 1
        ):
            return super().mark()
        idx = self._idx
        stats = nested(idx)
        reset(idx)
        # _nested_reading, inline (once per iteration not reported)
        alloc = stats["allocated_bytes"]["all"]
        res = stats["reserved_bytes"]["all"]
        return _reading((alloc["current"], alloc["peak"], res["current"], res["peak"]))


#: ``Reading(*values)`` for a tuple of the four values, without the named tuple's ``__new__``
#: in Python (a frame per read on the light path)
_reading = functools.partial(tuple.__new__, Reading)


def _nested_reading(stats: dict[str, Any]) -> Reading:
    """The four counters of the allocator's nested statistics (``torch._C._cuda_memoryStats``)."""
    alloc = stats["allocated_bytes"]["all"]
    res = stats["reserved_bytes"]["all"]
    return _reading((alloc["current"], alloc["peak"], res["current"], res["peak"]))


class MpsCounter(MemoryCounter):
    """Apple MPS: allocated and driver-held memory; MPS keeps no peak."""

    has_peak = False
    shares_peaks = False

    def _read_device(self) -> Reading:
        return Reading(
            int(torch.mps.current_allocated_memory()),
            None,
            int(torch.mps.driver_allocated_memory()),
            None,
        )


class XpuCounter(MemoryCounter):
    """Intel XPU through ``torch.xpu``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._idx = device_index(device)
        xpu = torch.xpu
        self.has_peak = hasattr(xpu, "max_memory_allocated")
        self.has_reserved = hasattr(xpu, "memory_reserved")

    def _read_device(self) -> Reading:
        xpu, idx = torch.xpu, self._idx
        return Reading(
            int(xpu.memory_allocated(idx)),
            int(xpu.max_memory_allocated(idx)) if self.has_peak else None,
            int(xpu.memory_reserved(idx)) if self.has_reserved else None,
            int(xpu.max_memory_reserved(idx)) if self.has_reserved and self.has_peak else None,
        )

    def reset_peak(self) -> None:
        if self.has_peak:
            torch.xpu.reset_peak_memory_stats(self._idx)


class AcceleratorCounter(MemoryCounter):
    """Any other backend through the device-neutral ``torch.accelerator`` API."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._idx = device_index(device)

    def _read_device(self) -> Reading:
        acc, idx = torch.accelerator, self._idx
        return Reading(
            int(acc.memory_allocated(idx)),
            int(acc.max_memory_allocated(idx)),
            int(acc.memory_reserved(idx)),
            int(acc.max_memory_reserved(idx)),
        )

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self._idx)


class CpuCounter(MemoryCounter):
    """Counts live CPU tensor storages, exactly, through the process's one counting mode.

    Every storage an operator returns while the counter runs is counted once,
    by its ``nbytes()``, until its last reference dies. Tensors made before
    :meth:`start` are counted only when handed to :meth:`adopt` (the profiler
    adopts the model's and optimizer's tensors). "Reserved" equals allocated:
    CPU has no cache that PyTorch accounts for. Memory that kernels allocate
    internally and free before returning is not seen, so peaks are those of
    live tensors.

    All CPU counters share one dispatch mode
    (:mod:`~pytorch_mem_profiler.measure.storage_counting`): several profilers
    start and stop in any order and, once the last has stopped, no mode is left
    on torch's stack. It costs one Python call per operator while a counter
    runs: what any dispatch mode costs (2-9 us on a 2-core CPU), plus about
    0.1 us for a view or in-place result and 1 us for a new storage; see
    docs/benchmarks.md, "Training on the CPU".
    """

    shares_peaks = False  # each CPU counter counts by itself

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))
        self._registry = shared_registry()
        self._tally = Tally()
        self._running = False

    def start(self) -> None:
        if self._running:
            return
        self._registry.start(self._tally)
        self._running = True

    def stop(self) -> None:
        super().stop()
        if not self._running:
            return
        self._registry.stop(self._tally)
        self._running = False  # only now: a stop that raised is done again by a second call

    @property
    def failed(self) -> bool:
        return self._registry.failed

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        self._registry.adopt(tensors, self._tally)

    def _read_device(self) -> Reading:
        allocated, peak = self._tally.settle()
        return _reading((allocated, peak, allocated, peak))

    def watch_storages(self) -> tuple[dict[Any, int], list[tuple[Any, int]]]:
        """Key the changes by storage from now on (the peak breakdown, reported iterations):
        the storages counted now with their bytes, and the list each later change lands in."""
        return self._registry.watch(self._tally)

    def unwatch_storages(self) -> None:
        """Stop keying the changes by storage."""
        self._registry.unwatch(self._tally)

    def storage_ref(self, tensor: torch.Tensor) -> Any:
        """The counted storage of ``tensor`` (the key :meth:`watch_storages` uses); ``None`` if not counted."""
        return self._registry.ref_of(tensor)

    def mark(self) -> Reading:
        # No peers to fold (shares_peaks is False): read, then start the new interval.
        reading = self._read_device()
        self._tally.settle(reset=True)
        return reading

    def reset_peak(self) -> None:
        self._tally.settle(reset=True)


def usable_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` whose memory this process can count; ``ValueError`` naming it if not.

    Refused: what torch cannot parse, the meta device, and a device type that is
    not available here (CUDA without a driver under PyTorch's default wheel, an
    ``"xla"`` or ``"hpu"`` device with no such backend, a GPU index beyond those
    visible).

    Example::

        >>> usable_device("cpu")
        device(type='cpu')
        >>> usable_device("meta")
        Traceback (most recent call last):
        ...
        ValueError: device='meta': the meta device holds no memory to profile
    """
    resolved = parse_device(device)
    kind = resolved.type
    if kind == "cpu":
        return resolved
    if kind == "meta":
        raise ValueError(f"device={device!r}: the meta device holds no memory to profile")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} was asked for, but CUDA is not available")
        if device_index(resolved) >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r} was asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return resolved
    if kind == "mps":
        if not (hasattr(torch, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"device={device!r} was asked for, but MPS is not available")
        return resolved
    if kind == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise ValueError(f"device={device!r} was asked for, but XPU is not available")
        return resolved
    acc = getattr(torch, "accelerator", None)
    current = None
    if acc is not None and hasattr(acc, "memory_allocated") and acc.is_available():
        current = acc.current_accelerator()
    if current is None or current.type != kind:
        raise ValueError(
            f"device={device!r}: no {kind!r} device is available to this process "
            f"(torch {torch.__version__} has no memory counters for it here)"
        )
    return resolved


def make_counter(device: torch.device) -> MemoryCounter:
    """Return the counter for ``device``; ``ValueError`` for a device it cannot count.

    Example::

        >>> import torch
        >>> type(make_counter(torch.device("cpu"))).__name__
        'CpuCounter'
    """
    kind = usable_device(device).type
    if kind == "cpu":
        return CpuCounter(device)
    if kind == "cuda":
        return CudaCounter(device)
    if kind == "mps":
        return MpsCounter(device)
    if kind == "xpu":
        return XpuCounter(device)
    return AcceleratorCounter(device)


def resolve_device(model: torch.nn.Module, device: Any = None) -> torch.device:
    """The device to profile: ``device`` if given, else the model's first parameter's.

    A CUDA device without an index becomes the current one, so the counters
    read the device the tensors are really on.

    Example::

        >>> import torch
        >>> resolve_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    if device is not None:
        return parse_device(device)
    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    return parse_device(first.device if first is not None else "cpu")


def parse_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, a CUDA one with its index; ``ValueError`` naming it if invalid.

    Example::

        >>> parse_device("cpu")
        device(type='cpu')
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device torch understands: {err}") from err
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def current_device() -> torch.device:
    """The device tensors go to by default here: the current CUDA, MPS or XPU device, else CPU.

    Example::

        >>> import torch
        >>> current_device().type in ("cuda", "mps", "xpu", "cpu")
        True
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        return torch.device("mps")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def device_capacity(device: torch.device) -> int | None:
    """Bytes of memory the device has in all (``None`` where torch cannot tell, and on CPU).

    CUDA and XPU report their total memory; MPS the most it recommends a process
    use. Never initializes a device that is not available.

    Example::

        >>> import torch
        >>> device_capacity(torch.device("cpu")) is None
        True
    """
    kind = device.type
    if kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device_index(device)).total_memory)
    if kind == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return int(torch.xpu.get_device_properties(device_index(device)).total_memory)
    if kind == "mps" and hasattr(torch, "mps") and torch.backends.mps.is_available():
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        return int(recommended()) if recommended is not None else None
    return None


def cuda_multiprocessors(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's streaming multiprocessors and resident threads per multiprocessor
    (``None`` off CUDA or where no CUDA device is present). Never initializes an absent device.

    Example::

        >>> import torch
        >>> cuda_multiprocessors(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index(device))
    return int(props.multi_processor_count), int(getattr(props, "max_threads_per_multi_processor", 2048))


def accelerator_device(device_type: str, index: int | None = None) -> torch.device | None:
    """``device_type``'s device ``index``, or its current device when ``index`` is ``None`` or
    not a visible device; ``None`` when that backend is not available.

    Example::

        >>> accelerator_device("no-such-backend") is None
        True
    """
    module = getattr(torch, device_type, None)
    try:
        if module is None or not module.is_available():
            return None
        if index is None or index >= module.device_count():
            index = module.current_device()
    except AttributeError:  # a backend module without the usual device calls
        return None
    return torch.device(device_type, index)


def rank_device(model: torch.nn.Module, info: Any) -> torch.device:
    """The device a rank profiles: where its model lives.

    ``info`` is a :class:`~pytorch_mem_profiler.distributed.RankInfo`. The first
    parameter or buffer on an accelerator decides. A model with none there (a
    parameterless stage, FSDP2 with its shards offloaded to the CPU) under an
    accelerator backend (NCCL) computes on the rank's accelerator:
    ``LOCAL_RANK``, or the current device when ``LOCAL_RANK`` is not a visible
    device. Otherwise the model's device as on one process.

    Example::

        >>> from pytorch_mem_profiler.distributed import RankInfo
        >>> info = RankInfo(rank=0, world_size=2, local_rank=0, host="h", backends={"cpu": "gloo"})
        >>> rank_device(torch.nn.Linear(2, 2), info)
        device(type='cpu')
    """
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type not in ("cpu", "meta"):
            return resolve_device(model, tensor.device)
    for device_type, backend in info.backends.items():
        if device_type == "cpu" or backend == "gloo":
            continue
        found = accelerator_device(device_type, info.local_rank)
        if found is not None:
            return found
    return resolve_device(model)
