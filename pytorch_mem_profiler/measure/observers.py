"""Observers: the measurements of an iteration, each on its own; the mirror of the output sinks.

The phase machine (:mod:`.phases`) decides where an iteration is (forward,
backward, the optimizer step, between them) from what the hook set
(:mod:`.hooks`) tells it, and reads the counters at each boundary of a watched
iteration. It hands those events to the observers that the iteration's plan
(:class:`~.plan.IterationPlan`) puts on, in the plan's order. Each observer
keeps what it needs of them and, when the iteration ends, gives the meter its
own typed part of the record:

- :class:`~.intervals.PhaseIntervals`: peaks and ends of the phases, the iteration's
  peak and where, feature maps, weight gradients; ``figures()`` gives an
  ``IntervalFigures``;
- :class:`~.peak_breakdown.PeakBreakdown`: what is alive at the peak, by category;
  ``result(peak, ...)`` gives a ``PeakResult`` (it needs the peak the intervals found);
- :class:`~.layers.LayerAttribution`: feature maps by the module that saved them;
  ``finish()`` gives a :class:`~pytorch_mem_profiler.stats.LayerFeatureMaps`;
- :class:`~.data_parallel.FsdpGatherTracker`: FSDP2's gathered parameters, with hooks of
  its own that the plan turns on; ``finish_iteration()`` gives bytes.

A new measurement is a new observer, as a new output is a new sink. An
observer implements the events it needs (the others do nothing, and the
machine does not call them); :meth:`Observer.begin` tells it the plan of the
coming iteration, and the meter asks it for its part with the method above.

Faults: each observer names its fault-guard part (:attr:`Observer.part`). A
fault in one of its events switches that part off, drops the observer from the
running iteration's events (:meth:`Observer.on_fault` lets go of what it held)
and leaves the others running; the meter takes it out of the later plans.
:class:`~.intervals.PhaseIntervals` has no part of its own: the phases are what
every other figure hangs on, so a fault in it is one of the hook that fired.

Observers never import the hook set or the machine: events come in as calls.

Example::

    >>> class CountForwards(Observer):
    ...     part = "forward counter"
    ...     def begin(self, plan): self.count = 0
    ...     def forward_began(self, args, entry): self.count += 1
    >>> CountForwards().overrides("forward_began"), CountForwards().overrides("boundary")
    (True, False)
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = ["Observer", "EVENTS"]

#: The events the phase machine hands to observers, by method name.
EVENTS = (
    "boundary",
    "forward_began",
    "forward_resumed",
    "inputs_seen",
    "forward_left",
    "forward_closed",
    "backward_started",
    "backward_finished",
)


class Observer:
    """One measurement of an iteration. Every method does nothing unless an observer overrides it."""

    #: the fault-guard part a fault in its events switches off (``None``: that of the hook that fired)
    part: ClassVar[str | None] = None

    def begin(self, plan: Any) -> None:
        """The coming iteration's plan (:class:`~.plan.IterationPlan`), before its first event;
        called when the plan changes and before every watched iteration."""

    # -- the events (on watched iterations) ------------------------------------------------------
    def boundary(self, reading: Any, ended: str, following: str, where: str | None) -> None:
        """The counters were read (``reading``, a :class:`~.devices.Reading`, whose peak covers the
        interval since the last boundary): an interval of phase ``ended``, run in module ``where``
        (per-layer mode; ``None``: not known) ended, and one of phase ``following`` begins
        (``ended == following``: a phase split at a module boundary, or the iteration's end)."""

    def forward_began(self, args: Any, entry: Any) -> None:
        """A forward pass began (after the boundary that opened it): the model was entered with
        ``args`` through the module ``entry`` (``None``: a phase marked by hand)."""

    def forward_resumed(self, args: Any, entry: Any) -> None:
        """The running forward pass entered the model again (``self.decoder`` after ``self.encoder``)."""

    def inputs_seen(self, args: Any) -> None:
        """The model was entered with ``args`` inside a forward a framework marked by hand."""

    def forward_left(self) -> None:
        """The model was left (before the boundary that ends forward, if it ends): the pass may
        go on (another entry) or end."""

    def forward_closed(self, kept: int | None) -> None:
        """The forward pass ended for good (a backward, a step or the iteration's end follows);
        ``kept``: what it left allocated, from its start to its last exit from the model
        (``None``: not measured, as for a pass begun on an iteration not watched)."""

    def backward_started(self, grad_outputs: Any) -> None:
        """The gradient reached the model's outputs (after the boundary that opened backward)."""

    def backward_finished(self) -> None:
        """The backward pass ended: the parameters' ``.grad`` are the weight gradients."""

    # -- faults and the end --------------------------------------------------------------------------
    def on_fault(self) -> None:
        """A fault in one of its events switched it off: let go of what it holds where that is safe."""

    def close(self) -> None:
        """The profiler closes: remove what it installed."""

    def overrides(self, event: str) -> bool:
        """Whether this observer handles ``event`` (one of :data:`EVENTS`)."""
        return getattr(type(self), event) is not getattr(Observer, event)
