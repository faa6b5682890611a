"""The cost budget: which level of detail each reported iteration can afford.

``memory_profiler(..., overhead=0.03)`` lets the profiler cost at most 3% of the
run. :class:`CostBudget` measures that cost in the run itself and picks, for each
reported iteration, the richest level of :data:`DETAIL_LEVELS` that keeps it
within the budget:

- ``"light"``: one allocator read at ``record_stats()`` (what an iteration that
  is not reported always costs);
- ``"phases"``: the counters read at every phase boundary (phase peaks, the
  iteration's peak and its phase, feature maps, weight gradients) and what is
  alive at the peak (its make-up, and the intermediate gradients at backward's
  own peak);
- ``"full"``: ``"phases"`` and the per-layer figures (feature maps by layer,
  where the peak was reached, the peak's feature maps by layer), with
  ``by_layer=True`` only.

How the cost is measured, with nothing but a clock (no torch here):

- the *step time* of an iteration is the time from the end of one
  ``record_stats()`` to the start of the next: the user's step, with whatever
  the profiler's hooks did inside it;
- the *own time* is the time spent inside ``record_stats()``: the allocator
  read, the record, the outputs (report, CSV), getting the next iteration ready;
- the *base* is the step time of iterations at ``"light"`` (a moving average):
  what a step costs without detail;
- a ``"phases"`` or ``"full"`` iteration costs its own time plus what its step
  took beyond the base, plus what the step after it took beyond the base (the
  hooks just put to sleep, the caches the detail's work left cold: measured on
  the tiny MLP as 70-200 us after a reported iteration, in the user's step,
  where no clock of the profiler's own runs); that step is not part of the
  base. A ``"light"`` one costs its own time.

The budget is a running account: each iteration earns ``overhead`` times the
base (or its own step time while no base is known yet), and spends its cost.
With two detailed levels (``by_layer=True``) each has an account of its own,
earning half, so that the cheap level cannot spend what the rich one saves
up for. A level is chosen, richest first, where its account, after its
expected cost (that level's measured cost, averaged), stays at or above zero. A level never
measured (or measured only on the run's first iteration, whose step time is
warm-up: allocator growth, lazy initialisation, optimizer state made) is tried
as soon as the account is not in debt, and so gets measured. The first
reported iteration of a run gets the richest level allowed; until a step
without detail has been timed (the second iteration, at ``print_period=1``)
the others get ``"light"``. With
``overhead=None`` every reported iteration gets the richest level.

Costs the budget cannot remove are counted all the same: on the CPU the exact
counter (a dispatch mode that sees every allocation) taxes every step; its
cost is inside the base, where no clock can tell it apart, and leaves less of
the budget to detail when the steps are short.

Example::

    >>> now = [0.0]
    >>> budget = CostBudget(0.1, richest="phases", clock=lambda: now[0])
    >>> budget.choose()                 # the first reported iteration: the richest allowed
    'phases'
    >>> def run(level, step, own):     # a step, then record_stats() taking ``own`` seconds
    ...     now[0] += step; budget.entered(); now[0] += own; budget.left(level)
    >>> run("phases", 0.010, 0.001)     # warm-up: its step time is not a cost estimate
    >>> for _ in range(5):
    ...     run("light", 0.010, 0.0)    # the base: 10 ms steps
    >>> budget.choose()                 # phases not measured yet, the account not in debt: try it
    'phases'
    >>> run("phases", 0.015, 0.0)       # 5 ms more than the base
    >>> budget.choose()                 # 5 ms is more than the budget has left: light
    'light'
    >>> for _ in range(4):
    ...     run("light", 0.010, 0.0)    # each earns 10% of 10 ms
    >>> budget.choose(), round(budget.costs["phases"], 6)
    ('phases', 0.005)
"""

from __future__ import annotations

import time
from typing import Callable

from ..stats import DETAIL_LEVELS

__all__ = ["DETAIL_LEVELS", "CostBudget", "check_overhead", "detailed_levels", "richest_level"]


#: How much a new measurement moves an average (of the base, and of each level's cost).
_WEIGHT = 0.25


