"""The meter: owns everything measured about one training iteration, and makes its record.

A :class:`Meter` knows the profiled device and its counter, the model's
parameters, weights and buffers, the optimizers' state, the phase hooks and the
per-layer attribution. The profiler calls :meth:`Meter.start` once,
:meth:`Meter.prepare` before each iteration (is it one that will be reported?),
:meth:`Meter.finish` at each ``record_stats()`` (which hands back the frozen
:class:`~pytorch_mem_profiler.stats.IterationRecord`), :meth:`Meter.refresh` at
each epoch end and :meth:`Meter.close` at the end. Nobody else writes its state.

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

import logging
import time
import weakref
from types import MappingProxyType
from typing import Any, Iterable, NamedTuple

import torch

from ..faults import FaultGuard
from ..stats import DETAIL_LEVELS, PHASES, IterationRecord, LayerFeatureMaps, PhaseStats
from ..torch_versions import COMPILE_YIELDS_TO_DISPATCH_MODES
from .accounting import (
    buffer_bytes,
    gradient_bytes,
    optimizer_holds_any,
    optimizer_state_bytes,
    optimizer_state_tensors,
    unique_parameters,
    weight_bytes,
)
from .data_parallel import FSDP_PART, FsdpGatherTracker, ddp_gradient_bucket_bytes
from .devices import MemoryCounter, Reading, device_capacity, make_counter, rank_device, resolve_device
from .hooks import PhaseBlock, StepMeasurements, TrainingStepHooks
from .layers import ATTRIBUTION_PART, LayerAttribution, LayerBreakdown, is_compiled
from .saved_tensors import can_chain
from .outside import DeviceMemoryReader
from .peak_breakdown import BREAKDOWN_PART, PeakBreakdown, PeakResult, make_peak_breakdown

__all__ = ["Meter", "Position"]

_log = logging.getLogger("pytorch_mem_profiler")

#: The part of the meter that takes the hooks off between reported iterations.
_LIGHT = "hooks off between reports"
#: the pass and step counts of an iteration the hooks slept through: unknown
_UNCOUNTED: tuple[None, None, None] = (None, None, None)


class Position(NamedTuple):
    """Where an iteration sits in the run: epoch and iteration from 1, step counted over epochs."""

    epoch: int
    iteration: int
    step: int


class _ModelFigures(NamedTuple):
    """What every record carries unchanged while the model does not change."""

    device: str
    weights: int
    weights_by_name: Any
    buffers: int
    ddp_gradient_buckets: int | None
    rank: int | None
    overhead_budget: float | None
    model_name: str


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
        self.model = model
        self.overhead = overhead
        #: the level of detail the running iteration is measured at (:meth:`prepare`)
        self.level = "light"
        self.guard = guard or FaultGuard()
        self.rank_info = rank_info
        self.by_layer = by_layer
        self._device_explicit = device is not None
        self.device = device if device is not None else self._model_device()
        self.counter: MemoryCounter = make_counter(self.device)
        #: bytes of memory the device has in all (``None``: unknown, or the CPU)
        self.capacity = device_capacity(self.device)
        self._optimizers = None if optimizers is None else list(optimizers)
        _check_optimizers_step(self._optimizers, model)
        self._fsdp: FsdpGatherTracker | None = None
        self._ddp_buckets: int | None = None
        self._refresh_model_state()
        self._outside = DeviceMemoryReader(self.device)
        # Every optimizer known to step the model: given, or seen stepping it. Kept
        # across epochs, held weakly, each as [weak reference, len(state) when its state
        # was last counted (-1: never), bytes then]. A plain list: read at every
        # record_stats(), where a WeakKeyDictionary's iteration guard costs microseconds.
        self._known_optimizers: list[list[Any]] = []
        for opt in self._optimizers or ():
            self._know_optimizer(opt)
        self._hooks: TrainingStepHooks | None = None
        self._peak: PeakBreakdown | None = None
        # allocated at the last read (the end of the last iteration): a reported one starts there
        self._last_allocated: int | None = None
        self._last_time = time.perf_counter()
        #: whether the iteration :meth:`finish` closed last was watched and had nothing in it:
        #: the model never entered, no backward, no optimizer step
        self.idle = False

    # -- what the model holds ------------------------------------------------
    @property
    def parameter_names(self) -> list[str]:
        """The names of the parameters measured, each piece of memory once."""
        return [name for name, _ in self._params]

    @property
    def phase(self) -> str | None:
        """The phase running now (``"forward"``, ``"backward"``, ``"optimizer"``, ``"other"``)."""
        return self._hooks.phase if self._hooks is not None else None

    def phase_block(self, phase: str) -> PhaseBlock:
        """A ``with`` block in which ``phase`` runs, as a framework that knows it says
        (``ValueError`` for a phase that is not forward, backward or optimizer)."""
        return PhaseBlock(self._hooks, phase, self.guard)

    @property
    def current(self) -> StepMeasurements | None:
        """What the running iteration has measured so far."""
        return self._hooks.current if self._hooks is not None else None

    def _model_device(self) -> torch.device:
        if self.rank_info is not None:
            return rank_device(self.model, self.rank_info)
        return resolve_device(self.model)

    def _refresh_model_state(self) -> None:
        """Parameter list, weights and buffers: sizes that change only if the model does."""
        self._params = unique_parameters(self.model, self.device)
        weights = weight_bytes(self._params)
        self._weights_by_name = MappingProxyType(dict(weights))
        self._weights_total = sum(n for _, n in weights)
        self._buffers_total = sum(n for _, n in buffer_bytes(self.model, self.device))
        self._requires_grad = [p.requires_grad for _, p in self._params]
        self._last_gradient_sizes: list[int] | None = None
        self._gradients_by_name: Any = MappingProxyType({})
        if self.rank_info is not None:
            self._ddp_buckets = ddp_gradient_bucket_bytes(self.model, self.device)
            if self._fsdp is not None:
                self._fsdp.refresh()
        # the figures every record shares until the model changes (:meth:`_shared`)
        self._shared_figures: _ModelFigures | None = None
        # the model's modules, each once (for its buffers: :meth:`_buffers`)
        self._modules: list[torch.nn.Module] | None = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Start counting and install the hooks."""
        counter = self.counter
        counter.start()
        # Tensors made before the counter started are invisible to the CPU counter: adopt them.
        counter.adopt(p for _, p in self._params)
        counter.adopt(b for b in self.model.buffers())
        counter.adopt(p.grad for _, p in self._params if p.grad is not None)
        # A profiler made mid-training: the given optimizers' state exists already.
        counter.adopt(optimizer_state_tensors(self._optimizers or ()))
        wrap = self.guard.wrap
        self._hooks = TrainingStepHooks(
            self.model,
            counter,
            self._params,
            self._optimizers,
            self.guard,
            on_optimizer_step=wrap("optimizer state", self._optimizer_stepped),
            on_forward_first_call=wrap("device check", self._check_device_once),
        )
        if self.device.type == "cpu" and not COMPILE_YIELDS_TO_DISPATCH_MODES and is_compiled(self.model):
            _log.warning(
                "pytorch_mem_profiler: torch %s runs a compiled model's code past the CPU counter "
                "(inductor allocates outside the dispatcher): the tensors it makes are missing from the "
                "figures; profile the model uncompiled, on a GPU, or with a newer torch (2.13 runs "
                "compiled code eagerly while the counter counts)",
                torch.__version__,
            )
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
                hooks = self._hooks
                hooks.attribution = LayerAttribution(
                    self.model,
                    self.device,
                    # No guard wrapper: the attribution calls these inside its own try, for the same part.
                    on_exit=hooks.forward_location,
                    on_backward_enter=hooks.backward_location,
                    guard=self.guard,
                )
        self._hooks.install()
        self._peak = self._make_peak_breakdown()
        if self.rank_info is not None:
            self._fsdp = FsdpGatherTracker.attach(self.model, wrap)
        self._last_time = time.perf_counter()

    def _make_peak_breakdown(self) -> PeakBreakdown | None:
        tracker = make_peak_breakdown(self.counter)
        if tracker is not None:
            guard = self.guard
            tracker.on_fault = lambda exc: guard.fault(BREAKDOWN_PART, exc)
        hooks = self._hooks
        if tracker is not None and hooks is not None and hooks.attribution is not None:
            tracker.module_name = hooks.attribution.current_module
        return tracker

    def prepare(self, level: str | bool) -> None:
        """The level of detail the coming iteration is measured at (:data:`~..stats.DETAIL_LEVELS`;
        ``True``: the richest this meter has, ``False``: ``"light"``).

        ``"light"`` costs one read and one peak reset, at :meth:`finish`. ``"phases"``
        reads the counters at the phase boundaries, measures gradients and watches what
        is alive at its peak (its make-up, and the intermediate gradients); ``"full"``
        (per-layer mode) runs the per-layer hooks as well.
        """
        if level is True or level is False:
            level = ("full" if self.by_layer else "phases") if level else "light"
        if level not in DETAIL_LEVELS:
            raise ValueError(f"level must be one of {DETAIL_LEVELS}, got {level!r}")
        self.level = level
        detailed = level != "light"
        hooks = self._hooks
        if hooks is not None:
            if self.guard.disabled:
                self._drop_switched_off(hooks)
            hooks.reported = detailed
            hooks.detailed = hooks.attribution is not None and level == "full"
            if self._fsdp is not None:
                self._fsdp.active = detailed
            hooks.breakdown = None
            self._watch(hooks, detailed)
            tracker = self._peak
            # The breakdown watches every saved tensor from Python and looks for gradients at
            # backward's boundaries: what a host-bound step at print_period=1 pays for (GPT-2:
            # 1.25x), and what the cost budget weighs against the step.
            if detailed and tracker is not None:
                # Inline rather than through guard.call: this runs at the end of the
                # iteration before a reported one, which stays on the light path.
                try:
                    params = [p for _, p in self._params]
                    tracker.begin(params, self._buffers(), self._optimizer_list(), self._last_allocated)
                except Exception as exc:  # noqa: BLE001 - the breakdown switches off, the rest goes on
                    self.guard.fault(BREAKDOWN_PART, exc)
                else:
                    hooks.breakdown = tracker

    def _drop_switched_off(self, hooks: TrainingStepHooks) -> None:
        """Parts a fault switched off stop running, not only reporting: their hooks and what they
        hold go here, between iterations, not at close() (inside backward a pop of autograd's
        saved-tensor stack would act on the engine's copy of it and be lost)."""
        disabled = self.guard.disabled
        self.guard.call("phase hooks", hooks.drop_switched_off)
        if hooks.attribution is not None and ATTRIBUTION_PART in disabled:
            self._drop_attribution(hooks)
        tracker = self._peak
        if tracker is not None and BREAKDOWN_PART in disabled:
            # what it holds: tracked storages, the static walk
            self._peak = None
            self.guard.clean_up(BREAKDOWN_PART, tracker.close)
        fsdp = self._fsdp
        if fsdp is not None and FSDP_PART in disabled:
            # its pre-hook on every unit would go on being called (and return at once)
            self._fsdp = None
            self.guard.clean_up(FSDP_PART, fsdp.remove)

    def _drop_attribution(self, hooks: TrainingStepHooks) -> None:
        """A fault switched the per-layer attribution off: what a forward left of it installed
        (its hooks on every module, its saved-tensor pair) goes now, between iterations, and
        nothing asks it for module names again (no locations: ``None``, unknown)."""
        attribution, hooks.attribution = hooks.attribution, None
        assert attribution is not None  # called only while there is one
        if self._peak is not None:
            self._peak.module_name = None
        self.guard.clean_up(ATTRIBUTION_PART, attribution.close)

    def _buffers(self) -> list[torch.Tensor]:
        # The model's modules are listed at each refresh; their buffers are read now (a buffer
        # reassigned since is found): ``model.buffers()`` walks the module tree with a generator
        # per module, most of a reported per-layer iteration's bookkeeping on a 150-module model.
        modules = self._modules
        if modules is None:
            modules = self._modules = list(self.model.modules())
        return [b for m in modules for b in m._buffers.values() if b is not None]

    def _optimizer_list(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (entry[0]() for entry in self._known_optimizers) if opt is not None]

    def refresh(self) -> None:
        """Learn the model again (at each epoch end): parameters, weights, buffers, optimizer state."""
        self._refresh_model_state()
        if self._hooks is not None:
            self._hooks.set_params(self._params)
            if self._hooks.attribution is not None:
                self._hooks.attribution.refresh()
        self._known_optimizers = [entry for entry in self._known_optimizers if entry[0]() is not None]
        self._optimizer_state(recount=True)

    def close(self) -> None:
        """Remove every hook and stop counting (each in its own try: see ``FaultGuard.clean_up``)."""
        hooks, fsdp, peak = self._hooks, self._fsdp, self._peak
        self._peak = None
        steps = []
        if peak is not None:
            steps.append(peak.close)
        if hooks is not None:
            hooks.breakdown = None
            steps.append(hooks.release)
        if fsdp is not None:
            steps.append(fsdp.remove)
        steps.append(self.counter.stop)
        self.guard.clean_up("close", *steps)

    # -- callbacks from the hooks ----------------------------------------------
    def _check_device_once(self) -> None:
        now = self._model_device()
        if self._device_explicit or now == self.device:
            return
        _log.warning(
            "pytorch_mem_profiler: the model moved from %s to %s after the profiler was made; "
            "profiling %s from now on (make the profiler after model.to(device))",
            self.device,
            now,
            now,
        )
        self.counter.stop()
        self.device = now
        self.counter = make_counter(now)
        self.capacity = device_capacity(now)
        self.counter.start()
        self._outside = DeviceMemoryReader(now)
        self._refresh_model_state()
        assert self._hooks is not None
        self._hooks.retarget(self.counter, self._params)
        # This iteration's breakdown followed the old device: none for it.
        self._hooks.breakdown = None
        if self._peak is not None:
            self._peak.close()
        self._peak = self._make_peak_breakdown()

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
    def _watch(self, hooks: TrainingStepHooks, detailed: bool) -> None:
        """Hooks on for an iteration that will be reported, off for the others.

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
        are included. An iteration that was not prepared as reported
        (:meth:`prepare`) gets the light record of :meth:`_light_record`.
        """
        hooks = self._hooks
        assert hooks is not None, "Meter.start() was not called"
        measured = hooks.reported
        # Slept through (the common case at print_period > 1): one read, nothing else.
        final = None if measured else hooks.finish_asleep()
        m = None
        if final is None:
            m = hooks.finish_iteration()
            final = m.final
            assert final is not None
        self.idle = m is not None and m.counted and m.model_calls == 0 and m.counts == (0, 0, 0)
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        self._last_allocated = final.allocated
        if m is None:
            return self._light_record(position, final, final.peak_allocated, _UNCOUNTED, elapsed, reported)
        if not measured:
            return self._light_record(position, final, m.iteration_peak, m.counts, elapsed, reported)
        peak = self._peak_result(m.iteration_peak)
        sizes = m.gradient_sizes
        if sizes is None or len(sizes) != len(self._params):
            # No backward reached the model this iteration: take the gradients as they are.
            sizes = gradient_bytes(self._params)
        if sizes != self._last_gradient_sizes:
            self._last_gradient_sizes = sizes
            self._gradients_by_name = MappingProxyType(
                {
                    name: n
                    for (name, _), n, trainable in zip(self._params, sizes, self._requires_grad)
                    if trainable or n
                }
            )
        phases = MappingProxyType(
            {
                phase: PhaseStats(
                    m.phase_end_allocated.get(phase), m.phase_peak.get(phase), m.phase_count[phase]
                )
                for phase in PHASES
                if phase in m.phase_count
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
            step_temporaries = peak.step_temporaries if m.peak_phase == "optimizer" else 0
            if peak.peak_layers is not None and located and self.level == "full":
                peak_layers = MappingProxyType(peak.peak_layers)
            if peak.transient_in is not None:
                transient = peak.transient
            transient_in = peak.transient_in if located or peak.transient_in in PHASES else None
        shared = self._shared()
        epoch, iteration, step = position
        forward_passes, backward_passes, optimizer_steps = m.counts
        return IterationRecord(
            epoch=epoch,
            iteration=iteration,
            step=step,
            device=shared.device,
            allocated=final.allocated,
            peak_allocated=hooks.max_allocated if has_peak else None,
            iteration_peak_allocated=m.iteration_peak,
            peak_phase=m.peak_phase,
            peak_cached=hooks.max_reserved if has_peak else None,
            current_cached=final.reserved,
            feature_maps=m.feature_maps,
            intermediate_gradients=peak.backward_activation_gradients if peak is not None else None,
            weights=shared.weights,
            weights_by_name=shared.weights_by_name,
            gradients=sum(sizes),
            gradients_by_name=self._gradients_by_name,
            optimizer_state=self._optimizer_state(),
            buffers=shared.buffers,
            forward_passes=forward_passes,
            backward_passes=backward_passes,
            optimizer_steps=optimizer_steps,
            iteration_time_s=elapsed,
            phases=phases,
            peak_location=m.peak_location if located else None,
            layers=_feature_maps_by_layer(m.layers, m.layers_kept) if reported else None,
            device_used=usage.device_used if usage is not None else None,
            process_used=usage.process_used if usage is not None else None,
            outside_pytorch=outside,
            device_total=self.capacity,
            peak_breakdown=breakdown,
            peak_layers=peak_layers,
            peak_transient=transient,
            peak_transient_in=transient_in,
            ddp_gradient_buckets=shared.ddp_gradient_buckets,
            fsdp_gathered_parameters=self._fsdp.finish_iteration() if self._fsdp is not None else None,
            rank=shared.rank,
            reported=True,
            detail=self.level,
            overhead_budget=shared.overhead_budget,
            peak_other_before=other_before,
            peak_step_temporaries=step_temporaries,
            model_name=shared.model_name,
        )

    def _shared(self) -> _ModelFigures:
        """The figures every record shares until the model changes (:meth:`_refresh_model_state`)."""
        shared = self._shared_figures
        if shared is None:
            shared = self._shared_figures = _ModelFigures(
                device=str(self.device),
                weights=self._weights_total,
                weights_by_name=self._weights_by_name,
                buffers=self._buffers_total,
                ddp_gradient_buckets=self._ddp_buckets,
                rank=self.rank_info.rank if self.rank_info is not None else None,
                overhead_budget=self.overhead,
                model_name=type(self.model).__name__,
            )
        return shared

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
        hooks = self._hooks
        assert hooks is not None
        shared = self._shared()
        epoch, iteration, step = position
        has_peak = self.counter.has_peak
        # None each where the hooks slept through it: unknown, not 0
        forward_passes, backward_passes, optimizer_steps = counts
        return IterationRecord(
            epoch=epoch,
            iteration=iteration,
            step=step,
            device=shared.device,
            allocated=final.allocated,
            peak_allocated=hooks.max_allocated if has_peak else None,
            iteration_peak_allocated=iteration_peak,
            peak_cached=hooks.max_reserved if has_peak else None,
            current_cached=final.reserved,
            feature_maps=None,
            intermediate_gradients=None,
            weights=shared.weights,
            weights_by_name=shared.weights_by_name,
            gradients=None,
            optimizer_state=self._optimizer_state(),
            buffers=shared.buffers,
            forward_passes=forward_passes,
            backward_passes=backward_passes,
            optimizer_steps=optimizer_steps,
            iteration_time_s=elapsed,
            device_total=self.capacity,
            ddp_gradient_buckets=shared.ddp_gradient_buckets,
            fsdp_gathered_parameters=self._fsdp.finish_iteration() if self._fsdp is not None else None,
            rank=shared.rank,
            reported=reported,  # reported at "light": the budget afforded no more
            detail="light",
            overhead_budget=shared.overhead_budget,
            model_name=shared.model_name,
        )

    def _peak_result(self, iteration_peak: int | None) -> PeakResult | None:
        """What the iteration's peak held, where the breakdown watched it (reported iterations)."""
        hooks = self._hooks
        assert hooks is not None
        tracker, hooks.breakdown = hooks.breakdown, None
        if tracker is None:
            return None
        params = [p for _, p in self._params]
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


def _feature_maps_by_layer(breakdown: LayerBreakdown | None, kept: int) -> LayerFeatureMaps | None:
    if breakdown is None:
        return None
    total = breakdown.total
    return LayerFeatureMaps(
        by_module=MappingProxyType(dict(breakdown.by_module)),
        calls=MappingProxyType(dict(breakdown.calls)),
        total=total,
        inputs=breakdown.inputs,
        unattributed=kept - total,
    )
