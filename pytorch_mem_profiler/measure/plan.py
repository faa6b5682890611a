"""The plan of one iteration: what it measures, fixed before it starts.

Before each iteration the meter (:mod:`.meter`) makes an :class:`IterationPlan`
and hands it to the phase machine (:mod:`.phases`) and to every observer
(:mod:`.observers`): the level of detail the cost budget chose, whether the
phase boundaries are read, whether forward is read at module boundaries, where
backward is, and which observers receive the iteration's events. Nothing else tells them how to
measure: no object sets another's fields. A plan is immutable; the meter keeps
the few it needs (the light one is made once) and makes another only when the
level, the observers on or where forward is split change.

Example::

    >>> light = IterationPlan.make("light")
    >>> light.watched, light.per_layer, light.observers
    (False, False, ())
    >>> IterationPlan.make("full", observers=("breakdown",), per_layer=True).split_forward
    True
    >>> IterationPlan.make("full", per_layer=True, backward_marks=("3", "1")).backward_marks
    ('3', '1')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..stats import DETAIL_LEVELS

__all__ = ["IterationPlan"]


@dataclass(frozen=True)
class IterationPlan:
    """What one iteration measures (see the module's text).

    Attributes:
        level: the level of detail (:data:`~pytorch_mem_profiler.stats.DETAIL_LEVELS`).
        watched: whether the counters are read at the phase boundaries (every level but
            ``"light"``); an iteration not watched is read once, at ``record_stats()``.
        per_layer: whether the per-layer attribution runs (``"full"`` with ``by_layer=True``):
            backward is read where it reaches a tracked module.
        split_forward: whether forward, too, is read at the end of each tracked module (per-layer
            mode, while the iterations peak in forward: one read per module saved otherwise).
        backward_marks: where backward is read in per-layer mode: ``None`` where it reaches each
            tracked module; else the two modules around the interval where the last fully read
            backward peaked (``("", b)``: from backward's start; ``(a,)``: to its end), read as a full
            split reads it, the rest of backward in two intervals of no module (two reads for
            one per module, while backward peaks there).
        observers: the observers that receive the iteration's events, in the order they receive
            them (those that push saved-tensor hooks first; they are told a forward was left in
            the reverse order, so that they pop in order).
    """

    level: str
    watched: bool
    per_layer: bool
    split_forward: bool
    observers: tuple[Any, ...]
    backward_marks: tuple[str, ...] | None = None

    @classmethod
    def make(
        cls,
        level: str,
        observers: tuple[Any, ...] = (),
        per_layer: bool = False,
        split_forward: bool = True,
        backward_marks: tuple[str, ...] | None = None,
    ) -> IterationPlan:
        """The plan for ``level`` (``ValueError`` for a level that is not one of
        :data:`~pytorch_mem_profiler.stats.DETAIL_LEVELS`); ``per_layer`` only counts at ``"full"``."""
        if level not in DETAIL_LEVELS:
            raise ValueError(f"level must be one of {DETAIL_LEVELS}, got {level!r}")
        per_layer = per_layer and level == "full"
        marks = backward_marks if per_layer else None
        return cls(level, level != "light", per_layer, per_layer and split_forward, tuple(observers), marks)

    def without(self, observer: Any) -> IterationPlan:
        """This plan with ``observer`` no longer on (a fault switched it off)."""
        return IterationPlan(
            self.level,
            self.watched,
            self.per_layer,
            self.split_forward,
            tuple(o for o in self.observers if o is not observer),
            self.backward_marks,
        )
