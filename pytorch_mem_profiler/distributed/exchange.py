"""The cross-rank exchange: each rank's peaks brought to every rank, once an epoch.

Once per ``epoch_end()``, each rank's peaks and its largest categories go to
every rank with one small all-gather (:func:`gather_summaries`), so that one
rank can print which rank came closest to running out of memory
(:func:`~pytorch_mem_profiler.outputs.rank_table.format_cross_rank`). Nothing
here runs a collective per iteration.

Example::

    >>> summary = CrossRankSummary(epoch=1, ranks=(
    ...     RankSummary(rank=0, host="node1", device="cuda:0", peak_cached=8_000_000,
    ...                 peak_allocated=6_000_000, categories={"weights": 4_000_000}),
    ...     RankSummary(rank=1, host="node1", device="cuda:1", peak_cached=9_000_000,
    ...                 peak_allocated=7_000_000, categories={"feature maps": 5_000_000}),
    ... ))
    >>> summary.highest.rank, summary.highest.largest_category
    (1, ('feature maps', 5000000))
    >>> summary.stat("peak_cached")
    (8000000, 9000000, 8500000.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from ..measure.devices import accelerator_device
from ..stats import CATEGORIES as RECORD_CATEGORIES
from ..stats import IterationRecord
from .ranks import RankInfo

__all__ = [
    "RankSummary",
    "CrossRankSummary",
    "CATEGORIES",
    "summarize_rank",
    "encode_summary",
    "decode_summary",
    "gather_summaries",
    "GatherBuffers",
    "RankPeakTracker",
    "CrossRankExchange",
]

#: The record's categories compared across ranks: ``(label, IterationRecord field)``, in
#: the order of their slots in the all-gathered vector.
CATEGORIES: tuple[tuple[str, str], ...] = tuple((label, name) for name, label in RECORD_CATEGORIES.items())

# The all-gathered vector: a format number, the rank, two peaks, one slot per
# category, then the label "device\nhost" as UTF-8 bytes, one byte a slot (a
# long host name is cut, the device stays).
_FORMAT = 1
_HEAD = 4
_LABEL_BYTES = 128
_VECTOR_LENGTH = _HEAD + len(CATEGORIES) + _LABEL_BYTES
_UNKNOWN = -1


# -- one rank's figures -----------------------------------------------------------
@dataclass(frozen=True)
class RankSummary:
    """One rank's figures for the cross-rank table, in bytes (``None``: not known).

    Attributes:
        rank: the global rank.
        host: the host it runs on.
        device: the device it profiles.
        peak_cached: most bytes the allocator reserved since the profiler started.
        peak_allocated: most bytes allocated since the profiler started.
        categories: bytes by category label (see :data:`CATEGORIES`) in the
            epoch's iteration with the highest peak.
    """

    rank: int
    host: str = ""
    device: str = ""
    peak_cached: int | None = None
    peak_allocated: int | None = None
    categories: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def peak(self) -> int | None:
        """The peak that decides who runs out first: cached where known, else allocated."""
        return self.peak_cached if self.peak_cached is not None else self.peak_allocated

    @property
    def largest_category(self) -> tuple[str, int] | None:
        """``(label, bytes)`` of the largest category; ``None`` when none is known."""
        best = None
        for label, nbytes in self.categories.items():
            if best is None or nbytes > best[1]:
                best = (label, nbytes)
        return best


def summarize_rank(
    rank: int,
    host: str,
    latest: IterationRecord | None,
    peak: IterationRecord | None = None,
    device: str = "",
) -> RankSummary:
    """A rank's summary: peaks from its ``latest`` record, categories from its ``peak`` one.

    Example::

        >>> rec = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=10,
        ...                       peak_allocated=30, peak_cached=40, weights=8, feature_maps=12)
        >>> s = summarize_rank(0, "h", rec)
        >>> s.peak, s.largest_category
        (40, ('feature maps', 12))
    """
    where = peak if peak is not None else latest
    categories: dict[str, int] = {}
    if where is not None:
        for label, name in CATEGORIES:
            value = getattr(where, name, None)
            if isinstance(value, int) and value > 0:
                categories[label] = value
    return RankSummary(
        rank=rank,
        host=host,
        device=device or (latest.device if latest is not None else ""),
        peak_cached=latest.peak_cached if latest is not None else None,
        peak_allocated=latest.peak_allocated if latest is not None else None,
        categories=MappingProxyType(categories),
    )


class RankPeakTracker:
    """Keeps, per epoch, the record with the highest iteration peak: one comparison an iteration.

    Example::

        >>> t = RankPeakTracker()
        >>> for peak in (5, 9, 7):
        ...     t.observe(IterationRecord(epoch=1, iteration=1, step=1, device="cpu",
        ...                               allocated=0, iteration_peak_allocated=peak))
        >>> t.peak.iteration_peak_allocated, t.latest.iteration_peak_allocated
        (9, 7)
    """

    def __init__(self) -> None:
        self.peak: IterationRecord | None = None
        self.latest: IterationRecord | None = None

    def observe(self, record: IterationRecord) -> None:
        self.latest = record
        best = self.peak
        if not record.reported:
            return  # its categories were not measured: the epoch's peak is among the reported
        if best is None or (record.iteration_peak_allocated or 0) > (
            best.iteration_peak_allocated or 0
        ):
            self.peak = record

    def new_epoch(self) -> None:
        """Forget the epoch's peak record; the latest record stays for the next summary."""
        self.peak = None


