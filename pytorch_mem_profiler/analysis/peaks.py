"""What was alive at the peak, read from a run: the run's peak record and each epoch's, by category.

Files that record the peak's breakdown have a ``peak_<category>`` column per
:data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES` (weights, weight gradients,
optimizer state, feature maps saved for backward, intermediate gradients, the
input batch, other), summing to the iteration's ``iteration_peak_allocated``.
The summary, the HTML report and the plot show the breakdown of the record
whose iteration peak is the highest (of the run, or of an epoch); files
without the columns have no breakdown, and these functions return ``None``.

Example::

    >>> import pandas as pd
    >>> row = pd.Series({"epoch": 1, "iteration": 4, "iteration_peak_allocated": 100.0,
    ...                  "peak_phase": "backward", "peak_weights": 20.0, "peak_activations": 70.0,
    ...                  "peak_other": 10.0})
    >>> breakdown = breakdown_of(row)
    >>> breakdown.largest, breakdown.ranked()
    ('activations', [('activations', 70.0), ('weights', 20.0), ('other', 10.0)])
    >>> format_share(breakdown.share("activations")), format_share(0.0052)
    ('70%', '0.52%')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from ..stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS
from .runs import PEAK_COLUMNS, Run

__all__ = [
    "PeakBreakdown",
    "breakdown_of",
    "peak_breakdown",
    "epoch_breakdowns",
    "format_share",
    "peak_label",
]


@dataclass(frozen=True)
class PeakBreakdown:
    """Bytes alive at one record's iteration peak, by category.

    Attributes:
        epoch: the record's epoch.
        iteration: the record's iteration within its epoch.
        peak: the iteration's peak (``iteration_peak_allocated``), in bytes; the
            sum of the parts where the file does not have it.
        phase: the phase in which the peak was reached (``"backward"``...), or ``None``.
        parts: bytes by category, in :data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES`
            order (an empty cell counts as 0).
    """

    epoch: int
    iteration: int
    peak: float
    phase: str | None
    parts: Mapping[str, float]

    @property
    def largest(self) -> str:
        """The category with the most bytes (the first in :data:`PEAK_CATEGORIES` order on a tie)."""
        return max(PEAK_CATEGORIES, key=lambda c: (self.parts[c], -PEAK_CATEGORIES.index(c)))

    def share(self, category: str) -> float | None:
        """The category's bytes as a fraction of the peak; ``None`` for a peak of 0."""
        return self.parts[category] / self.peak if self.peak > 0 else None

    def ranked(self) -> list[tuple[str, float]]:
        """(category, bytes) of the categories with bytes, largest first (ties: vocabulary order)."""
        present = [(c, self.parts[c]) for c in PEAK_CATEGORIES if self.parts[c] > 0]
        return sorted(present, key=lambda item: -item[1])


def _known(value: object) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def breakdown_of(record: pd.Series) -> PeakBreakdown | None:
    """The breakdown of one record (a row of :attr:`Run.records`); ``None`` where it has none."""
    values = {c: record.get(column) for c, column in PEAK_COLUMNS.items()}
    if not any(_known(v) for v in values.values()):
        return None
    parts = {c: float(v) if _known(v) else 0.0 for c, v in values.items()}
    peak = record.get("iteration_peak_allocated")
    phase = record.get("peak_phase")
    return PeakBreakdown(
        epoch=int(record["epoch"]),
        iteration=int(record["iteration"]),
        peak=float(peak) if _known(peak) else sum(parts.values()),
        phase=str(phase) if _known(phase) and phase != "" else None,
        parts=parts,
    )


def _with_breakdown(records: pd.DataFrame) -> pd.DataFrame:
    columns = [c for c in PEAK_COLUMNS.values() if c in records]
    if not columns:
        return records.iloc[0:0]
    return records[records[columns].notna().any(axis=1)]


def _highest(records: pd.DataFrame) -> PeakBreakdown | None:
    rows = _with_breakdown(records)
    if not len(rows):
        return None
    parts = rows[list(PEAK_COLUMNS.values())].fillna(0).sum(axis=1)
    peaks = rows["iteration_peak_allocated"].fillna(parts)
    # idxmax: the first of equal peaks, so the earliest record stands for a steady run
    return breakdown_of(rows.loc[peaks.idxmax()])


def peak_breakdown(run: Run) -> PeakBreakdown | None:
    """The breakdown of the run's highest-peak record (among those that have one).

    The record whose ``iteration_peak_allocated`` is the highest; of equal ones,
    the earliest. ``None`` when no record has a breakdown.
    """
    return _highest(run.records)


def epoch_breakdowns(run: Run) -> dict[int, PeakBreakdown]:
    """Each epoch's highest-peak record's breakdown, by epoch (epochs without one left out)."""
    out = {}
    for epoch, group in run.records.groupby("epoch", sort=True):
        breakdown = _highest(group)
        if breakdown is not None:
            out[int(epoch)] = breakdown
    return out


def peak_label(category: str) -> str:
    """How a peak category is named for people (``"feature maps (saved for backward)"`` for
    ``"activations"``)."""
    return PEAK_CATEGORY_LABELS.get(category, category.replace("_", " "))


def format_share(fraction: float | None) -> str:
    """A fraction as a percentage: whole percents from 1%, two significant digits below;
    ``None`` or NaN is ``n/a``."""
    if not _known(fraction):
        return "n/a"
    percent = float(fraction) * 100  # type: ignore[arg-type]
    if percent == 0 or abs(percent) >= 1:
        return f"{percent:.0f}%"
    if abs(percent) < 0.01:
        return "<0.01%" if percent > 0 else ">-0.01%"
    return f"{percent:.2g}%"
