"""Hooks that find the phases of a training iteration without a call from the user.

- forward: the first module *of this model* entered with grad enabled from outside
  the model's other modules (:mod:`.entries`): the root's ``forward``, or the
  module a framework's method calls (``self.net(x)`` in Lightning's
  ``training_step``). Modules entered one after the other before a backward
  (``self.encoder``, then ``self.decoder``) make one forward pass. Forwards under
  ``no_grad`` (evaluation) and checkpoint recomputation during backward are not
  a forward phase;
- backward: a pre-hook on the autograd node of each forward output marks when
  the gradient reaches the model, and a callback queued on the autograd engine
  marks when the whole backward pass has finished;
- optimizer step: step pre/post hooks, on the given optimizers or, when none was
  given, torch's global optimizer hooks filtered to optimizers that step this
  model's parameters. A step that runs a closure (``optimizer.step(closure)``:
  Lightning's automatic optimization, ``torch.optim.LBFGS``) holds forwards and
  backwards: they count as such, and the optimizer phase is the update, what
  runs after a closure's backward (until the next closure's forward or the
  step's end). What runs from the step's start to the closure's first forward
  is "other".

A framework that knows its phases can say so with :meth:`TrainingStepHooks.begin`
and :meth:`TrainingStepHooks.end` (``MemoryProfiler.phase(name)``); the
automatic hooks that fire inside such a phase do not open a second one.

On iterations that will be reported (:attr:`TrainingStepHooks.reported`) the
device counter is read at every boundary and a new peak interval started, so
the peak of each phase is exact. The others are not watched at all: once the
entry modules are known, :meth:`TrainingStepHooks.sleep` takes every hook off
(the model's modules take torch's fast call path, the optimizer steps run no
hook), and :meth:`TrainingStepHooks.wake` puts them back before the next
reported iteration. The one read of such an iteration is
:meth:`TrainingStepHooks.finish_iteration`'s, whose peak is the iteration's;
its passes and steps are not counted (``None`` in its record, not a false 0).
Where the hooks cannot sleep (still learning the entry modules, a model run
through ``torch.compile``, whose compiled code would be guarded on the hooks,
or a phase still open at ``record_stats()``) they stay on and only count
passes and steps and follow the phase (a forward during backward is a
recomputation, a step inside backward is part of it): no counter read, no
gradient sizes, no callback queued on autograd's engine; backward's end is
noticed at the next forward, step or ``record_stats()``. Everything the hooks
measure lands in a :class:`StepMeasurements`, which the profiler turns into a
record.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.measure.devices import CpuCounter
    >>> model = torch.nn.Linear(8, 8)
    >>> counter = CpuCounter(); counter.start()
    >>> hooks = TrainingStepHooks(model, counter, list(model.named_parameters()))
    >>> hooks.install()
    >>> model(torch.randn(4, 8)).sum().backward()
    >>> m = hooks.finish_iteration()
    >>> m.forward_passes, m.backward_passes, m.feature_maps >= 4 * 8 * 4
    (1, 1, True)
    >>> hooks.remove(); counter.stop()
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .accounting import GradientSizes, allocation_bytes, optimizer_holds_any, same_device
from .devices import MemoryCounter, Reading
from ..faults import FaultGuard
from .entries import FORWARD_PART, EntryWatch
from .layers import ATTRIBUTION_PART, LayerAttribution, LayerBreakdown, is_compiled
from .peak_breakdown import BREAKDOWN_PART, PeakBreakdown
from .trees import output_grad_nodes

__all__ = [
    "StepMeasurements",
    "TrainingStepHooks",
    "PhaseBlock",
    "EXPLICIT_PHASES",
    "BACKWARD_PART",
    "OPTIMIZER_PART",
]

#: The parts of the profiler a fault in the backward and the optimizer-step hooks switches off
#: (the forward hooks': ``entries.FORWARD_PART``).
BACKWARD_PART = "backward hooks"
OPTIMIZER_PART = "optimizer hooks"

#: The id of the backward graph running on this thread, -1 outside backward
#: (torch 2.1 and later; without it, a backward is taken as ended at the next event).
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)

#: The phases a framework can mark itself (``MemoryProfiler.phase(name)``).
EXPLICIT_PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepMeasurements:
    """What the hooks measured during one iteration (mutable while it runs), in bytes."""

    forward_passes: int = 0
    backward_passes: int = 0
    optimizer_steps: int = 0
    feature_maps: int = 0
    #: gradient bytes per parameter when the last backward ended (None: no backward seen)
    gradient_sizes: list[int] | None = None
    iteration_peak: int | None = None
    peak_phase: str | None = None
    phase_peak: dict[str, int] = field(default_factory=dict)
    phase_end_allocated: dict[str, int] = field(default_factory=dict)
    phase_count: dict[str, int] = field(default_factory=dict)
    #: the device reading taken when ``record_stats()`` closed the iteration
    final: Reading | None = None
    #: the module running when the iteration's peak was reached (per-layer mode)
    peak_location: str | None = None
    #: what the largest forward saved, by module (per-layer mode), and its allocator delta
    layers: LayerBreakdown | None = None
    layers_kept: int = 0
    #: whether passes and steps were counted (False: the hooks slept through the iteration)
    counted: bool = True
    #: calls that entered the model from outside it, no-grad ones too (0: the model never ran)
    model_calls: int = 0

    @property
    def counts(self) -> tuple[int, int, int] | tuple[None, None, None]:
        """(forward passes, backward passes, optimizer steps); ``None`` each where not counted."""
        if not self.counted:
            return None, None, None
        return self.forward_passes, self.backward_passes, self.optimizer_steps


def _queues_own_callbacks(model: torch.nn.Module) -> bool:
    """DDP and FSDP wrappers queue autograd-engine callbacks of their own during backward."""
    names = {type(m).__name__ for m in model.modules()} if hasattr(model, "modules") else set()
    return bool(names & {"DistributedDataParallel", "FullyShardedDataParallel"}) or any(
        type(m).__name__.startswith("FSDP") for m in model.modules()
    )


class _BackwardPass:
    """One forward pass's pending backward: fires once, when the gradient first reaches an output."""

    __slots__ = ("hooks", "started", "guard")

    def __init__(self, hooks: TrainingStepHooks) -> None:
        self.hooks = hooks._weak_self  # one weak reference for every pass: none made per forward
        self.started = False
        self.guard = hooks.guard

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        try:  # autograd calls this: nothing may escape into backward
            hooks = self.hooks()
            if hooks is None or self.started or BACKWARD_PART in self.guard.disabled:
                return None
            self.started = True
            hooks._backward_started(grad_outputs)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(BACKWARD_PART, exc)
        return None


