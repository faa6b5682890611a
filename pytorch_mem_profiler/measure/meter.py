"""The meter: wires the measuring parts, plans each iteration, and makes its record.

A :class:`Meter` knows the profiled device and its counter (the reader), the
model's parameters, weights and buffers (a :class:`~.model_state.ModelState`),
and the optimizers' state. It makes the hook set (:mod:`.hooks`), the phase
machine it reports to (:mod:`.phases`) and the observers (:mod:`.observers`: the
phase intervals, the peak breakdown, the per-layer attribution, held with the
plans they run under by an :class:`~.observer_set.ObserverSet`; FSDP tracking).
Before each iteration it hands the machine and the observers an immutable
:class:`~.plan.IterationPlan` (the level of detail, which observers are on); when
the iteration ends it asks each observer on for its part and builds the frozen
:class:`~pytorch_mem_profiler.stats.IterationRecord` with its constructor. It
sets no field of another object: everything it tells them goes through a plan
or a method call.

The profiler calls :meth:`Meter.start` once, :meth:`Meter.prepare` before each
iteration (at which level will it be measured?), :meth:`Meter.finish` at each
``record_stats()``, :meth:`Meter.refresh` at each epoch end and
:meth:`Meter.close` at the end.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(8, 2)
    >>> meter = Meter(model)
    >>> meter.start()
    >>> model(torch.randn(4, 8)).sum().backward()
    >>> record = meter.finish(Position(epoch=1, iteration=1, step=1), reported=True)
    >>> record.forward_passes, record.weights == record.gradients == (8 * 2 + 2) * 4
    (1, True)
    >>> meter.close()
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from types import MappingProxyType
from typing import Any, Callable, Iterable, NamedTuple

import torch

from ..faults import FaultGuard
from ..torch_versions import COMPILE_YIELDS_TO_DISPATCH_MODES
from ..stats import DETAIL_LEVELS, PHASES, IterationRecord, PhaseStats, records_like
from .accounting import gradient_bytes, optimizer_holds_any, optimizer_state_bytes, optimizer_state_tensors
from .data_parallel import FSDP_PART, FsdpGatherTracker
from .devices import MemoryCounter, Reading, device_capacity, make_counter
from .hooks import PhaseBlock, StepHooks, backward_running
from .intervals import IntervalFigures, PhaseIntervals
from .layers import ATTRIBUTION_PART, LayerAttribution
from .model_state import ModelFigures, ModelState
from .observer_set import ObserverSet
from .outside import DeviceMemoryReader
from .peak_breakdown import BREAKDOWN_PART, PeakResult, make_peak_breakdown
from .phases import PhaseMachine
from .plan import IterationPlan
from .saved_tensors import can_chain
from .trees import is_compiled

__all__ = ["Meter", "Position"]

_log = logging.getLogger("pytorch_mem_profiler")

#: The part of the meter that takes the hooks off between reported iterations.
_LIGHT = "hooks off between reports"
#: the pass and step counts of an iteration the hooks slept through: unknown
_UNCOUNTED: tuple[None, None, None] = (None, None, None)
#: the phase intervals' figures of an iteration not watched (so far: none)
_NOT_WATCHED = IntervalFigures(None, None, None, None, MappingProxyType({}), MappingProxyType({}), 0, None)
#: the fields of a light record that change from one to the next, in the order
#: :meth:`Meter._light_record` gives them (the others are the same until the model or the device changes)
_LIGHT_VARYING = (
    "epoch",
    "iteration",
    "step",
    "allocated",
    "peak_allocated",
    "iteration_peak_allocated",
    "peak_cached",
    "current_cached",
    "optimizer_state",
    "forward_passes",
    "backward_passes",
    "optimizer_steps",
    "iteration_time_s",
    "fsdp_gathered_parameters",
    "reported",
)
#: those of an iteration the hooks slept through (:meth:`Meter.finish_slept`): its pass and step
#: counts are unknown (``None``) every time
_SLEPT_VARYING = tuple(name for name in _LIGHT_VARYING if name not in ("forward_passes", "backward_passes", "optimizer_steps"))

#: a maker of records from a template (:func:`~pytorch_mem_profiler.stats.records_like`)
RecordMaker = Callable[..., IterationRecord]


class Position(NamedTuple):
    """Where an iteration sits in the run: epoch and iteration from 1, step counted over epochs."""

    epoch: int
    iteration: int
    step: int


class _RecordStamp:
    """What the meter stamps on every record besides the model's figures (the device's capacity,
    the cost budget), and the makers of light records from a template of all that they share.

    The makers are made when first asked for, and again for other model figures (a
    :class:`~.model_state.ModelFigures` is another object once the model changed) or after a
    new capacity.

    Example::

        >>> figures = ModelState(torch.nn.Linear(8, 2)).figures
        >>> stamp = _RecordStamp(capacity=80_000_000_000, overhead=0.03)
        >>> make_light, make_slept = stamp.makers(figures)
        >>> stamp.makers(figures)[1] is make_slept  # made once
        True
        >>> record = make_slept(1, 2, 2, 1_000, None, None, None, None, None, 0.01, None, False)
        >>> record.weights, record.device_total, record.overhead_budget, record.forward_passes
        (72, 80000000000, 0.03, None)
    """

    def __init__(self, capacity: int | None, overhead: float | None) -> None:
        self.capacity = capacity
        self.overhead = overhead
        # the figures the makers were made from (None: none made since the capacity changed)
        self._figures: ModelFigures | None = None
        self._make_light: RecordMaker | None = None
        self._make_slept: RecordMaker | None = None

    def set_capacity(self, capacity: int | None) -> None:
        """Bytes of memory the device has in all, from now on (the makers are made again)."""
        self.capacity = capacity
        self._figures = None

    def makers(self, figures: ModelFigures) -> tuple[RecordMaker, RecordMaker]:
        """The makers of light records (:data:`_LIGHT_VARYING` in order) and of those of iterations
        the hooks slept through (:data:`_SLEPT_VARYING`), for the model's ``figures``."""
        if figures is self._figures:
            return self._make_light, self._make_slept  # type: ignore[return-value]
        template = IterationRecord(
            epoch=0,
            iteration=0,
            step=0,
            device=figures.device,
            allocated=0,
            feature_maps=None,
            intermediate_gradients=None,
            weights=figures.weights,
            weights_by_name=figures.weights_by_name,
            gradients=None,
            buffers=figures.buffers,
            device_total=self.capacity,
            ddp_gradient_buckets=figures.ddp_gradient_buckets,
            rank=figures.rank,
            detail="light",
            overhead_budget=self.overhead,
            model_name=figures.model_name,
        )
        slept = dataclasses.replace(template, forward_passes=None, backward_passes=None, optimizer_steps=None)
        self._make_light = make_light = records_like(template, _LIGHT_VARYING)
        self._make_slept = make_slept = records_like(slept, _SLEPT_VARYING)
        self._figures = figures
        return make_light, make_slept


