"""Headroom: how close an iteration's peak comes to the device's memory, and a warning near the limit.

The first thing a user asks of a memory report is how much room is left.
Each record carries the device's capacity (``device_total``, ``None`` on the
CPU and where torch cannot tell) and the iteration's peak as a share of it
(``peak_share``). :func:`of_capacity` writes ``2,571 MB of 143 GB (1.8%)`` for
every report mode; :class:`HeadroomCheck` finds, once, the first reported
record whose peak passed :data:`WARN_SHARE` of the device, and the profiler
issues :class:`HeadroomWarning` for it.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> rec = IterationRecord(epoch=1, iteration=3, step=3, device="cuda:0", allocated=0,
    ...                       iteration_peak_allocated=2_571_000_000, device_total=143_771_000_000)
    >>> of_capacity(rec.iteration_peak_allocated, rec.device_total, "MB")
    '2571 MB of 144 GB (1.8%)'
    >>> HeadroomCheck().observe(rec) is None
    True
"""

from __future__ import annotations

from ..stats import IterationRecord
from ..units import UNITS, format_amount, significant

__all__ = ["HeadroomWarning", "HeadroomCheck", "WARN_SHARE", "capacity_unit", "share_text", "of_capacity"]

#: A peak above this share of the device's memory is warned about (once).
WARN_SHARE = 0.9

_DECIMAL = ("B", "KB", "MB", "GB")
_BINARY = ("B", "KiB", "MiB", "GiB")


class HeadroomWarning(UserWarning):
    """An iteration's peak passed 90% of the device's memory: an out-of-memory error is near."""


def capacity_unit(total: int, unit: str) -> str:
    """The unit a capacity reads best in: the largest of ``unit``'s family (decimal or binary) it fills.

    Example::

        >>> capacity_unit(143_771_000_000, "MB"), capacity_unit(16 * 2**30, "MiB")
        ('GB', 'GiB')
    """
    family = _BINARY if unit in _BINARY[1:] else _DECIMAL
    return max((u for u in family if total >= UNITS[u]), key=lambda u: UNITS[u], default=unit)


def share_text(share: float) -> str:
    """A share (0 to 1) as a percentage with two significant digits: ``1.8%``, ``92%``."""
    return f"{significant(share * 100, 2)}%"


def of_capacity(nbytes: int | None, total: int | None, unit: str) -> str:
    """``<nbytes> of <total> (<share>)``; just ``<nbytes>`` where the capacity is unknown."""
    text = format_amount(nbytes, unit)
    if nbytes is None or not total:
        return text
    big = capacity_unit(total, unit)
    return f"{text} of {format_amount(total, big, digits=3)} ({share_text(nbytes / total)})"


def headroom_peak(record: IterationRecord) -> int | None:
    """The peak held against the device: this iteration's, else the run's so far."""
    if record.iteration_peak_allocated is not None:
        return record.iteration_peak_allocated
    return record.peak_allocated


class HeadroomCheck:
    """Finds, once, the first reported record whose peak passed ``share`` of the device.

    Besides the iteration's own peak it looks at the peak since the start, so an
    iteration between two reports that came near the limit is found at the next
    report.
    """

    def __init__(self, share: float = WARN_SHARE) -> None:
        self.share = share
        #: the message issued, once one was
        self.found: str | None = None

    def observe(self, record: IterationRecord, unit: str = "MB") -> str | None:
        """The warning's text the first time a record's peak passes the share; else ``None``."""
        total = record.device_total
        if self.found is not None or not total:
            return None
        iteration_peak = record.iteration_peak_allocated
        if iteration_peak is not None and iteration_peak > self.share * total:
            when = f"in iteration {record.iteration} of epoch {record.epoch}"
            peak = iteration_peak
        elif record.peak_allocated is not None and record.peak_allocated > self.share * total:
            when = f"by iteration {record.iteration} of epoch {record.epoch} (peak since the start)"
            peak = record.peak_allocated
        else:
            return None
        big = capacity_unit(total, unit)
        self.found = (
            f"allocated memory peaked at {format_amount(peak, big, digits=3)} {when}, "
            f"{share_text(peak / total)} of the device's {format_amount(total, big, digits=3)} "
            f"({record.device}): less than {share_text(round(1 - self.share, 6))} headroom; a larger batch, "
            "a longer sequence or the allocator's cache may not fit"
        )
        return self.found
