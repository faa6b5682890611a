"""Leak warnings: allocated memory that grows at the end of every reported iteration.

In a healthy loop the memory allocated when ``record_stats()`` runs is the
same from one iteration to the next, once the optimizer has made its state.
When it grows in each of ``window`` reported iterations in a row, something
keeps tensors alive: a loss summed with its graph (``total += loss`` instead
of ``loss.item()``), a list of outputs. The detector warns once, with the
growth per iteration, the category that grew and the iteration the growth
began at.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> detector = LeakDetector(window=3)
    >>> found = [detector.observe(IterationRecord(epoch=1, iteration=i, step=i, device="cpu",
    ...                                           allocated=1000 * i)) for i in range(1, 6)]
    >>> leak = next(f for f in found if f is not None)
    >>> leak.began_iteration, leak.growth_per_iteration, leak.category
    (1, 1000.0, 'other')
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..stats import CATEGORIES, MODEL_STATE, IterationRecord
from ..units import format_amount
from .notices import warn_user

__all__ = ["LeakWarning", "Leak", "LeakDetector", "category_growth"]


class LeakWarning(UserWarning):
    """Allocated memory grows from one reported iteration to the next.

    A :class:`UserWarning`, so Python shows it under its default filters; it
    points at the user's ``record_stats()`` line.
    """


@dataclass(frozen=True)
class Leak:
    """A growth of allocated memory across reported iterations."""

    began_epoch: int
    began_iteration: int
    growth_per_iteration: float  # bytes
    category: str
    iterations: int

    def message(self, unit: str = "MB") -> str:
        where = (
            "tensors kept alive by the training loop (not weights, gradients, optimizer state or "
            "buffers), e.g. a loss summed with its graph or a list of outputs"
            if self.category == "other"
            else CATEGORIES[self.category]
        )
        growth = format_amount(self.growth_per_iteration, unit, digits=3)
        return (
            f"allocated memory grows by {growth} per iteration "
            f"since iteration {self.began_iteration} of epoch {self.began_epoch} "
            f"({self.iterations} reported iterations in a row); what grew: {where}"
        )


def _other(record: IterationRecord) -> int:
    return record.allocated - record.weights - (record.optimizer_state or 0) - record.buffers


def category_growth(first: IterationRecord, last: IterationRecord) -> dict[str, int]:
    """Bytes each category grew by from ``first`` to ``last`` ("other": the rest of allocated).

    Gradients are left out of "other": they are measured when backward ends,
    while allocated is read when ``record_stats()`` runs, after ``zero_grad()``.
    """
    growth = {name: (getattr(last, name) or 0) - (getattr(first, name) or 0) for name in MODEL_STATE}
    growth["other"] = _other(last) - _other(first)
    growth["allocated"] = last.allocated - first.allocated
    return growth


class LeakDetector:
    """Watches reported records and reports the first steady growth of allocated memory."""

    def __init__(self, window: int = 5) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2, got {window!r}")
        self.window = window
        self.found: Leak | None = None
        self._recent: deque[IterationRecord] = deque(maxlen=window + 1)

    def observe(self, record: IterationRecord) -> Leak | None:
        """Feed one reported record; returns the leak the first time one is seen."""
        if self.found is not None:
            return None
        recent = self._recent
        if recent and record.allocated <= recent[-1].allocated:
            recent.clear()
        recent.append(record)
        if len(recent) <= self.window:
            return None
        first, last = recent[0], recent[-1]
        steps = max(1, last.step - first.step)
        growth = category_growth(first, last)
        category = max(("other", *MODEL_STATE), key=lambda name: growth[name])
        self.found = Leak(
            began_epoch=first.epoch,
            began_iteration=first.iteration,
            growth_per_iteration=growth["allocated"] / steps,
            category=category,
            iterations=len(recent) - 1,
        )
        return self.found

    def warn(self, leak: Leak, unit: str, log: Any = None) -> None:
        """Issue :class:`LeakWarning` at the user's line, and log it (``log``, else the package logger)."""
        warn_user(leak.message(unit), LeakWarning, log)