class Meter:
    """Measures a model's training iterations on one device.

    Args:
        model: the model being trained.
        device: the device to profile; ``None``: the model's (each rank's own under
            torch.distributed).
        optimizers: the optimizers whose state to count; ``None`` finds those that
            step the model's parameters.
        by_layer: attribute feature maps to modules on reported iterations.
        guard: contains the meter's faults.
        rank_info: this process's rank under torch.distributed (``None``: one process).
        overhead: the cost budget the levels of detail are chosen under, stamped on each
            record (``None``: no limit; see :mod:`.budget`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device | None = None,
        optimizers: Iterable[torch.optim.Optimizer] | None = None,
        by_layer: bool = False,
        guard: FaultGuard | None = None,
        rank_info: Any = None,
        overhead: float | None = None,
    ) -> None:
        #: the level of detail the running iteration is measured at (:meth:`prepare`)
        self.level = "light"
        self.guard = guard or FaultGuard()
        self._optimizers = None if optimizers is None else list(optimizers)
        _check_optimizers_step(self._optimizers, model)
        # the model's parameters, weights and buffers: counted again only when the model changes
        self._model_state = ModelState(model, device, rank_info)
        self.counter: MemoryCounter = make_counter(self.device)
        self._stamp = _RecordStamp(device_capacity(self.device), overhead)
        # The maker of the records of iterations the hooks slept through, kept here for the light
        # path to read at once (None: to be made again, the model or the capacity changed).
        self._make_slept: RecordMaker | None = None
        self._fsdp: FsdpGatherTracker | None = None
        self._outside = DeviceMemoryReader(self.device)
        # Every optimizer known to step the model: given, or seen stepping it. Kept
        # across epochs, held weakly, each as [weak reference, len(state) when its state
        # was last counted (-1: never), bytes then]. A plain list: read at every
        # record_stats(), where a WeakKeyDictionary's iteration guard costs microseconds.
        self._known_optimizers: list[list[Any]] = []
        for opt in self._optimizers or ():
            self._know_optimizer(opt)
        self._hooks: StepHooks | None = None
        self._machine: PhaseMachine | None = None
        # the observers (those there are: the breakdown needs a peak counter, the attribution
        # by_layer=True) and the plans they run under; FSDP tracking (an FSDP unit) is the meter's
        self._observers = ObserverSet(by_layer, self.guard)
        # the running iteration's plan
        self._plan = IterationPlan.make("light")
        # the highest peaks read since the profiler started
        self._max_allocated: int | None = None
        self._max_reserved: int | None = None
        # allocated at the last read (the end of the last iteration): a reported one starts there
        self._last_allocated: int | None = None
        self._last_time = time.perf_counter()
        #: whether the iteration :meth:`finish` closed last was watched and had nothing in it:
        #: the model never entered, no backward, no optimizer step
        self.idle = False

    @property
    def device(self) -> torch.device:
        """The device measured: the one given, or the model's (followed when the model moves)."""
        return self._model_state.device

    @property
    def model(self) -> torch.nn.Module:
        """The model measured."""
        return self._model_state.model

    @property
    def rank_info(self) -> Any:
        """This process's rank under torch.distributed (``None``: one process)."""
        return self._model_state.rank_info

    @property
    def by_layer(self) -> bool:
        """Whether feature maps are attributed to modules on reported iterations."""
        return self._observers.by_layer

    @property
    def overhead(self) -> float | None:
        """The cost budget the levels of detail are chosen under, stamped on each record."""
        return self._stamp.overhead

    @property
    def capacity(self) -> int | None:
        """Bytes of memory the device has in all (``None``: unknown, or the CPU)."""
        return self._stamp.capacity

    @capacity.setter
    def capacity(self, value: int | None) -> None:
        self._stamp.set_capacity(value)
        self._make_slept = None  # the light records' templates hold it

    # -- what the model holds ------------------------------------------------
    @property
    def parameter_names(self) -> list[str]:
        """The names of the parameters measured, each piece of memory once."""
        return self._model_state.parameter_names

    @property
    def phase(self) -> str | None:
        """The phase running now (``"forward"``, ``"backward"``, ``"optimizer"``, ``"other"``)."""
        return self._machine.phase if self._machine is not None else None

    def phase_block(self, phase: str) -> PhaseBlock:
        """A ``with`` block in which ``phase`` runs, as a framework that knows it says
        (``ValueError`` for a phase that is not forward, backward or optimizer)."""
        return PhaseBlock(self._machine, phase, self.guard)

    @property
    def current(self) -> dict[str, Any] | None:
        """What the running iteration has measured so far: its counts, and the phase intervals'
        figures (``feature_maps`` is known from forward's end on a watched iteration)."""
        machine = self._machine
        if machine is None:
            return None
        intervals = self._observers.intervals
        figures = intervals.figures() if intervals is not None and self._plan.watched else _NOT_WATCHED
        return {
            "forward_passes": machine.forward_passes,
            "backward_passes": machine.backward_passes,
            "optimizer_steps": machine.optimizer_steps,
            "model_calls": machine.model_calls,
            "phase_count": dict(machine.phase_count),
            **figures._asdict(),
        }

    def _learn_model(self, device: torch.device | None = None) -> None:
        """Count the model again (measured on ``device`` from now on, where it moved there):
        parameters, weights and buffers change only if the model does."""
        self._model_state.refresh(device)
        if self._fsdp is not None:
            self._fsdp.refresh()
        self._make_slept = None  # its template holds the old figures

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Start counting and install the hooks."""
        counter = self.counter
        counter.start()
        params = self._model_state.params
        # Tensors made before the counter started are invisible to the CPU counter: adopt them.
        counter.adopt(p for _, p in params)
        counter.adopt(b for b in self.model.buffers())
        counter.adopt(p.grad for _, p in params if p.grad is not None)
        # A profiler made mid-training: the given optimizers' state exists already.
        counter.adopt(optimizer_state_tensors(self._optimizers or ()))
        wrap = self.guard.wrap
        hooks = self._hooks = StepHooks(
            self.model,
            params,
            self._optimizers,
            self.guard,
            on_optimizer_step=wrap("optimizer state", self._optimizer_stepped),
            device=self.device,
        )
        if self.device.type == "cpu" and is_compiled(self.model):
            if COMPILE_YIELDS_TO_DISPATCH_MODES:
                what = ("runs a compiled model's frames eagerly while the CPU counter counts (a dispatch mode "
                        "is active): the figures, and the step's time, are the uncompiled step's; "
                        "estimate_memory(model, ...) gives the compiled step's")  # fmt: skip
            else:
                what = ("runs a compiled model's code past the CPU counter (inductor allocates outside the "
                        "dispatcher): the tensors it makes are missing from the figures; profile the model "
                        "uncompiled, on a GPU, or with a newer torch (2.13 runs compiled code eagerly while "
                        "the counter counts)")  # fmt: skip
            _log.warning("pytorch_mem_profiler: torch %s %s", torch.__version__, what)
        machine = self._machine = PhaseMachine(
            counter.mark,
            hooks.new_pending,
            backward_running,
            on_first_forward=wrap("device check", self._check_device_once),
            guard=self.guard,
        )
        observers = self._observers
        intervals = PhaseIntervals(params)
        observers.start_with(intervals)
        if self.by_layer:
            if is_compiled(self.model):
                _log.warning(
                    "pytorch_mem_profiler: the model runs through torch.compile; feature maps are "
                    "reported in total, not by layer"
                )
            else:
                if not can_chain():
                    _log.warning(
                        "pytorch_mem_profiler: torch %s cannot tell which saved-tensor hooks are active, "
                        "so feature maps are reported in total, not by layer (torch 2.8 or later can); "
                        "where each iteration peaked is still found",
                        torch.__version__,
                    )
                observers.attribute_with(
                    LayerAttribution(
                        self.model,
                        self.device,
                        # No guard wrapper: the attribution calls these inside its own try, for the same part.
                        on_exit=machine.module_left,
                        on_backward_enter=machine.backward_reached,
                        guard=self.guard,
                    )
                )
        # Until the first prepare(), every iteration is watched (a Meter used on its own).
        plan = self._plan = IterationPlan.make("phases", (intervals,))
        intervals.begin(plan)
        machine.begin_iteration(plan)
        hooks.install(machine)
        # The counters' starting point: peaks are measured from here on.
        first = counter.mark()
        self._max_reserved = first.reserved
        self._max_allocated = first.allocated
        observers.use_peak(make_peak_breakdown(counter, self.guard))
        if self.rank_info is not None:
            self._fsdp = FsdpGatherTracker.attach(self.model, wrap)
        observers.forget_plans()
        self._last_time = time.perf_counter()

    def prepare(self, level: str | bool) -> None:
        """The level of detail the coming iteration is measured at (:data:`~..stats.DETAIL_LEVELS`;
        ``True``: the richest this meter has, ``False``: ``"light"``).

        ``"light"`` costs one read and one peak reset, at :meth:`finish`. ``"phases"``
        reads the counters at the phase boundaries, measures gradients and watches what
        is alive at its peak (its make-up, and the intermediate gradients); ``"full"``
        (per-layer mode) runs the per-layer hooks as well.
        """
        hooks = self._hooks
        if (
            level == "light"
            and hooks is not None
            and hooks.asleep
            and not self.guard.disabled
            and self._plan is self._observers.plans.get("light")
        ):
            # Light after light, the hooks asleep (the common case): nothing to change.
            self.level = "light"
            return
        if level is True or level is False:
            level = ("full" if self.by_layer else "phases") if level else "light"
        if level not in DETAIL_LEVELS:
            raise ValueError(f"level must be one of {DETAIL_LEVELS}, got {level!r}")
        self.level = level
        hooks, machine = self._hooks, self._machine
        if hooks is None or machine is None:
            return
        if self.guard.disabled:
            self._drop_switched_off(hooks)
        fsdp = self._fsdp
        plan = self._observers.plan(level, (fsdp,) if fsdp is not None else ())
        watched = plan.watched
        self._watch(hooks, watched)
        if watched or plan is not self._plan:
            # Consecutive light iterations share one plan: nothing to tell anyone.
            plan = self._begin(plan)
            self._plan = plan
            machine.begin_iteration(plan)

    def _begin(self, plan: IterationPlan) -> IterationPlan:
        """Tell each observer of ``plan`` that its iteration comes; the plan it runs under (less the
        peak breakdown, should it fail to start)."""
        observers = self._observers
        observers.begin(plan)
        tracker = observers.peak
        # The breakdown watches every saved tensor from Python and looks for gradients at
        # backward's boundaries: what a host-bound step at print_period=1 pays for (GPT-2:
        # 1.25x), and what the cost budget weighs against the step.
        if plan.watched and tracker is not None and tracker in plan.observers:
            # Inline rather than through guard.call: this runs at the end of the
            # iteration before a watched one, which stays on the light path.
            try:
                attribution = observers.attribution
                state = self._model_state
                tracker.start(
                    state.parameters(),
                    state.buffers(),
                    self._optimizer_list(),
                    self._last_allocated,
                    attribution.current_module if attribution is not None else None,
                )
            except Exception as exc:  # noqa: BLE001 - the breakdown switches off, the rest goes on
                self.guard.fault(BREAKDOWN_PART, exc)
                plan = plan.without(tracker)
        return plan

    def _drop_switched_off(self, hooks: StepHooks) -> None:
        """Parts a fault switched off stop running, not only reporting: their hooks and what they
        hold go here, between iterations, not at close() (inside backward a pop of autograd's
        saved-tensor stack would act on the engine's copy of it and be lost), and the plans
        that follow leave their observers out."""
        disabled = self.guard.disabled
        self.guard.call("phase hooks", hooks.drop_switched_off)
        self._observers.drop_switched_off()
        fsdp = self._fsdp
        if fsdp is not None and FSDP_PART in disabled:
            # its pre-hook on every unit would go on being called (and return at once)
            self._fsdp = None
            self._observers.forget_plans()
            self.guard.clean_up(FSDP_PART, fsdp.remove)

    def _optimizer_list(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (entry[0]() for entry in self._known_optimizers) if opt is not None]

    def refresh(self) -> None:
        """Learn the model again (at each epoch end): parameters, weights, buffers, optimizer state."""
        self._learn_model()
        params = self._model_state.params
        if self._hooks is not None:
            self._hooks.set_params(params)
        self._observers.refresh(params)
        self._known_optimizers = [entry for entry in self._known_optimizers if entry[0]() is not None]
        self._optimizer_state(recount=True)

    def close(self) -> None:
        """Remove every hook and stop counting (each in its own try: see ``FaultGuard.clean_up``)."""
        hooks, machine = self._hooks, self._machine
        peak, attribution = self._observers.let_go()
        steps = []
        if peak is not None:
            steps.append(peak.close)
        if hooks is not None:
            steps.append(hooks.release)
        if attribution is not None:
            steps.append(attribution.close)
        if machine is not None:
            steps.append(machine.release)
        if self._fsdp is not None:
            steps.append(self._fsdp.close)
        steps.append(self.counter.stop)
        self.guard.clean_up("close", *steps)

    # -- callbacks from the hooks ----------------------------------------------
    def _check_device_once(self) -> None:
        now = self._model_state.moved()
        if now is None:
            return
        _log.warning(
            "pytorch_mem_profiler: the model moved from %s to %s after the profiler was made; "
            "profiling %s from now on (make the profiler after model.to(device))",
            self.device,
            now,
            now,
        )
        self.counter.stop()
        self._learn_model(now)  # the device measured is the model state's from here on
        self.counter = make_counter(now)
        self._stamp.set_capacity(device_capacity(now))
        self.counter.start()
        self._outside = DeviceMemoryReader(now)
        params = self._model_state.params
        hooks, machine, observers = self._hooks, self._machine, self._observers
        intervals = observers.intervals
        assert hooks is not None and machine is not None and intervals is not None
        hooks.set_params(params)
        intervals.set_params(params)
        machine.read_from(self.counter.mark)
        self.counter.mark()
        # This iteration's breakdown followed the old device: none for it.
        old = observers.peak
        observers.forget_plans()
        if old is not None:
            old.close()
            self._plan = self._plan.without(old)
            machine.begin_iteration(self._plan)
        observers.use_peak(make_peak_breakdown(self.counter, self.guard))

    def _know_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Add ``optimizer`` to those known; False if it was known already."""
        for entry in self._known_optimizers:
            if entry[0]() is optimizer:
                return False
        # [the optimizer, len(state) when last counted, its bytes then, whether a state tensor is sparse]
        self._known_optimizers.append([weakref.ref(optimizer), -1, 0, False])
        return True

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if self._know_optimizer(optimizer):
            # State made before the profiler started is invisible to the CPU counter.
            self.counter.adopt(optimizer_state_tensors([optimizer]))

    def _optimizer_state(self, recount: bool = False) -> int | None:
        """Bytes of the state of every optimizer known; ``None`` while none is known.

        Known: given with ``optimizer=``, or seen stepping the model's parameters
        (remembered across epochs). Dense state tensors keep their sizes once made
        (Adam makes its moments at the first step), so the count is reused while
        ``len(optimizer.state)`` holds; a sparse one grows as it is updated (SGD's
        momentum over sparse gradients gains the new gradient's entries each step), so
        an optimizer holding one is recounted every time; :meth:`refresh` recounts everything.
        """
        total, alive = 0, False
        for entry in self._known_optimizers:
            opt = entry[0]()
            if opt is None:
                continue  # freed: it holds no state any more (dropped at the next refresh)
            alive = True
            size = len(opt.state)
            if recount or entry[1] != size or entry[3]:
                entry[1], entry[2] = size, optimizer_state_bytes([opt], self.device)
                entry[3] = any(t.layout is not torch.strided for t in optimizer_state_tensors([opt]))
            total += entry[2]
        return total if alive else None

    # -- the record --------------------------------------------------------------
    def _watch(self, hooks: StepHooks, detailed: bool) -> None:
        """Hooks on for an iteration that will be watched, off for the others.

        Inline rather than through ``guard.call``: it runs on the light path. A
        fault leaves the hooks on (every iteration then watched, as before) and
        switches off only the sleeping.
        """
        if _LIGHT in self.guard.disabled:
            return
        try:
            if detailed:
                hooks.wake()
            else:
                hooks.sleep()
        except Exception as exc:  # noqa: BLE001 - the hooks stay on, the rest goes on
            self.guard.fault(_LIGHT, exc)
            self.guard.call("phase hooks", hooks.wake)

    def finish(self, position: Position, reported: bool) -> IterationRecord:
        """Close the running iteration and hand back its record (all figures in bytes).

        ``reported``: the iteration is one that will be reported, so the figures
        that cost a driver call (memory outside PyTorch) and the per-layer ones
        are included. An iteration whose plan (:meth:`prepare`) was not watched
        gets the light record of :meth:`_light_record`.
        """
        epoch, iteration, step = position
        record = self.finish_slept(epoch, iteration, step, reported)
        return record if record is not None else self._closed_record(position, reported)

    def finish_slept(self, epoch: int, iteration: int, step: int, reported: bool) -> IterationRecord | None:
        """:meth:`finish` for an iteration the hooks slept through (the common case): one read of
        the counters, nothing else; ``None`` for any other (:meth:`finish` closes it).

        The light path of every ``record_stats()`` at the ``"light"`` level: what
        :meth:`_light_record` makes, inline, from the template of :meth:`_light_maker`.
        After it, while no part is switched off (``guard.disabled`` empty), ``prepare("light")``
        has nothing to do: the plan is the light one and the hooks sleep.
        """
        hooks = self._hooks
        if hooks is None or not hooks.asleep or self._plan.watched or not self._machine.quiet():  # type: ignore[union-attr]
            return None
        counter = self.counter
        allocated, peak, reserved, peak_reserved = counter.mark()
        self.idle = False
        # _read_peaks, inline
        most = self._max_allocated
        if peak is not None and (most is None or peak > most):
            self._max_allocated = most = peak
        most_reserved = self._max_reserved
        if peak_reserved is not None and (most_reserved is None or peak_reserved > most_reserved):
            self._max_reserved = most_reserved = peak_reserved
        now = time.perf_counter()
        elapsed = now - self._last_time
        self._last_time = now
        self._last_allocated = allocated
        make = self._make_slept
        if make is None:
            make = self._light_maker()[1]
        has_peak = counter.has_peak
        fsdp = self._fsdp
        return make(
            epoch,
            iteration,
            step,
            allocated,
            most if has_peak else None,
            peak,
            most_reserved if has_peak else None,
            reserved,
            self._optimizer_state(),
            elapsed,
            fsdp.finish_iteration() if fsdp is not None else None,
            reported,
        )

    def _closed_record(self, position: Position, reported: bool) -> IterationRecord:
        """:meth:`finish` for an iteration the hooks watched or something happened in: the machine
        closes it, and the observers of its plan give their parts."""
        hooks, machine, observers = self._hooks, self._machine, self._observers
        intervals = observers.intervals
        assert hooks is not None and machine is not None and intervals is not None
        watched = self._plan.watched
        asleep = hooks.asleep
        final, counts, phase_count, model_calls = machine.finish_iteration(hooks.model_running)
        if asleep:
            counts = _UNCOUNTED  # nothing watched the iteration: its passes are unknown
        else:
            hooks.learn(counts[0], counts[2])
        self.idle = not asleep and model_calls == 0 and counts == (0, 0, 0)
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        self._last_allocated = final.allocated
        if not watched:
            self._read_peaks(final.peak_allocated, final.peak_reserved)
            return self._light_record(position, final, final.peak_allocated, counts, elapsed, reported)
        figures = intervals.figures()
        self._read_peaks(figures.iteration_peak, figures.peak_reserved)
        if self._plan.per_layer and figures.peak_phase is not None:
            observers.peaked_in(figures.peak_phase, intervals.backward_marks())
        peak = self._peak_result(figures.iteration_peak)
        state = self._model_state
        sizes = figures.gradient_sizes
        if sizes is None or len(sizes) != len(state.params):
            # No backward reached the model this iteration: take the gradients as they are.
            sizes = gradient_bytes(state.params)
        gradients_by_name = state.gradients_by_name(sizes)
        phase_end, phase_peak = figures.phase_end_allocated, figures.phase_peak
        phases = MappingProxyType(
            {
                phase: PhaseStats(phase_end.get(phase), phase_peak.get(phase), phase_count[phase])
                for phase in PHASES
                if phase in phase_count
            }
        )
        has_peak = self.counter.has_peak
        usage = self.guard.call("device memory", self._outside.read) if reported else None
        outside = None
        if usage is not None and final.reserved is not None:
            outside = usage.device_used - final.reserved
        # Module names come from the per-layer attribution: where a fault switched it off during
        # this iteration, those it gave may be stale, and none is reported.
        located = ATTRIBUTION_PART not in self.guard.disabled
        breakdown = peak_layers = transient = transient_in = other_before = step_temporaries = None
        if peak is not None:
            breakdown = MappingProxyType(peak.breakdown)
            other_before = peak.other_before
            step_temporaries = peak.step_temporaries if figures.peak_phase == "optimizer" else 0
            if peak.peak_layers is not None and located and self.level == "full":
                peak_layers = MappingProxyType(peak.peak_layers)
            if peak.transient_in is not None:
                transient = peak.transient
            transient_in = peak.transient_in if located or peak.transient_in in PHASES else None
        if state.recount_replaced_buffers():
            self._make_slept = None  # its template holds the old total
        shared = state.figures
        stamp = self._stamp
        epoch, iteration, step = position
        forward_passes, backward_passes, optimizer_steps = counts
        attribution = observers.attribution
        layers = attribution.finish() if reported and attribution is not None and self._plan.per_layer else None
        return IterationRecord(
            epoch=epoch,
            iteration=iteration,
            step=step,
            device=shared.device,
            allocated=final.allocated,
            peak_allocated=self._max_allocated if has_peak else None,
            iteration_peak_allocated=figures.iteration_peak,
            peak_phase=figures.peak_phase,
            peak_cached=self._max_reserved if has_peak else None,
            current_cached=final.reserved,
            feature_maps=figures.feature_maps,
            intermediate_gradients=peak.backward_intermediate_gradients if peak is not None else None,
            weights=shared.weights,
            weights_by_name=shared.weights_by_name,
            gradients=sum(sizes),
            gradients_by_name=gradients_by_name,
            optimizer_state=self._optimizer_state(),
            buffers=shared.buffers,
            forward_passes=forward_passes,
            backward_passes=backward_passes,
            optimizer_steps=optimizer_steps,
            iteration_time_s=elapsed,
            phases=phases,
            peak_location=figures.peak_location if located else None,
            layers=layers,
            device_used=usage.device_used if usage is not None else None,
            process_used=usage.process_used if usage is not None else None,
            outside_pytorch=outside,
            device_total=stamp.capacity,
            peak_breakdown=breakdown,
            peak_layers=peak_layers,
            peak_transient=transient,
            peak_transient_in=transient_in,
            ddp_gradient_buckets=shared.ddp_gradient_buckets,
            fsdp_gathered_parameters=self._fsdp.finish_iteration() if self._fsdp is not None else None,
            rank=shared.rank,
            reported=True,
            detail=self.level,
            overhead_budget=stamp.overhead,
            peak_other_before=other_before,
            peak_step_temporaries=step_temporaries,
            model_name=shared.model_name,
        )

    def _light_record(
        self,
        position: Position,
        final: Reading,
        iteration_peak: int | None,
        counts: tuple[int, int, int] | tuple[None, None, None],
        elapsed: float,
        reported: bool = False,
    ) -> IterationRecord:
        """The record of an iteration that is not reported: what one read of the counters,
        the pass counts and the sizes known already give; what needs the phase
        boundaries (phases, feature maps, gradients, intermediate gradients, the
        peak's phase) is ``None``."""
        make = self._light_maker()[0]
        has_peak = self.counter.has_peak
        # None each where the hooks slept through it: unknown, not 0
        forward_passes, backward_passes, optimizer_steps = counts
        fsdp = self._fsdp
        return make(
            position[0],
            position[1],
            position[2],
            final.allocated,
            self._max_allocated if has_peak else None,
            iteration_peak,
            self._max_reserved if has_peak else None,
            final.reserved,
            self._optimizer_state(),
            forward_passes,
            backward_passes,
            optimizer_steps,
            elapsed,
            fsdp.finish_iteration() if fsdp is not None else None,
            reported,  # reported at "light": the budget afforded no more
        )

    def _light_maker(self) -> tuple[RecordMaker, RecordMaker]:
        """The makers of light records (:data:`_LIGHT_VARYING` in order) and of those of iterations
        the hooks slept through (:data:`_SLEPT_VARYING`), from templates of what they share while
        the model and the device do not change (:class:`_RecordStamp`)."""
        makers = self._stamp.makers(self._model_state.figures)
        self._make_slept = makers[1]
        return makers

    def _read_peaks(self, allocated: int | None, reserved: int | None) -> None:
        """Fold an iteration's highest peaks into those since the profiler started."""
        if allocated is not None and (self._max_allocated is None or allocated > self._max_allocated):
            self._max_allocated = allocated
        if reserved is not None and (self._max_reserved is None or reserved > self._max_reserved):
            self._max_reserved = reserved

    def _peak_result(self, iteration_peak: int | None) -> PeakResult | None:
        """What the iteration's peak held, where the breakdown watched it (watched iterations,
        the breakdown on in their plan)."""
        tracker = self._observers.peak
        if tracker is None or tracker not in self._plan.observers:
            return None
        params = self._model_state.parameters()
        return self.guard.call(BREAKDOWN_PART, tracker.result, iteration_peak, params, self._optimizer_list())


def _check_optimizers_step(optimizers: list[torch.optim.Optimizer] | None, model: torch.nn.Module) -> None:
    """``ValueError`` naming ``optimizer`` for a given optimizer that steps none of the model's
    parameters (another model's): its state would be counted as 0 and its step, not this
    model's, would be missed. A model without parameters has nothing to check."""
    if not optimizers:
        return
    ids = {id(p) for p in model.parameters()}
    if not ids:
        return
    for index, opt in enumerate(optimizers):
        if not optimizer_holds_any(opt, ids):
            which = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
            held = sum(len(group["params"]) for group in opt.param_groups)
            raise ValueError(
                f"{which}: this {type(opt).__name__} steps none of the model's parameters "
                f"(it holds {held} parameter(s) of another model); give the optimizer that "
                "trains this model, or leave optimizer=None to find it"
            )

