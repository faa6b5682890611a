"""Hooks that find the phases of a training iteration without a call from the user.

- forward: a pre-hook and a hook on the model (the root module);
- backward: a pre-hook on the autograd node of each model output marks when the
  gradient reaches the model, and a callback queued on the autograd engine marks
  when the whole backward pass has finished;
- optimizer step: step pre/post hooks, on the given optimizers or, when none was
  given, torch's global optimizer hooks filtered to optimizers that step this
  model's parameters.

At every boundary the device counter is read and a new peak interval started,
so the peak of each phase is exact. Everything the hooks measure lands in a
:class:`StepMeasurements`, which the profiler turns into a record.

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

from .accounting import allocation_bytes, gradient_bytes, optimizer_holds_any, same_device
from .devices import MemoryCounter, Reading
from ..faults import FaultGuard
from .layers import LayerAttribution, LayerBreakdown
from .trees import output_grad_nodes

__all__ = ["StepMeasurements", "TrainingStepHooks"]


@dataclass
class StepMeasurements:
    """What the hooks measured during one iteration (mutable while it runs), in bytes."""

    forward_passes: int = 0
    backward_passes: int = 0
    optimizer_steps: int = 0
    feature_maps: int = 0
    intermediate_gradients: int | None = None
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


def _queues_own_callbacks(model: torch.nn.Module) -> bool:
    """DDP and FSDP wrappers queue autograd-engine callbacks of their own during backward."""
    names = {type(m).__name__ for m in model.modules()} if hasattr(model, "modules") else set()
    return bool(names & {"DistributedDataParallel", "FullyShardedDataParallel"}) or any(
        type(m).__name__.startswith("FSDP") for m in model.modules()
    )


class _BackwardPass:
    """One forward's pending backward: fires once, when the gradient first reaches an output."""

    __slots__ = ("hooks", "started")

    def __init__(self, hooks: TrainingStepHooks) -> None:
        self.hooks = weakref.ref(hooks)
        self.started = False

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        hooks = self.hooks()
        if hooks is None or self.started:
            return None
        self.started = True
        hooks._backward_started(grad_outputs)
        return None


