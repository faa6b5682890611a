"""The phase intervals: what the counters read at an iteration's boundaries give.

On a watched iteration the phase machine (:mod:`.phases`) reads the counters at
every boundary (forward's start and end, backward's, the step's; in per-layer
mode also where forward leaves and backward reaches a tracked module), each
read closing one interval and giving its peak. From those readings
:class:`PhaseIntervals` keeps:

- the peak of each phase and what was allocated at its end;
- the iteration's peak, the phase it was reached in and the module running then
  (per-layer mode; ``None`` where forward was not split by module, or backward not there);
- in per-layer mode, where backward peaked: the next per-layer iteration reads backward
  around that interval only while it peaks there (:meth:`PhaseIntervals.backward_marks`);
- the feature maps: what the largest forward pass left allocated, from its start
  to its exit from the model (kept for backward, with its outputs);
- the weight gradients, measured when backward ends (``optimizer.zero_grad()``
  sets them to ``None`` before ``record_stats()`` runs).

It is an observer (:mod:`.observers`) without a fault-guard part of its own:
the phases are what every other figure hangs on.

Example::

    >>> from pytorch_mem_profiler.measure.devices import Reading
    >>> intervals = PhaseIntervals([])
    >>> intervals.begin(None)
    >>> intervals.boundary(Reading(100, 100, None, None), "other", "forward", None)
    >>> intervals.forward_began((), None)
    >>> intervals.boundary(Reading(160, 220, None, None), "forward", "other", None)
    >>> f = intervals.figures()
    >>> f.iteration_peak, f.peak_phase, f.feature_maps, f.phase_end_allocated["forward"]
    (220, 'forward', 60, 160)
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .accounting import GradientSizes
from .devices import Reading
from .observers import Observer

__all__ = ["PhaseIntervals", "IntervalFigures"]


class IntervalFigures(NamedTuple):
    """The phase intervals' part of a record (bytes)."""

    #: the highest peak read in the iteration (``None``: the device keeps no peak)
    iteration_peak: int | None
    #: the phase it was reached in
    peak_phase: str | None
    #: the module running then (per-layer mode; ``""``: the model's own code)
    peak_location: str | None
    #: the highest reserved peak read in the iteration
    peak_reserved: int | None
    #: each phase's peak, and allocated at its end (its last occurrence)
    phase_peak: Mapping[str, int]
    phase_end_allocated: Mapping[str, int]
    #: what the largest forward pass left allocated
    feature_maps: int
    #: gradient bytes per parameter when the last backward ended (``None``: no backward seen)
    gradient_sizes: list[int] | None


#: ``IntervalFigures(*fields)`` made in C, without the Python ``__new__`` a NamedTuple has
_new_figures = functools.partial(tuple.__new__, IntervalFigures)


class PhaseIntervals(Observer):
    """Peaks and ends of the phases, feature maps and weight gradients (see the module's text).

    Args:
        params: ``(name, parameter)`` pairs whose gradients are measured.
    """

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self._gradient_sizes = GradientSizes(params)
        self.begin(None)

    def set_params(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Measure the gradients of ``params`` from now on (after the model changed)."""
        self._gradient_sizes = GradientSizes(params)

    def begin(self, plan: Any) -> None:
        self._iteration_peak: int | None = None
        self._peak_phase: str | None = None
        self._peak_location: str | None = None
        self._peak_reserved: int | None = None
        self._phase_peak: dict[str, int] = {}
        self._phase_end: dict[str, int] = {}
        self._feature_maps = 0
        self._gradients: list[int] | None = None
        # the last boundary's reading, the running pass's start, and the feature maps before it
        self._last: Reading | None = None
        self._start: Reading | None = None
        self._before = 0
        # per-layer mode: where this iteration reads backward (the plan's marks), each backward
        # interval's module ("": from backward's start; None: no module), and where it peaked
        self._marks: tuple[str, ...] | None = plan.backward_marks if plan is not None else None
        self._per_layer = plan is not None and plan.per_layer
        self._backward_labels: list[str | None] = []
        self._backward_peak = -1
        self._backward_peak_at: int | None = None

    def boundary(self, reading: Reading, ended: str, following: str, where: str | None) -> None:
        peak = reading.peak_allocated
        if peak is not None:
            phase_peak = self._phase_peak
            if peak > phase_peak.get(ended, -1):
                phase_peak[ended] = peak
            if self._iteration_peak is None or peak > self._iteration_peak:
                self._iteration_peak, self._peak_phase, self._peak_location = peak, ended, where
            if ended == "backward" and self._per_layer:
                labels = self._backward_labels
                if peak > self._backward_peak:
                    self._backward_peak, self._backward_peak_at = peak, len(labels)
                labels.append(where)
        reserved = reading.peak_reserved
        if reserved is not None and (self._peak_reserved is None or reserved > self._peak_reserved):
            self._peak_reserved = reserved
        if ended != following:
            if ended != "other":
                self._phase_end[ended] = reading.allocated
            if ended == "forward" and self._start is not None:
                # The model was left: what the pass keeps is known from here on (an OOM
                # post-mortem reads it mid-iteration).
                self._feature_maps = max(self._before, reading.allocated - self._start.allocated)
        self._last = reading

    def backward_marks(self) -> tuple[str, ...] | None:
        """Where the next per-layer iteration reads backward (:attr:`~.plan.IterationPlan.backward_marks`):
        from a backward read at every tracked module, the modules that began the interval where it
        peaked and the one after it (``("", b)``: from backward's start; ``(a,)``: to its end); from
        one read at those, the same while it peaked in that interval; ``None`` (every module) where
        it peaked elsewhere, no module began two intervals, or no backward peak was read.

        Example::

            >>> from pytorch_mem_profiler.measure.plan import IterationPlan
            >>> intervals = PhaseIntervals([])
            >>> intervals.begin(IterationPlan.make("full", per_layer=True))
            >>> for where, peak in (("", 10), ("2", 30), ("1", 20), ("0", 15)):  # backward reached 2, 1, 0
            ...     intervals.boundary(Reading(0, peak, None, None), "backward", "backward", where)
            >>> intervals.backward_marks()   # it peaked where module 2 began, up to module 1
            ('2', '1')
        """
        at, labels = self._backward_peak_at, self._backward_labels
        if at is None:
            return None
        if self._marks is not None:
            return self._marks if labels[at] is not None else None
        if None in labels or len(set(labels)) != len(labels):
            return None
        return tuple(label for label in labels[at : at + 2] if label is not None)

    def forward_began(self, args: Any, entry: Any) -> None:
        # at the boundary just read
        self._start, self._before = self._last, self._feature_maps

    def backward_finished(self) -> None:
        self._gradients = self._gradient_sizes()

    def figures(self) -> IntervalFigures:
        """The iteration's part of the record: what it has measured so far (all of it once its
        last boundary is read)."""
        return _new_figures(
            (
                self._iteration_peak,
                self._peak_phase,
                self._peak_location,
                self._peak_reserved,
                self._phase_peak,
                self._phase_end,
                self._feature_maps,
                self._gradients,
            )
        )