class _ForwardPass:
    """A forward pass: from its first entry into the model to its last exit before a backward."""

    __slots__ = ("start", "end_allocated", "pending", "explicit", "attributed", "before")

    def __init__(self, start: Reading | None, pending: _BackwardPass, explicit: bool, before: int) -> None:
        #: the reading when it began; ``None`` on an iteration that is not reported
        self.start = start
        #: the iteration's feature maps before this pass (the largest earlier pass)
        self.before = before
        #: allocated at the last exit from the model (None while none happened)
        self.end_allocated: int | None = None
        self.pending = pending
        self.explicit = explicit
        self.attributed = False


class TrainingStepHooks:
    """Installs the phase hooks on a model and accumulates one iteration's measurements.

    Args:
        model: the root module.
        counter: the device counter to read at each boundary.
        params: ``(name, parameter)`` pairs whose gradients are measured.
        optimizers: optimizers to hook; ``None`` hooks every optimizer that
            steps one of ``params``.
        guard: contains faults (see :class:`~pytorch_mem_profiler.faults.FaultGuard`).
        on_optimizer_step: called with an optimizer after the first of its steps seen.
        on_forward_first_call: called once, at the first forward.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        counter: MemoryCounter,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        optimizers: Iterable[torch.optim.Optimizer] | None = None,
        guard: FaultGuard | None = None,
        on_optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None,
        on_forward_first_call: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self._weak_self = weakref.ref(self)
        self.counter = counter
        self.params = list(params)
        self.device = counter.device
        self.guard = guard or FaultGuard()
        self._explicit_optimizers = None if optimizers is None else list(optimizers)
        self._on_optimizer_step = on_optimizer_step
        self._on_forward_first_call = on_forward_first_call
        self._param_ids = {id(p) for _, p in self.params}
        self._gradient_sizes = GradientSizes(self.params)
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # optimizers already passed to on_optimizer_step
        self._announced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list = []
        self._entries = EntryWatch(model, self._entered, self._exited, self.guard)
        self._phase = "other"
        self._pass: _ForwardPass | None = None
        # optimizer steps running (nested steps count once), forwards begun in the
        # running step, and whether the running step began inside backward
        self._step_depth = 0
        self._step_forwards = 0
        self._step_in_backward = False
        # phases a framework marked itself (MemoryProfiler.phase)
        self._explicit: set[str] = set()
        self._location: str | None = None
        #: per-layer attribution, used on iterations marked ``detailed``
        self.attribution: LayerAttribution | None = None
        #: whether per-layer attribution runs in this iteration (a reported one)
        self.detailed = False
        # Per-layer mode reads the counters at every tracked module's end in forward only
        # while forward is where the iterations peak (the first reported one always): one
        # read per module saved otherwise. Backward's module boundaries are always read
        # (the activation gradients at backward's peak are measured from them).
        self._split_forward = True
        #: whether the running iteration will be reported: only then are the
        #: counters read at the phase boundaries and the gradients measured
        self.reported = True
        # a backward began on an iteration not reported and its end is not noticed yet
        self._backward_unsettled = False
        #: what is alive at the peak, watched on reported iterations only (``None`` otherwise)
        self.breakdown: PeakBreakdown | None = None
        #: read backward's end only after callbacks queued later during backward
        #: (DDP and FSDP finish their gradient reduction in one)
        self.defer_backward_end = _queues_own_callbacks(model)
        self.current = StepMeasurements()
        self.max_reserved: int | None = None
        self.max_allocated: int | None = None
        self._asleep = False
        # parts whose hooks are taken off for good, a fault having switched them off
        self._backward_off = False
        self._optimizer_off = False
        # backward's end callbacks (deferred once under DDP/FSDP, direct), made once
        self._end_callbacks: tuple[Callable[[], Any], Callable[[], Any]] | None = None
        # the last forward pass's pending backward, until the next forward
        self._awaiting: _BackwardPass | None = None
        # Hooks on or in a compiled module are guarded on by its compiled code: never toggled.
        self._compiled = is_compiled(model)

    # -- installation ------------------------------------------------------
    def install(self) -> None:
        """Register every hook; :meth:`remove` takes them all away."""
        self._entries.install()
        self._install_step_hooks()
        # The counters' starting point: peaks are measured from here on.
        first = self.counter.mark()
        self.max_reserved = first.reserved
        self.max_allocated = first.allocated

    def _install_step_hooks(self) -> None:
        # The bound methods: each holds its guard's try inline (no wrapper frame per step).
        if self._optimizer_off:
            return
        pre, post = self._optimizer_pre, self._optimizer_post
        if self._explicit_optimizers is None:
            self._handles.append(register_optimizer_step_pre_hook(pre))
            self._handles.append(register_optimizer_step_post_hook(post))
        else:
            for opt in self._explicit_optimizers:
                self._handles.append(opt.register_step_pre_hook(pre))
                self._handles.append(opt.register_step_post_hook(post))

    @property
    def asleep(self) -> bool:
        """Whether the hooks are off for iterations that are not reported (:meth:`sleep`)."""
        return self._asleep

    def sleep(self) -> bool:
        """Take every hook off until :meth:`wake`; whether it did.

        Called between iterations when the next one will not be reported. Refused
        while the entry modules are still being learned, for a model run through
        ``torch.compile`` (its compiled code is guarded on the hooks: taking them
        off and on would recompile it), and while anything is open (a forward
        awaiting its backward, a backward, a step, a phase marked by hand).
        """
        if self._asleep or self._pass is not None or self._step_depth or self._explicit:
            return False
        if self._awaiting is not None and not self._awaiting.started and not self._backward_off:
            return False  # the last forward's backward is still to come: it must be found
        if self._backward_unsettled or self._phase == "backward" or self._compiled:
            return False
        if not self._entries.pause():
            return False
        self._remove_handles()
        if self._explicit_optimizers is None and not self._optimizer_off:
            # Still told of an optimizer newly seen stepping the model: its state counts
            # from the iteration it appears on (one dictionary lookup per step).
            self._handles.append(register_optimizer_step_post_hook(self._optimizer_seen))
        self._asleep = True
        self._phase = "other"
        return True

    def wake(self) -> None:
        """Put the hooks back after :meth:`sleep` (before an iteration that will be reported)."""
        if not self._asleep:
            return
        self._asleep = False
        self._remove_handles()
        self._entries.resume()
        self._install_step_hooks()

    def drop_switched_off(self) -> None:
        """Take off for good the hooks of the parts a fault switched off, with what they left open.

        Called between iterations (never inside backward). A switched-off hook returns at
        once, but what its fault interrupted stays open: a forward entered and never
        left, a step begun and never ended, a backward whose start or end was never
        seen. Any of them refuses :meth:`sleep`, so every later iteration would pay a
        reported one's hooks, and with no forward found the model's every module would
        be hooked again to learn its entries. So the part's hooks go (the others keep
        theirs: a phase marked with :class:`PhaseBlock` is still measured) and what it
        left open is closed.
        """
        disabled = self.guard.disabled
        entries = self._entries
        if FORWARD_PART in disabled and not entries.off:
            entries.switch_off()
            # its pass never closes now, and its backward is never looked for
            self._pass = self._awaiting = None
            if self._phase == "forward":
                self._phase = "other"
        if OPTIMIZER_PART in disabled and not self._optimizer_off:
            self._optimizer_off = True
            self._remove_handles()
            self._step_depth = self._step_forwards = 0
            self._step_in_backward = False
            if self._phase == "optimizer":
                self._phase = "other"
        if BACKWARD_PART in disabled and not self._backward_off:
            self._backward_off = True
            self._awaiting = None
            self._backward_unsettled = False
            if self._phase == "backward":
                self._phase = "other"

    def release(self) -> None:
        """Remove the hooks and drop the callbacks, which refer back to their owner:
        a closed profiler is then freed at once, not at the next cycle collection."""
        self.guard.clean_up("close", self.remove, self._entries.release)
        self._on_optimizer_step = None
        self._on_forward_first_call = None
        self._end_callbacks = None
        self.attribution = None
        self.current = StepMeasurements()

    def remove(self) -> None:
        """Remove every hook this object installed (each in its own try: see ``FaultGuard.clean_up``)."""
        self._pass = self._awaiting = None
        self._asleep = False
        steps = [self._entries.remove, self._remove_handles]
        if self.attribution is not None:
            steps.append(self.attribution.close)
        self.guard.clean_up("close", *steps)

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def phase(self) -> str:
        """The phase running now: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``."""
        return self._phase

    @property
    def entry_modules(self) -> list[torch.nn.Module]:
        """The modules hooked to find forward: the root and those a forward was seen entering
        through (every module of the model until the first training forward)."""
        return self._entries.hooked_modules()

    def retarget(self, counter: MemoryCounter, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Read ``counter`` and measure ``params`` from now on (the model moved to another device)."""
        self.counter = counter
        self.device = counter.device
        self.set_params(params)
        counter.mark()

    def set_params(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Measure the gradients of ``params`` from now on (after the model changed)."""
        self.params = list(params)
        self._param_ids = {id(p) for _, p in self.params}
        self._gradient_sizes = GradientSizes(self.params)
        self._holds = weakref.WeakKeyDictionary()

    # -- boundaries --------------------------------------------------------
    def _switch(self, next_phase: str, location: str | None = None) -> Reading | None:
        """A phase boundary: read the counters (:meth:`_mark`) on a reported iteration;
        on the others only note the phase, and give ``None``."""
        if self.reported:
            return self._mark(next_phase, location)
        self._phase = next_phase
        return None

    def _settle_backward(self) -> None:
        """On an iteration not reported, a backward whose start was seen has ended once
        this thread is outside every backward graph: count it and leave its phase."""
        if not self._backward_unsettled or _graph_task_id() != -1:
            return
        self._backward_unsettled = False
        self.current.backward_passes += 1
        if self._phase == "backward":
            self._phase = "optimizer" if self._step_depth and not self._step_in_backward else "other"

    def _mark(self, next_phase: str, location: str | None = None) -> Reading:
        """Close the running interval (recording its peak) and open the next one.

        ``next_phase`` equal to the running phase splits it at a module boundary
        (per-layer mode), to learn where its peak was reached.
        """
        reading = self.counter.mark()
        m = self.current
        ended = self._phase
        peak = reading.peak_allocated
        if peak is not None:
            if peak > m.phase_peak.get(ended, -1):
                m.phase_peak[ended] = peak
            if m.iteration_peak is None or peak > m.iteration_peak:
                m.iteration_peak = peak
                m.peak_phase = ended
                m.peak_location = self._location
            if self.max_allocated is None or peak > self.max_allocated:
                self.max_allocated = peak
        if reading.peak_reserved is not None:
            if self.max_reserved is None or reading.peak_reserved > self.max_reserved:
                self.max_reserved = reading.peak_reserved
        if ended != "other" and next_phase != ended:
            m.phase_end_allocated[ended] = reading.allocated
        tracker = self.breakdown
        if tracker is not None:
            # What _tell_breakdown does, without its dispatch by name (a boundary per tracked
            # module, twice, per reported iteration).
            try:
                tracker.marked(reading, ended, next_phase, self._location)
            except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
                self._breakdown_failed(tracker, exc)
        self._phase = next_phase
        self._location = location
        return reading

    def _tell_breakdown(self, what: str, *args: Any) -> None:
        """Hand an event to the peak breakdown; a fault switches it off (the rest goes on)."""
        tracker = self.breakdown
        if tracker is None:
            return
        try:
            getattr(tracker, what)(*args)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self._breakdown_failed(tracker, exc)

    def _breakdown_failed(self, tracker: PeakBreakdown, exc: Exception) -> None:
        """The breakdown raised: switch it off (the rest goes on)."""
        self.breakdown = None
        tracker.close()
        self.guard.fault(BREAKDOWN_PART, exc)

    def _count(self, phase: str) -> None:
        counts = self.current.phase_count
        counts[phase] = counts.get(phase, 0) + 1

    def forward_location(self, ended_in: str, now_in: str) -> None:
        """A tracked module's forward ended: what ran since the last mark is put down to
        ``ended_in``; the code runs in ``now_in`` from here."""
        if self._phase == "forward" and self._split_forward:
            self._location = ended_in
            self._mark("forward", now_in)

    def backward_location(self, name: str) -> None:
        """Backward reached the outputs of the tracked module ``name``."""
        if self._phase == "backward":
            self._mark("backward", name)

    # -- forward -------------------------------------------------------------
    def _entered(self, module: torch.nn.Module, args: Any) -> bool:
        """A call entered the model from outside it: is it (part of) a training forward?"""
        # No-grad forwards (evaluation) and recomputation inside backward leave
        # nothing for a later backward: they are not a forward phase.
        self.current.model_calls += 1
        if self._backward_unsettled:
            self._settle_backward()
        if not torch.is_grad_enabled() or self._phase == "backward":
            return False
        if "forward" in self._explicit:
            # The framework marked this forward: only learn the inputs.
            if self._pass is not None and self._pass.attributed and self.attribution is not None:
                self.attribution.add_inputs(args)
            if self.breakdown is not None:
                self._tell_breakdown("add_inputs", args)
            return True
        self._begin_forward(args, module)
        return True

    def _exited(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A training forward's call into the model returned."""
        pass_ = self._pass
        if pass_ is None:
            return
        if not self._backward_off:  # off (a fault): no backward is looked for
            if isinstance(output, torch.Tensor):  # the common case, without walking a structure
                node = output.grad_fn
                if node is not None:
                    node.register_prehook(pass_.pending)
            else:
                for node in output_grad_nodes(output):
                    node.register_prehook(pass_.pending)
        if "forward" not in self._explicit:
            self._leave(pass_)

    def _begin_forward(self, args: Any, entry: torch.nn.Module | None, explicit: bool = False) -> None:
        pass_ = self._pass
        location = "" if self.detailed and self._split_forward else None
        if pass_ is not None and not explicit and not pass_.explicit and not pass_.pending.started:
            # Entered again before any backward (self.decoder after self.encoder): the same pass.
            self._switch("forward", location)
            self._tell_breakdown("watch_forward", args)
            self._attribute(args, entry, resume=True)
        else:
            if pass_ is not None:
                self._close_forward()
            if self._step_depth and not self._step_forwards and self._phase == "optimizer":
                # From the step's start to its closure's first forward is not the update.
                self._phase = "other"
            if self._on_forward_first_call is not None:
                callback, self._on_forward_first_call = self._on_forward_first_call, None
                callback()
            m = self.current
            if self.reported:
                start: Reading | None = self._mark("forward", location)
                self._count("forward")
            else:  # the light path: only the phase and the count
                self._phase, start = "forward", None
            self._pass = _ForwardPass(start, _BackwardPass(self), explicit, m.feature_maps)
            m.forward_passes += 1
            if self.breakdown is not None:  # before the attribution's hooks: popped after them
                self._tell_breakdown("watch_forward", args)
            if self.detailed:
                self._attribute(args, entry, resume=False)
        if self._step_depth:
            self._step_forwards += 1

    def _attribute(self, args: Any, entry: torch.nn.Module | None, resume: bool) -> None:
        attribution = self.attribution
        pass_ = self._pass
        if not self.detailed or attribution is None or pass_ is None:
            return
        if ATTRIBUTION_PART in self.guard.disabled or (resume and not pass_.attributed):
            return
        try:
            if resume:
                attribution.resume(args, entry=entry)
            else:
                attribution.start(args, entry=entry)
            pass_.attributed = True
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            attribution.close()
            pass_.attributed = False
            self.guard.fault(ATTRIBUTION_PART, exc)

    def _leave(self, pass_: _ForwardPass) -> None:
        """The model was left: the pass may go on (another entry) or end (backward, a step)."""
        if pass_.attributed and self.attribution is not None:
            # Skipped once a fault switched it off: the meter then closes it between iterations
            # (a pop here can run inside backward, whose saved-tensor stack is not the thread's).
            self.guard.call(ATTRIBUTION_PART, self.attribution.close)
        if self.breakdown is not None:  # pushed before the attribution's: popped after it
            self._tell_breakdown("unwatch_forward")
        if self._phase == "forward":
            reading = self._switch("other")
            if reading is None or pass_.start is None:
                return  # not reported: feature maps are not measured
            pass_.end_allocated = end = reading.allocated
            # Known from here on (an OOM post-mortem reads it mid-iteration).
            self.current.feature_maps = max(pass_.before, end - pass_.start.allocated)

    def _close_forward(self) -> None:
        """End the forward pass for good: its feature maps are what it left allocated."""
        pass_, self._pass = self._pass, None
        if pass_ is None:
            return
        self._awaiting = pass_.pending
        self._leave(pass_)  # still inside it when a phase marked by hand ends it
        breakdown: LayerBreakdown | None = None
        if (
            pass_.attributed
            and self.attribution is not None
            and self.attribution.watching_saved_tensors
            # switched off by a fault during this forward: what it put down so far may be partial
            and ATTRIBUTION_PART not in self.guard.disabled
        ):
            breakdown = self.attribution.breakdown
        if pass_.end_allocated is None or pass_.start is None:
            return
        m = self.current
        kept = pass_.end_allocated - pass_.start.allocated
        m.feature_maps = max(pass_.before, kept)
        if breakdown is not None and (kept > pass_.before or m.layers is None):
            m.layers, m.layers_kept = breakdown, kept

    # -- backward ------------------------------------------------------------
    def _backward_started(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        try:
            if "backward" in self._explicit or self._phase == "backward":
                return  # marked by the framework, or a second forward's outputs in the same backward
            pass_ = self._pass
            if pass_ is not None and not pass_.attributed and pass_.start is None and self._phase != "forward":
                self._pass, self._awaiting = None, pass_.pending  # as _close_forward does, the pass left already
            else:
                self._close_forward()
            if not self.reported:
                # Counted and left when noticed ended (_settle_backward): nothing queued on
                # the engine, no gradient sizes, no hand-over to autograd's device thread.
                self._phase = "backward"
                self._backward_unsettled = True
                return
            self._mark("backward", "" if self.detailed else None)
            self._count("backward")
            if self.breakdown is not None:
                # The gradients of the outputs are already allocated when the
                # gradient reaches the model: they belong to backward.
                out_grads = sum(
                    allocation_bytes(g)
                    for g in grad_outputs
                    if isinstance(g, torch.Tensor) and same_device(g, self.device)
                )
                self._tell_breakdown("backward_started", out_grads)
            # Queued now, this callback runs when the whole backward pass is
            # done. Under DDP/FSDP it queues itself once more so that it runs
            # after the callbacks they queue later, in which they finish reducing.
            engine = torch.autograd.Variable._execution_engine
            deferred, direct = self._backward_end_callbacks()
            engine.queue_callback(deferred if self.defer_backward_end else direct)
        except Exception as exc:  # noqa: BLE001 - raised inside autograd: contain it here
            self.guard.fault(BACKWARD_PART, exc)

    def _backward_end_callbacks(self) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """Backward's end as autograd-engine callbacks, each contained: (queued once more under
        DDP/FSDP, direct). Made once, at the first reported backward; dropped by :meth:`release`."""
        callbacks = self._end_callbacks
        if callbacks is None:
            wrap = self.guard.wrap
            callbacks = self._end_callbacks = (
                wrap(BACKWARD_PART, self._backward_finishing),
                wrap(BACKWARD_PART, self._backward_finished),
            )
        return callbacks

    def _backward_finishing(self) -> None:
        engine = torch.autograd.Variable._execution_engine
        callbacks = self._end_callbacks
        # None once released during this backward: a wrapper of its own, not kept.
        end = callbacks[1] if callbacks is not None else self.guard.wrap(BACKWARD_PART, self._backward_finished)
        engine.queue_callback(end)

    def _backward_finished(self) -> None:
        # Inside an optimizer step (a closure), what follows backward is the update.
        end = self._switch("optimizer" if self._step_depth and not self._step_in_backward else "other")
        m = self.current
        m.backward_passes += 1
        if end is None:
            return  # not reported: gradients and backward's activation gradients are not measured
        m.gradient_sizes = self._gradient_sizes()
        if self.breakdown is not None:
            self._tell_breakdown("gradients_ready", [p for _, p in self.params])

    # -- optimizer step --------------------------------------------------------
    def _steps_model(self, optimizer: torch.optim.Optimizer) -> bool:
        explicit = self._explicit_optimizers
        if explicit is not None:
            # only those given: another model's optimizer stepping is not this model's step
            return any(optimizer is given for given in explicit)
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = optimizer_holds_any(optimizer, self._param_ids)
            self._holds[optimizer] = holds
        return holds

    # Torch calls the two step hooks: each is contained as ``FaultGuard.wrap(OPTIMIZER_PART, ...)``
    # would, inline (one Python frame fewer per step).
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if OPTIMIZER_PART in self.guard.disabled:
                return None
            if self._steps_model(optimizer) and "optimizer" not in self._explicit:
                self._step_began()
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if OPTIMIZER_PART in self.guard.disabled:
                return None
            if not self._steps_model(optimizer):
                return None
            if "optimizer" not in self._explicit:
                self._step_ended()
            self._announce(optimizer)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _optimizer_seen(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step post-hook while asleep: only tells of an optimizer newly seen stepping the model."""
        try:
            if optimizer in self._announced or self._on_optimizer_step is None:
                return None
            if OPTIMIZER_PART not in self.guard.disabled and self._steps_model(optimizer):
                self._announce(optimizer)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _announce(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell ``on_optimizer_step`` of ``optimizer`` once (what it is for: an optimizer newly
        seen stepping the model)."""
        if self._on_optimizer_step is not None and optimizer not in self._announced:
            self._announced[optimizer] = True
            self._on_optimizer_step(optimizer)

    def _step_began(self) -> None:
        if self._backward_unsettled:
            self._settle_backward()
        self._step_depth += 1
        if self._step_depth > 1:
            return
        self._step_forwards = 0
        # A step run from a gradient hook inside backward (per-parameter steps) is part of backward.
        self._step_in_backward = self._phase == "backward"
        if not self._step_in_backward:
            if self._pass is not None:
                self._close_forward()
            if self.reported:
                self._mark("optimizer")
            else:
                self._phase = "optimizer"

    def _step_ended(self) -> None:
        if self._step_depth == 0:
            return
        self._step_depth -= 1
        if self._step_depth:
            return
        m = self.current
        m.optimizer_steps += 1
        if self._step_in_backward:
            self._step_in_backward = False
            return
        if self.reported:
            self._mark("other")
            self._count("optimizer")
        else:
            self._phase = "other"

    def discovered_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers known to step this model: given ones, or those seen stepping it."""
        if self._explicit_optimizers is not None:
            return list(self._explicit_optimizers)
        return [opt for opt, holds in list(self._holds.items()) if holds]

    # -- phases a framework marks itself ---------------------------------------
    def begin(self, phase: str) -> str | None:
        """A framework says ``phase`` (``"forward"``, ``"backward"`` or ``"optimizer"``) starts now.

        Returns a token for :meth:`end`; ``None`` when that phase was already
        marked as running (the inner mark is then ignored). The automatic hooks
        that fire inside the phase do not open a second one.
        """
        if phase not in EXPLICIT_PHASES:
            raise ValueError(f"phase name must be one of {', '.join(map(repr, EXPLICIT_PHASES))}: name={phase!r}")
        if phase in self._explicit:
            return None
        if self._backward_unsettled:
            self._settle_backward()
        if phase == "forward":
            self._begin_forward((), None, explicit=True)
        elif phase == "backward":
            self._close_forward()
            self._switch("backward", "" if self.detailed else None)
            self._count("backward")
        else:
            self._step_began()
        self._explicit.add(phase)
        return phase

    def end(self, token: str | None) -> None:
        """The phase :meth:`begin` returned ``token`` for has ended."""
        if token is None or token not in self._explicit:
            return
        self._explicit.discard(token)
        if token == "forward":
            self._close_forward()
        elif token == "backward":
            if self._phase == "backward":
                self._backward_finished()
        else:
            self._step_ended()

    # -- iteration ---------------------------------------------------------
    def finish_asleep(self) -> Reading | None:
        """:meth:`finish_iteration` for an iteration the hooks slept through: its one read and
        peak reset, and nothing else (nothing watched it, so nothing was measured); ``None``
        where it does not apply (awake, or a phase marked by hand is open), and
        :meth:`finish_iteration` must close the iteration instead.

        The light path of every iteration that is not reported: no measurements
        object made, no phase bookkeeping.
        """
        if not self._asleep or self._explicit or self._pass is not None or self._step_depth:
            return None
        current = self.current
        if current.forward_passes or current.backward_passes or current.optimizer_steps:
            return None  # a phase marked by hand ran while asleep: the full close counts it
        reading = self.counter.mark()
        peak = reading.peak_allocated
        if peak is not None and (self.max_allocated is None or peak > self.max_allocated):
            self.max_allocated = peak
        peak = reading.peak_reserved
        if peak is not None and (self.max_reserved is None or peak > self.max_reserved):
            self.max_reserved = peak
        return reading

    def finish_iteration(self) -> StepMeasurements:
        """Close the iteration: read the counters once more and hand back its measurements."""
        entries = self._entries
        if self._backward_unsettled:
            self._settle_backward()
        if self._pass is not None and not self._pass.explicit and entries.depth == 0:
            self._close_forward()
        m = self.current
        # The iteration's one read when it is not reported: its peak is the iteration's.
        m.final = self._mark(self._phase)
        if self.detailed and m.peak_phase is not None:
            # A peak in a forward not split by module has no location (None, not a guess):
            # the next reported iteration splits it.
            self._split_forward = m.peak_phase == "forward"
        if self._asleep:
            m.counted = False  # nothing watched the iteration: its passes are unknown
        elif entries.learning and m.forward_passes:
            entries.finish_learning()  # the entry modules are known: drop the other hooks
        elif not entries.learning and m.optimizer_steps and not m.forward_passes:
            entries.relearn()  # stepped without a forward found: entered another way
        done, self.current = m, StepMeasurements()
        return done


class PhaseBlock:
    """A ``with`` block that marks one phase on :class:`TrainingStepHooks` (see
    ``MemoryProfiler.phase``). Faults are contained by ``guard`` (part ``"phases"``);
    exceptions of the block itself propagate, and the phase still ends.

    Example::

        >>> import torch
        >>> from pytorch_mem_profiler.measure.devices import CpuCounter
        >>> model = torch.nn.Linear(4, 4)
        >>> counter = CpuCounter(); counter.start()
        >>> hooks = TrainingStepHooks(model, counter, list(model.named_parameters()))
        >>> hooks.install()
        >>> with PhaseBlock(hooks, "forward"):
        ...     y = model(torch.randn(2, 4))          # the automatic hooks do not count it twice
        >>> with PhaseBlock(hooks, "backward"):
        ...     y.sum().backward()
        >>> m = hooks.finish_iteration()
        >>> m.forward_passes, m.backward_passes, m.phase_count
        (1, 1, {'forward': 1, 'backward': 1})
        >>> hooks.remove(); counter.stop()
    """

    __slots__ = ("hooks", "phase", "guard", "_token")

    def __init__(self, hooks: TrainingStepHooks | None, phase: str, guard: FaultGuard | None = None) -> None:
        if phase not in EXPLICIT_PHASES:
            raise ValueError(f"phase name must be one of {', '.join(map(repr, EXPLICIT_PHASES))}: name={phase!r}")
        self.hooks = hooks
        self.phase = phase
        self.guard = guard or (hooks.guard if hooks is not None else FaultGuard())
        self._token: str | None = None

    def __enter__(self) -> PhaseBlock:
        if self.hooks is not None:
            self._token = self.guard.call("phases", self.hooks.begin, self.phase)
        return self

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None and self.hooks is not None:
            self.guard.call("phases", self.hooks.end, token)