class TrainingStepHooks:
    """Installs the phase hooks on a model and accumulates one iteration's measurements.

    Args:
        model: the root module; its forward marks the forward phase.
        counter: the device counter to read at each boundary.
        params: ``(name, parameter)`` pairs whose gradients are measured.
        optimizers: optimizers to hook; ``None`` hooks every optimizer that
            steps one of ``params``.
        guard: contains faults (see :class:`~pytorch_mem_profiler.faults.FaultGuard`).
        on_optimizer_step: called with the optimizer after each of its steps.
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
        self.counter = counter
        self.params = list(params)
        self.device = counter.device
        self.guard = guard or FaultGuard()
        self._explicit_optimizers = None if optimizers is None else list(optimizers)
        self._on_optimizer_step = on_optimizer_step
        self._on_forward_first_call = on_forward_first_call
        self._param_ids = {id(p) for _, p in self.params}
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list = []
        self._phase = "other"
        self._forward_depth = 0
        self._forward_start: Reading | None = None
        self._pending: _BackwardPass | None = None
        self._backward_base: tuple[int, int] | None = None
        self._optimizer_depth = 0
        self._location: str | None = None
        self._attributing = False
        #: per-layer attribution, used on iterations marked ``detailed``
        self.attribution: LayerAttribution | None = None
        #: whether the running iteration is one that will be reported
        self.detailed = False
        #: read backward's end only after callbacks queued later during backward
        #: (DDP and FSDP finish their gradient reduction in one)
        self.defer_backward_end = _queues_own_callbacks(model)
        self.current = StepMeasurements()
        self.max_reserved: int | None = None
        self.max_allocated: int | None = None

    # -- installation ------------------------------------------------------
    def install(self) -> None:
        """Register every hook; :meth:`remove` takes them all away."""
        g = self.guard.wrap
        self._handles.append(
            self.model.register_forward_pre_hook(g("forward hooks", self._forward_pre))
        )
        self._handles.append(
            # always_call: a forward that raises still closes its phase.
            self.model.register_forward_hook(
                g("forward hooks", self._forward_post), always_call=True
            )
        )
        pre = g("optimizer hooks", self._optimizer_pre)
        post = g("optimizer hooks", self._optimizer_post)
        if self._explicit_optimizers is None:
            self._handles.append(register_optimizer_step_pre_hook(pre))
            self._handles.append(register_optimizer_step_post_hook(post))
        else:
            for opt in self._explicit_optimizers:
                self._handles.append(opt.register_step_pre_hook(pre))
                self._handles.append(opt.register_step_post_hook(post))
        # The counters' starting point: peaks are measured from here on.
        first = self.counter.mark()
        self.max_reserved = first.reserved
        self.max_allocated = first.allocated

    def release(self) -> None:
        """Remove the hooks and drop the callbacks, which refer back to their owner:
        a closed profiler is then freed at once, not at the next cycle collection."""
        self.remove()
        self._on_optimizer_step = None
        self._on_forward_first_call = None
        self.attribution = None
        self.current = StepMeasurements()

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending = None
        if self.attribution is not None:
            self.attribution.close()
        self._attributing = False

    @property
    def phase(self) -> str:
        """The phase running now: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``."""
        return self._phase

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
        self._holds = weakref.WeakKeyDictionary()

    # -- boundaries --------------------------------------------------------
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
            m.phase_count[ended] = m.phase_count.get(ended, 0) + 1
        self._phase = next_phase
        self._location = location
        return reading

    def forward_location(self, ended_in: str, now_in: str) -> None:
        """A tracked module's forward ended: what ran since the last mark is put down to
        ``ended_in``; the code runs in ``now_in`` from here."""
        if self._phase == "forward":
            self._location = ended_in
            self._mark("forward", now_in)

    def backward_location(self, name: str) -> None:
        """Backward reached the outputs of the tracked module ``name``."""
        if self._phase == "backward":
            self._mark("backward", name)

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._forward_depth += 1
        # Nested calls, no-grad forwards (evaluation) and recomputation inside
        # backward leave nothing for a later backward: they are not a forward phase.
        if self._forward_depth > 1 or not torch.is_grad_enabled() or self._phase == "backward":
            return None
        if self._on_forward_first_call is not None:
            callback, self._on_forward_first_call = self._on_forward_first_call, None
            callback()
        self._forward_start = self._mark("forward", "" if self.detailed else None)
        if self.detailed and self.attribution is not None and "per-layer attribution" not in self.guard.disabled:
            try:
                self.attribution.start(args)
                self._attributing = True
            except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
                self.attribution.close()
                self.guard.fault("per-layer attribution", exc)
        return None

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return None
        start, self._forward_start = self._forward_start, None
        breakdown = None
        if self._attributing:
            self._attributing = False
            assert self.attribution is not None
            breakdown = self.guard.call("per-layer attribution", self.attribution.stop)
        if start is None:
            return None
        end = self._mark("other")
        m = self.current
        m.forward_passes += 1
        kept = end.allocated - start.allocated
        if kept > m.feature_maps or m.forward_passes == 1:
            m.feature_maps = max(kept, m.feature_maps)
            if breakdown is not None:
                m.layers, m.layers_kept = breakdown, kept
        nodes = output_grad_nodes(output)
        if nodes:
            pending = _BackwardPass(self)
            for node in nodes:
                node.register_prehook(pending)
            self._pending = pending
        return None

    def _backward_started(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        try:
            start = self._mark("backward", "" if self.detailed else None)
            # The gradients of the outputs are already allocated when the
            # gradient reaches the model: they belong to backward's transient memory.
            out_grads = sum(
                allocation_bytes(g)
                for g in grad_outputs
                if isinstance(g, torch.Tensor) and same_device(g, self.device)
            )
            self._backward_base = (start.allocated - out_grads, sum(gradient_bytes(self.params)))
            # Queued now, this callback runs when the whole backward pass is
            # done. Under DDP/FSDP it queues itself once more so that it runs
            # after the callbacks they queue later, in which they finish reducing.
            engine = torch.autograd.Variable._execution_engine
            end = self._backward_finishing if self.defer_backward_end else self._backward_finished
            engine.queue_callback(self.guard.wrap("backward hooks", end))
        except Exception as exc:  # noqa: BLE001 - raised inside autograd: contain it here
            self.guard.fault("backward hooks", exc)

    def _backward_finishing(self) -> None:
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(self.guard.wrap("backward hooks", self._backward_finished))

    def _backward_finished(self) -> None:
        base = self._backward_base
        self._backward_base = None
        end = self._mark("other")
        m = self.current
        m.backward_passes += 1
        sizes = gradient_bytes(self.params)
        m.gradient_sizes = sizes
        if base is None or end.peak_allocated is None:
            return
        allocated_before, grads_before = base
        created = max(0, sum(sizes) - grads_before)
        transient = max(0, end.peak_allocated - allocated_before - created)
        if m.intermediate_gradients is None or transient > m.intermediate_gradients:
            m.intermediate_gradients = transient

    def _steps_model(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._explicit_optimizers is not None:
            return True
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = optimizer_holds_any(optimizer, self._param_ids)
            self._holds[optimizer] = holds
        return holds

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._steps_model(optimizer):
            return None
        self._optimizer_depth += 1
        if self._optimizer_depth == 1:
            self._mark("optimizer")
        return None

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._steps_model(optimizer):
            return None
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        if self._optimizer_depth == 0:
            self._mark("other")
            self.current.optimizer_steps += 1
        if self._on_optimizer_step is not None:
            self._on_optimizer_step(optimizer)
        return None

    def discovered_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers known to step this model: given ones, or those seen stepping it."""
        if self._explicit_optimizers is not None:
            return list(self._explicit_optimizers)
        return [opt for opt, holds in list(self._holds.items()) if holds]

    # -- iteration ---------------------------------------------------------
    def finish_iteration(self) -> StepMeasurements:
        """Close the iteration: read the counters once more and hand back its measurements."""
        self.current.final = self._mark(self._phase)
        done, self.current = self.current, StepMeasurements()
        return done