class CrossRankExchange:
    """A rank's part in the cross-rank table: watches its records, gathers at each epoch end.

    Args:
        info: this process's rank.
    """

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.peaks = RankPeakTracker()
        self.buffers = GatherBuffers()
        #: the latest summary gathered (``None`` before the first, or once the group is gone)
        self.latest: CrossRankSummary | None = None

    def observe(self, record: IterationRecord) -> None:
        """Every record, reported or not: one comparison."""
        self.peaks.observe(record)

    def gather(self, epoch: int, device: torch.device, on_fault: Any = None) -> CrossRankSummary | None:
        """Every rank's summary of ``epoch``, on every rank (a collective: all ranks call it).

        A fault in this rank's own figures (passed to ``on_fault``) never keeps it
        out of the collective: it then contributes "nothing known". ``None`` once
        the process group is gone.
        """
        if not torch.distributed.is_initialized():
            return None  # the group was destroyed on every rank: nobody to gather from
        info, tracker = self.info, self.peaks
        local = None
        try:
            local = summarize_rank(info.rank, info.host, tracker.latest, tracker.peak, str(device))
        except Exception as exc:  # noqa: BLE001 - the collective below must run regardless
            if on_fault is None:
                raise
            on_fault(exc)
        tracker.new_epoch()
        ranks = gather_summaries(local, info, device, self.buffers)
        self.latest = CrossRankSummary(epoch=epoch, ranks=ranks)
        return self.latest

    def release(self) -> None:
        """Free the all-gather's tensors."""
        self.buffers = GatherBuffers()


# -- the wire format -------------------------------------------------------------
def encode_summary(summary: RankSummary) -> list[int]:
    """The fixed-length int64 vector a rank contributes to the all-gather."""

    def num(value: int | None) -> int:
        return _UNKNOWN if value is None else int(value)

    label = f"{summary.device}\n{summary.host}".encode("utf-8")[:_LABEL_BYTES]
    values = [_FORMAT, summary.rank, num(summary.peak_cached), num(summary.peak_allocated)]
    values += [num(summary.categories.get(label_, None)) for label_, _ in CATEGORIES]
    values += list(label) + [0] * (_LABEL_BYTES - len(label))
    return values