def check_overhead(value: object, name: str = "overhead") -> float | None:
    """``value`` if it is ``None`` or a number in (0, 1]; ``TypeError``/``ValueError`` naming ``name``.

    Example::

        >>> check_overhead(0.03), check_overhead(None)
        (0.03, None)
        >>> check_overhead(0)
        Traceback (most recent call last):
        ...
        ValueError: overhead must be a fraction of the run's time in (0, 1], e.g. 0.03 for 3%, or None for no limit; got 0
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"overhead must be a float in (0, 1] or None, got {type(value).__name__}")
    if not 0 < value <= 1:
        raise ValueError(
            "overhead must be a fraction of the run's time in (0, 1], e.g. 0.03 for 3%, "
            f"or None for no limit; got {value!r}"
        )
    return float(value)


def richest_level(by_layer: bool) -> str:
    """The richest level a profiler may choose: ``"full"`` with ``by_layer=True``, else ``"phases"``."""
    return "full" if by_layer else "phases"


def detailed_levels(richest: str) -> tuple[str, ...]:
    """The levels above ``"light"`` up to ``richest``, the poorest first.

    Example::

        >>> detailed_levels("phases"), detailed_levels("full")
        (('phases',), ('phases', 'full'))
    """
    return DETAIL_LEVELS[1 : DETAIL_LEVELS.index(richest) + 1]


class CostBudget:
    """Measures the profiler's cost in the run and chooses each reported iteration's level.

    Args:
        overhead: the largest share of the run's time the profiler may cost (``None``: no limit).
        richest: the richest level allowed (:func:`richest_level`).
        clock: seconds, monotonic (injected in tests).

    The profiler calls :meth:`entered` when ``record_stats()`` begins, :meth:`left`
    (with the level the iteration ran at) once its record is made and written,
    :meth:`choose` for the next reported iteration, and :meth:`restart` after
    work that is neither a step nor the profiler's per-iteration cost (``epoch_end()``).
    """

    def __init__(
        self, overhead: float | None, richest: str = "phases", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if richest not in DETAIL_LEVELS:
            raise ValueError(f"richest must be one of {DETAIL_LEVELS}, got {richest!r}")
        self.overhead = overhead
        self.richest = richest
        self._clock = clock
        #: the average step time of ``"light"`` iterations, in seconds (``None`` until one ran)
        self.base: float | None = None
        #: the average cost of each detailed level, in seconds, where measured
        self.costs: dict[str, float] = {}
        #: seconds the profiler spent, and seconds the budget allowed, since the start
        self.spent = 0.0
        self.allowed = 0.0
        self._levels = detailed_levels(richest)[::-1]  # richest first
        # each detailed level's account: seconds it may still spend (see the module's text)
        self._accounts = dict.fromkeys(self._levels, 0.0)
        self._count = len(self._accounts)
        # the first iteration accounted: its step time is warm-up, not a cost estimate
        self._warm_up = True
        self._chosen = False
        # the detailed level of the iteration just accounted, whose aftermath the next step shows
        self._after: str | None = None
        self._step = 0.0
        self._left = clock()
        self._entered = self._left

    @property
    def overhead(self) -> float | None:
        """The largest share of the run's time the profiler may cost (``None``: no limit)."""
        return self._overhead

    @overhead.setter
    def overhead(self, value: float | None) -> None:
        self._overhead = value
        # the share of a step the budget allows, as a number (0.0 without a limit: no share)
        self._rate = 0.0 if value is None else value

    @property
    def balance(self) -> float:
        """Seconds the budget still allows (negative: in debt)."""
        return self.allowed - self.spent

    def _earn(self, seconds: float) -> None:
        self.allowed += seconds
        accounts = self._accounts
        if accounts:
            each = seconds / len(accounts)
            for level in accounts:
                accounts[level] += each

    def _spend(self, seconds: float, level: str) -> None:
        self.spent += seconds
        accounts = self._accounts
        if level in accounts:
            accounts[level] -= seconds
        elif accounts:  # a light iteration's own time: every level pays its share
            each = seconds / len(accounts)
            for name in accounts:
                accounts[name] -= each

    def restart(self) -> None:
        """The next step is timed from now (after ``epoch_end()``: its work is no step)."""
        self._left = self._clock()

    def entered(self) -> None:
        """``record_stats()`` began: the step that ran since the last :meth:`left` has ended."""
        now = self._clock()
        self._step = max(0.0, now - self._left)
        self._entered = now

    def left(self, level: str) -> None:
        """``record_stats()`` is done with an iteration that ran at ``level``: account for it."""
        now = self._clock()
        own = max(0.0, now - self._entered)
        self._left = now
        step = self._step
        warm_up = self._warm_up
        if warm_up:
            self._warm_up = False
        if level == "light":
            # Every iteration but the few with detail comes here: _spend(own, "light") then
            # _earn(_share(step)), inline, the same operations in the same order.
            if self._after is not None:  # the step after a detailed one (never while warming up)
                step = self._after_detail(step)
            elif not warm_up:
                base = self.base
                self.base = step if base is None else base + _WEIGHT * (step - base)
            share = self._rate * step  # _share(step): 0.0 without a limit
            self.spent += own
            self.allowed += share
            count = self._count
            if count:
                accounts = self._accounts
                spent_each, earned_each = own / count, share / count
                for name in self._levels:  # the accounts' keys, as a tuple
                    accounts[name] = accounts[name] - spent_each + earned_each
            return
        base = None if warm_up else self.base  # None: nothing to measure the step against
        extra = own + (max(0.0, step - base) if base is not None else 0.0)
        self._spend(extra, level)
        self._earn(self._share(base if base is not None else step))
        # a detailed step right after another holds what the first left behind: nothing to add
        self._after = level if base is not None else None
        if base is not None:
            known = self.costs.get(level)
            self.costs[level] = extra if known is None else known + _WEIGHT * (extra - known)

    def _after_detail(self, step: float) -> float:
        """The light step after a detailed iteration: what it took beyond the base is that level's
        cost (its average already holds the iteration's own part: the sum's average moves by the
        same weight); the base is what it earns on, and it is not part of the base. Returns the
        step to earn on."""
        level, self._after = self._after, None
        base = self.base
        if base is None or level is None or step <= base:
            return step
        extra = step - base
        self._spend(extra, level)
        known = self.costs.get(level)
        if known is not None:
            self.costs[level] = known + _WEIGHT * extra
        return base

    def _share(self, step: float) -> float:
        return 0.0 if self._overhead is None else self._overhead * step

    def choose(self) -> str:
        """The level for the next reported iteration: the richest allowed that the budget affords."""
        overhead = self._overhead
        if overhead is None or not self._chosen:
            self._chosen = True
            return self.richest
        base = self.base
        if base is None:
            return "light"  # no step without detail timed yet: what detail costs is measured from one
        accounts = self._accounts
        next_share = overhead * base / max(1, len(accounts))  # _share(base), shared by the accounts
        costs = self.costs
        for level in self._levels:
            cost = costs.get(level)
            if cost is None:
                if accounts[level] >= 0:
                    return level  # never measured: tried while its account is not in debt
            elif accounts[level] + next_share >= cost:
                return level
        return "light"
