"""The observers of a meter's watched iterations, and the plans that put them on.

An :class:`ObserverSet` holds the observers a :class:`~.meter.Meter` made for detailed
iterations (:mod:`.observers`): the phase intervals (every watched iteration), the peak
breakdown (where the device keeps a peak) and the per-layer attribution (``by_layer=True``).
For each level of detail it makes one immutable :class:`~.plan.IterationPlan` naming those
that run, and keeps it until the observers change; it tells those of a plan that their
iteration comes, learns where the per-layer iterations peak (forward is read at module
boundaries only while they peak there), and lets go of an observer a fault switched off.

The meter keeps what an iteration the hooks slept through reads itself, so that the light path
reads no field of this set: FSDP tracking (on every iteration, light ones included) is handed
to :meth:`ObserverSet.plan` as one of the observers every plan puts on.

Example::

    >>> from pytorch_mem_profiler.faults import FaultGuard
    >>> from pytorch_mem_profiler.measure.intervals import PhaseIntervals
    >>> observers = ObserverSet(by_layer=False, guard=FaultGuard())
    >>> light = observers.plan("light")
    >>> light.watched, light.observers, observers.plan("light") is light
    (False, (), True)
    >>> intervals = PhaseIntervals([])
    >>> observers.start_with(intervals)
    >>> observers.plan("phases").observers == (intervals,)
    True
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..faults import FaultGuard
from .intervals import PhaseIntervals
from .layers import ATTRIBUTION_PART, LayerAttribution
from .observers import Observer
from .peak_breakdown import BREAKDOWN_PART, PeakBreakdown
from .plan import IterationPlan

__all__ = ["ObserverSet"]

#: the key of the plan at "full" with forward split by module (the other plans': their level, and at
#: "full" where backward is read)
_SPLIT_FULL = "full, forward split"


class ObserverSet:
    """The observers of detailed iterations, and the plan each level of detail runs them under.

    Args:
        by_layer: whether feature maps are attributed to modules (a per-layer attribution is
            then made, and ``"full"`` is the richest level).
        guard: the meter's fault guard: the parts it switched off are let go of.

    Attributes:
        by_layer: as given.
        intervals: the phase intervals (``None`` until :meth:`start_with`).
        peak: the peak breakdown (``None``: none on this device, or switched off).
        attribution: the per-layer attribution (``None``: not by layer, or switched off).
        plans: the plans made, by level (at ``"full"``: and where forward and backward are split); read it,
            never change it (:meth:`plan` makes them).

    Example::

        >>> from pytorch_mem_profiler.faults import FaultGuard
        >>> from pytorch_mem_profiler.measure.intervals import PhaseIntervals
        >>> observers = ObserverSet(by_layer=True, guard=FaultGuard())
        >>> observers.start_with(PhaseIntervals([]))
        >>> observers.plan("full").split_forward, observers.plan("full").per_layer  # no attribution yet
        (False, False)
        >>> observers.peaked_in("optimizer", ("1", "0"))  # peaked in the step; backward in module 1's interval
        >>> observers.split_forward, observers.backward_marks
        (False, ('1', '0'))
    """

    def __init__(self, by_layer: bool, guard: FaultGuard) -> None:
        self.by_layer = by_layer
        self._guard = guard
        self.intervals: PhaseIntervals | None = None
        self.peak: PeakBreakdown | None = None
        self.attribution: LayerAttribution | None = None
        self.plans: dict[str, IterationPlan] = {}
        # the last plan begun, and its observers that handle ``begin``
        self._begins: tuple[IterationPlan | None, tuple[Observer, ...]] = (None, ())
        # Per-layer mode reads the counters at every tracked module's end in forward only while
        # forward is where the iterations peak (the first watched one always): one read per
        # module saved otherwise. Backward's module boundaries are always read (the
        # intermediate gradients at backward's peak are measured from them), the first time at
        # each tracked module, then around the interval where backward peaked while it peaks there.
        self.split_forward = True
        self.backward_marks: tuple[str, ...] | None = None

    # -- which observers there are -----------------------------------------------------------
    def start_with(self, intervals: PhaseIntervals) -> None:
        """The phase intervals, which every watched iteration runs."""
        self.intervals = intervals
        self.plans.clear()

    def attribute_with(self, attribution: LayerAttribution) -> None:
        """The per-layer attribution, which ``"full"`` iterations run."""
        self.attribution = attribution
        self.plans.clear()

    def use_peak(self, tracker: PeakBreakdown | None) -> None:
        """The peak breakdown from now on (``None``: none), which every watched iteration runs."""
        self.peak = tracker
        self.plans.clear()

    def refresh(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """The model changed: its parameters from now on are ``params``; the attribution lists
        its modules again."""
        if self.intervals is not None:
            self.intervals.set_params(params)
        if self.attribution is not None:
            self.attribution.refresh()

    def forget_plans(self) -> None:
        """Make the plans again when next asked (an observer given to :meth:`plan` changed)."""
        self.plans.clear()

    # -- the plans ---------------------------------------------------------------------------
    def plan(self, level: str, every: tuple[Observer, ...] = ()) -> IterationPlan:
        """The plan for ``level``, with the observers there are and ``every`` (on every
        iteration, light ones included); the same object until they change."""
        # where forward is split matters at "full" only: one plan for every light iteration
        key = level
        if level == "full":
            key = f"{_SPLIT_FULL if self.split_forward else level}, backward {self.backward_marks}"
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        observers: list[Observer] = []
        per_layer = self.attribution is not None
        if level != "light":
            assert self.intervals is not None
            observers.append(self.intervals)
            if self.peak is not None:
                observers.append(self.peak)  # pushes its saved-tensor hooks before the attribution's
            if per_layer and level == "full":
                observers.append(self.attribution)  # type: ignore[arg-type]
        observers.extend(every)
        plan = self.plans[key] = IterationPlan.make(level, tuple(observers), per_layer, self.split_forward, self.backward_marks)
        return plan

    def begin(self, plan: IterationPlan) -> None:
        """Tell each observer of ``plan`` that handles it that its iteration comes."""
        begins = self._begins
        if begins[0] is not plan:  # those that handle begin (none is told twice in a row for nothing)
            begins = self._begins = (plan, tuple(o for o in plan.observers if o.overrides("begin")))
        for observer in begins[1]:
            observer.begin(plan)

    def peaked_in(self, phase: str, backward_marks: tuple[str, ...] | None = None) -> None:
        """A per-layer iteration peaked in ``phase``: forward is split by module while that is forward;
        backward is read at ``backward_marks`` (``None``: at every tracked module; see
        :attr:`~.plan.IterationPlan.backward_marks`), as :meth:`~.intervals.PhaseIntervals.backward_marks`
        gives them.

        A peak in a forward not split by module, or in backward outside the interval read as a full
        split reads it, has no location (``None``, not a guess): the next watched iteration splits it."""
        self.split_forward = phase == "forward"
        self.backward_marks = backward_marks

    # -- faults and the end --------------------------------------------------------------------
    def drop_switched_off(self) -> None:
        """Let go of the observers a fault switched off: what they installed goes now, and the
        plans that follow leave them out."""
        guard = self._guard
        disabled = guard.disabled
        attribution = self.attribution
        if attribution is not None and ATTRIBUTION_PART in disabled:
            # What a forward left of it installed (its hooks on every module, its saved-tensor
            # pair) goes now, and nothing asks it for module names again (no locations: None).
            self.attribution = None
            self.plans.clear()
            guard.clean_up(ATTRIBUTION_PART, attribution.close)
        tracker = self.peak
        if tracker is not None and BREAKDOWN_PART in disabled:
            # what it holds: tracked storages, the static walk
            self.peak = None
            self.plans.clear()
            guard.clean_up(BREAKDOWN_PART, tracker.close)

    def let_go(self) -> tuple[PeakBreakdown | None, LayerAttribution | None]:
        """The peak breakdown and the attribution, which the set holds no more (to be closed)."""
        peak, attribution = self.peak, self.attribution
        self.peak = self.attribution = None
        self.plans.clear()
        return peak, attribution
