"""The hook set: torch's hooks that report a training iteration's events to the phase machine.

:class:`StepHooks` installs, removes, puts to sleep and wakes these hooks, and
turns what torch calls into events of the phase machine (:mod:`.phases`), which
decides where the iteration is; it measures nothing itself.

- forward: pre- and post-hooks on the modules a forward enters the model through
  (:mod:`.entries`; every module of the model until the first training forward
  shows which);
- backward: a pre-hook on the autograd node of each forward output (it fires once,
  when the gradient first reaches the model), and, on watched iterations, a
  callback queued on the autograd engine for when the whole backward pass has
  finished (queued once more under DDP and FSDP, which finish their gradient
  reduction in callbacks of their own);
- optimizer step: step pre/post hooks, on the given optimizers or, when none was
  given, torch's global optimizer hooks filtered to optimizers that step this
  model's parameters.

Between watched iterations the hooks sleep: once the entry modules are known,
:meth:`StepHooks.sleep` takes every hook off (the model's modules take torch's
fast call path, the optimizer steps run no hook but one that notices an
optimizer newly seen stepping the model), and :meth:`StepHooks.wake` puts them
back before the next watched iteration. They stay on where they cannot sleep:
while the entry modules are still being learned, for a model run through
``torch.compile`` (its compiled code would be guarded on the hooks), or while
anything is open (:meth:`~.phases.PhaseMachine.at_rest`). A fault in one of the
three kinds of hooks switches that kind off for good (:meth:`StepHooks.drop_switched_off`).

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.measure.devices import CpuCounter
    >>> from pytorch_mem_profiler.measure.phases import PhaseMachine
    >>> from pytorch_mem_profiler.measure.plan import IterationPlan
    >>> model = torch.nn.Linear(8, 8)
    >>> counter = CpuCounter(); counter.start()
    >>> hooks = StepHooks(model, list(model.named_parameters()))
    >>> machine = PhaseMachine(counter.mark, hooks.new_pending, backward_running)
    >>> machine.begin_iteration(IterationPlan.make("phases"))
    >>> hooks.install(machine)
    >>> model(torch.randn(4, 8)).sum().backward()
    >>> final, counts, phase_count, model_calls = machine.finish_iteration(hooks.model_running)
    >>> counts, model_calls
    ((1, 1, 0), 1)
    >>> hooks.release(); machine.release(); counter.stop()
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..faults import FaultGuard
from .accounting import optimizer_holds_any
from .entries import FORWARD_PART, EntryWatch
from .phases import EXPLICIT_PHASES, PhaseMachine, check_phase_name
from .trees import is_compiled, output_grad_nodes

__all__ = [
    "StepHooks",
    "PhaseBlock",
    "EXPLICIT_PHASES",
    "BACKWARD_PART",
    "OPTIMIZER_PART",
    "backward_running",
]

#: The parts of the profiler a fault in the backward and the optimizer-step hooks switches off
#: (the forward hooks': ``entries.FORWARD_PART``).
BACKWARD_PART = "backward hooks"
OPTIMIZER_PART = "optimizer hooks"

#: The id of the backward graph running on this thread, -1 outside backward
#: (torch 2.1 and later; without it, a backward is taken as ended at the next event).
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def backward_running() -> bool:
    """Whether this thread runs inside a backward pass now."""
    return _graph_task_id() != -1


def _queues_own_callbacks(model: torch.nn.Module) -> bool:
    """DDP and FSDP wrappers queue autograd-engine callbacks of their own during backward."""
    names = {type(m).__name__ for m in model.modules()} if hasattr(model, "modules") else set()
    return bool(names & {"DistributedDataParallel", "FullyShardedDataParallel"}) or any(
        type(m).__name__.startswith("FSDP") for m in model.modules()
    )


class _BackwardPass:
    """One forward pass's pending backward, on its outputs' autograd nodes: fires once, when the
    gradient first reaches an output."""

    __slots__ = ("hooks", "started", "guard")

    def __init__(self, hooks: StepHooks) -> None:
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


class StepHooks:
    """Installs the phase hooks on a model and reports what they see to a :class:`~.phases.PhaseMachine`.

    Args:
        model: the root module.
        params: ``(name, parameter)`` pairs of the model (whose optimizers are hooked).
        optimizers: optimizers to hook; ``None`` hooks every optimizer that
            steps one of ``params``.
        guard: contains faults (see :class:`~pytorch_mem_profiler.faults.FaultGuard`).
        on_optimizer_step: called with an optimizer after the first of its steps seen.
        device: the device measured (an ``nn.DataParallel`` replica's forward on another is not watched).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: Sequence[tuple[str, torch.nn.Parameter]],
        optimizers: Iterable[torch.optim.Optimizer] | None = None,
        guard: FaultGuard | None = None,
        on_optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self._device = device
        self._weak_self = weakref.ref(self)
        self.guard = guard or FaultGuard()
        self._explicit_optimizers = None if optimizers is None else list(optimizers)
        self._on_optimizer_step = on_optimizer_step
        self._machine: PhaseMachine | None = None
        self.set_params(params)
        # optimizers already passed to on_optimizer_step
        self._announced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list = []
        # the entry hooks, made at install(): their calls go straight to the machine
        self._entries = EntryWatch(model, _refuse_entry, _ignore_exit, self.guard)
        #: read backward's end only after callbacks queued later during backward
        #: (DDP and FSDP finish their gradient reduction in one)
        self.defer_backward_end = _queues_own_callbacks(model)
        #: whether the hooks are off for iterations that are not watched (:meth:`sleep`)
        self.asleep = False
        # parts whose hooks are taken off for good, a fault having switched them off
        self._backward_off = False
        self._optimizer_off = False
        # backward's end callbacks (deferred once under DDP/FSDP, direct), made once
        self._end_callbacks: tuple[Callable[[], Any], Callable[[], Any]] | None = None
        # Hooks on or in a compiled module are guarded on by its compiled code: never toggled.
        self._compiled = is_compiled(model)

    # -- installation ------------------------------------------------------
    def install(self, machine: PhaseMachine) -> None:
        """Register every hook, each reporting to ``machine``; :meth:`remove` takes them all away."""
        self._machine = machine
        self._entries = EntryWatch(self.model, machine.entered, self._exited, self.guard, self._device)
        self._entries.install()
        self._install_step_hooks()

    def new_pending(self) -> _BackwardPass:
        """The token put on a new forward pass's outputs (the machine makes one per pass)."""
        return _BackwardPass(self)

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
    def model_running(self) -> bool:
        """Whether a module of the model runs now (entered and not left)."""
        return self._entries.depth > 0

    def sleep(self) -> bool:
        """Take every hook off until :meth:`wake`; whether it did.

        Called between iterations when the next one will not be watched. Refused
        while the entry modules are still being learned, for a model run through
        ``torch.compile`` (its compiled code is guarded on the hooks: taking them
        off and on would recompile it), and while the machine is not at rest (a forward
        awaiting its backward, a backward, a step, a phase marked by hand).
        """
        machine = self._machine
        if self.asleep or machine is None or self._compiled or not machine.at_rest():
            return False
        if not self._entries.pause():
            return False
        self._remove_handles()
        if self._explicit_optimizers is None and not self._optimizer_off:
            # Still told of an optimizer newly seen stepping the model: its state counts
            # from the iteration it appears on (one dictionary lookup per step).
            self._handles.append(register_optimizer_step_post_hook(self._optimizer_seen))
        self.asleep = True
        machine.rest()
        return True

    def wake(self) -> None:
        """Put the hooks back after :meth:`sleep` (before an iteration that will be watched)."""
        if not self.asleep:
            return
        self.asleep = False
        self._remove_handles()
        self._entries.resume()
        self._install_step_hooks()

    def learn(self, forward_passes: int, optimizer_steps: int) -> None:
        """An iteration the hooks watched ended with these counts: keep hooks on the entry modules
        only once a forward showed them, and learn them again after steps with no forward found."""
        entries = self._entries
        if entries.learning and forward_passes:
            entries.finish_learning()  # the entry modules are known: drop the other hooks
        elif not entries.learning and optimizer_steps and not forward_passes:
            entries.relearn()  # stepped without a forward found: entered another way

    def drop_switched_off(self) -> None:
        """Take off for good the hooks of the parts a fault switched off, with what they left open.

        Called between iterations (never inside backward). A switched-off hook returns at
        once, but what its fault interrupted stays open: a forward entered and never
        left, a step begun and never ended, a backward whose start or end was never
        seen. Any of them refuses :meth:`sleep`, so every later iteration would pay a
        watched one's hooks, and with no forward found the model's every module would
        be hooked again to learn its entries. So the part's hooks go (the others keep
        theirs: a phase marked with :class:`PhaseBlock` is still measured) and the
        machine closes what they left open.
        """
        disabled = self.guard.disabled
        entries = self._entries
        machine = self._machine
        if FORWARD_PART in disabled and not entries.off:
            entries.switch_off()
            if machine is not None:
                machine.forward_switched_off()
        if OPTIMIZER_PART in disabled and not self._optimizer_off:
            self._optimizer_off = True
            self._remove_handles()
            if machine is not None:
                machine.steps_switched_off()
        if BACKWARD_PART in disabled and not self._backward_off:
            self._backward_off = True
            if machine is not None:
                machine.backward_switched_off()

    def release(self) -> None:
        """Remove the hooks and drop the callbacks, which refer back to their owner:
        a closed profiler is then freed at once, not at the next cycle collection."""
        self.guard.clean_up("close", self.remove, self._entries.release)
        self._on_optimizer_step = None
        self._end_callbacks = None
        self._machine = None

    def remove(self) -> None:
        """Remove every hook this object installed (each in its own try: see ``FaultGuard.clean_up``)."""
        if self._machine is not None:
            self._machine.hooks_removed()
        self.asleep = False
        self.guard.clean_up("close", self._entries.remove, self._remove_handles)

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def entry_modules(self) -> list[torch.nn.Module]:
        """The modules hooked to find forward: the root and those a forward was seen entering
        through (every module of the model until the first training forward)."""
        return self._entries.hooked_modules()

    def set_params(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """The model's parameters from now on (after the model changed): whose optimizers step it."""
        self._param_ids = {id(p) for _, p in params}
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the optimizer :meth:`_optimizer_seen` checked last (whether it steps these parameters)
        self._checked_last: Callable[[], Any] = _nobody

    # -- forward -------------------------------------------------------------
    def _exited(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A training forward's call into the model returned: its backward is looked for on the
        output's autograd nodes."""
        machine = self._machine
        pass_ = machine.forward_pass if machine is not None else None
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
        machine.left(pass_)

    # -- backward ------------------------------------------------------------
    def _backward_started(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        try:
            machine = self._machine
            if machine is None or not machine.backward_started(grad_outputs):
                return
            # Queued now, this callback runs when the whole backward pass is done. Under
            # DDP/FSDP it queues itself once more so that it runs after the callbacks they
            # queue later, in which they finish reducing.
            engine = torch.autograd.Variable._execution_engine
            deferred, direct = self._backward_end_callbacks()
            engine.queue_callback(deferred if self.defer_backward_end else direct)
        except Exception as exc:  # noqa: BLE001 - raised inside autograd: contain it here
            self.guard.fault(BACKWARD_PART, exc)

    def _backward_end_callbacks(self) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """Backward's end as autograd-engine callbacks, each contained: (queued once more under
        DDP/FSDP, direct). Made once, at the first watched backward; dropped by :meth:`release`."""
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
        machine = self._machine
        if machine is not None:
            machine.backward_finished()

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
            machine = self._machine
            if machine is not None and self._steps_model(optimizer):
                machine.step_began()
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if OPTIMIZER_PART in self.guard.disabled:
                return None
            machine = self._machine
            if machine is None or not self._steps_model(optimizer):
                return None
            machine.step_ended()
            self._announce(optimizer)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _optimizer_seen(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step post-hook while asleep: only tells of an optimizer newly seen stepping the model.

        Every step of every optimizer in the process runs it while the hooks sleep: the
        optimizer checked last (weakly held) returns at its first line.
        """
        try:
            if optimizer is self._checked_last():
                return None
            if self._on_optimizer_step is None or OPTIMIZER_PART in self.guard.disabled:
                return None
            if optimizer not in self._announced and self._steps_model(optimizer):
                self._announce(optimizer)
            self._checked_last = weakref.ref(optimizer)
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(OPTIMIZER_PART, exc)
        return None

    def _announce(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell ``on_optimizer_step`` of ``optimizer`` once (what it is for: an optimizer newly
        seen stepping the model)."""
        if self._on_optimizer_step is not None and optimizer not in self._announced:
            self._announced[optimizer] = True
            self._on_optimizer_step(optimizer)

    def discovered_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers known to step this model: given ones, or those seen stepping it."""
        if self._explicit_optimizers is not None:
            return list(self._explicit_optimizers)
        return [opt for opt, holds in list(self._holds.items()) if holds]


def _nobody() -> None:
    """A dead weak reference's answer: no optimizer checked yet."""
    return None


def _refuse_entry(grad_enabled: bool, args: Any, module: torch.nn.Module) -> bool:
    """The entry hooks' callbacks until :meth:`StepHooks.install` (nothing is installed before)."""
    return False


def _ignore_exit(module: torch.nn.Module, args: Any, output: Any) -> None:
    return None


class PhaseBlock:
    """A ``with`` block that marks one phase on a :class:`~.phases.PhaseMachine` (see
    ``MemoryProfiler.phase``). Faults are contained by ``guard`` (part ``"phases"``);
    exceptions of the block itself propagate, and the phase still ends.

    Example::

        >>> import torch
        >>> from pytorch_mem_profiler.measure.devices import CpuCounter
        >>> from pytorch_mem_profiler.measure.phases import PhaseMachine
        >>> from pytorch_mem_profiler.measure.plan import IterationPlan
        >>> model = torch.nn.Linear(4, 4)
        >>> counter = CpuCounter(); counter.start()
        >>> hooks = StepHooks(model, list(model.named_parameters()))
        >>> machine = PhaseMachine(counter.mark, hooks.new_pending, backward_running)
        >>> machine.begin_iteration(IterationPlan.make("phases"))
        >>> hooks.install(machine)
        >>> with PhaseBlock(machine, "forward"):
        ...     y = model(torch.randn(2, 4))          # the automatic hooks do not count it twice
        >>> with PhaseBlock(machine, "backward"):
        ...     y.sum().backward()
        >>> machine.finish_iteration(hooks.model_running)[1:3]
        ((1, 1, 0), {'forward': 1, 'backward': 1})
        >>> hooks.release(); machine.release(); counter.stop()
    """

    __slots__ = ("machine", "phase", "guard", "_token")

    def __init__(self, machine: PhaseMachine | None, phase: str, guard: FaultGuard | None = None) -> None:
        check_phase_name(phase)
        self.machine = machine
        self.phase = phase
        self.guard = guard or FaultGuard()
        self._token: str | None = None

    def __enter__(self) -> PhaseBlock:
        if self.machine is not None:
            self._token = self.guard.call("phases", self.machine.begin, self.phase)
        return self

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None and self.machine is not None:
            self.guard.call("phases", self.machine.end, token)