def decode_summary(values: Sequence[int]) -> RankSummary | None:
    """The summary back from :func:`encode_summary`'s vector; ``None`` for a rank that had none.

    Example::

        >>> s = RankSummary(rank=3, host="n2", device="cuda:1", peak_cached=7, categories={"weights": 5})
        >>> decode_summary(encode_summary(s)) == s
        True
    """
    if len(values) != _VECTOR_LENGTH or values[0] != _FORMAT:
        return None

    def num(value: int) -> int | None:
        return None if value < 0 else int(value)

    categories = {
        label: int(v)
        for (label, _), v in zip(CATEGORIES, values[_HEAD : _HEAD + len(CATEGORIES)])
        if v >= 0
    }
    raw = bytes(int(b) & 0xFF for b in values[_HEAD + len(CATEGORIES) :]).rstrip(b"\0")
    device, _, host = raw.decode("utf-8", errors="replace").partition("\n")
    return RankSummary(
        rank=int(values[1]),
        host=host,
        device=device,
        peak_cached=num(values[2]),
        peak_allocated=num(values[3]),
        categories=MappingProxyType(categories),
    )


def _collective_device(info: RankInfo, profiled: torch.device) -> torch.device:
    """Where the gathered tensor must live: the CPU when the group has a CPU backend
    (gloo), else the accelerator that backend runs on (NCCL needs CUDA tensors)."""
    backends = info.backends
    if not backends or "cpu" in backends:
        return torch.device("cpu")
    if profiled.type in backends:
        return profiled
    device_type = next(iter(backends))
    return accelerator_device(device_type) or torch.device(device_type)


class GatherBuffers:
    """The all-gather's tensors, made at the first epoch end and reused at every later one.

    NCCL keeps a collective's tensors until its watchdog thread reaps the
    finished work; tensors made afresh at each call would be freed by that
    thread at any later moment, moving the device's allocated figure between
    two of the profiler's readings. Reused, they are freed only with the
    profiler: ``(world_size + 1) * 1,128`` bytes on the device.
    """

    def __init__(self) -> None:
        self._key: tuple[torch.device, int] | None = None
        self.send: torch.Tensor | None = None
        self.receive: list[torch.Tensor] = []

    def get(self, device: torch.device, world_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self._key != (device, world_size) or self.send is None:
            self.send = torch.zeros(_VECTOR_LENGTH, dtype=torch.int64, device=device)
            self.receive = [torch.zeros_like(self.send) for _ in range(world_size)]
            self._key = (device, world_size)
        return self.send, self.receive


def gather_summaries(
    local: RankSummary | None,
    info: RankInfo,
    profiled: torch.device,
    buffers: GatherBuffers | None = None,
) -> tuple[RankSummary, ...]:
    """Every rank's summary, on every rank, through ONE ``all_gather`` of a small int64 tensor.

    A collective: every rank of the default group must call it, the same
    number of times. ``local=None`` contributes "nothing known", so a rank
    whose profiler failed still takes part and no rank waits for ever.
    """
    import torch.distributed as dist

    values = encode_summary(local) if local is not None else [0] * _VECTOR_LENGTH
    device = _collective_device(info, profiled)
    send, receive = (buffers or GatherBuffers()).get(device, info.world_size)
    send.copy_(torch.tensor(values, dtype=torch.int64))
    dist.all_gather(receive, send)
    rows = [row.tolist() for row in torch.stack(receive).cpu()]
    summaries = []
    for rank, row in enumerate(rows):
        decoded = decode_summary(row)
        summaries.append(decoded if decoded is not None else RankSummary(rank=rank))
    return tuple(summaries)


# -- every rank's figures ---------------------------------------------------------
@dataclass(frozen=True)
class CrossRankSummary:
    """Every rank's peaks at the end of an epoch.

    Attributes:
        epoch: the epoch that ended.
        ranks: one :class:`RankSummary` per rank, by rank.
    """

    epoch: int
    ranks: tuple[RankSummary, ...]

    def stat(self, name: str) -> tuple[int, int, float] | None:
        """``(min, max, mean)`` of ``peak_cached`` or ``peak_allocated`` over the ranks that know it."""
        values = [getattr(r, name) for r in self.ranks if getattr(r, name) is not None]
        if not values:
            return None
        return min(values), max(values), sum(values) / len(values)

    @property
    def highest(self) -> RankSummary | None:
        """The rank with the highest peak (cached where known): the first to run out of memory."""
        known = [r for r in self.ranks if r.peak is not None]
        return max(known, key=lambda r: (r.peak, -r.rank)) if known else None
