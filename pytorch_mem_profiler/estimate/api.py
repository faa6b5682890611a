"""``estimate_memory``: a training step's memory on a device, before running it, and what-ifs.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate import estimate_memory
    >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    >>> est = estimate_memory(model, torch.zeros(64, 512), device="cpu")
    >>> est.weights == (512 * 512 + 512 + 512 * 10 + 10) * 4, est.optimizer_state >= 2 * est.weights
    (True, True)
    >>> est.max_batch_size(est.required + 1000 * int(est.fit.per_sample), margin=0) >= 64 + 1000
    True
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..measure.devices import parse_device, usable_device
from .allocator import (
    CUDA_CONTEXT_ALLOWANCE,
    StepEvents,
    cublas_workspace_bytes,
    cublas_workspaces,
    replay_whole_blocks,
    simulate_reserved,
    with_headroom,
    workspaces_at_first_use,
)
from .fake import batch_of
from .result import CHOSEN_BY_FUNCTION, REPEATED_BLOCKS, BatchFit, MemoryEstimate, search_bound_of
from .step import EstimateUnsupported, StepMemory, StepPlan, run_step

__all__ = ["estimate_memory", "EstimateUnsupported", "OPTIMIZATIONS", "parse_autocast"]

#: The seed exercise's what-ifs, for ``compare=``: gradient checkpointing of the
#: model's repeated blocks, bf16 autocast, both.
OPTIMIZATIONS: Mapping[str, Mapping[str, Any]] = {
    "gradient checkpointing": {"checkpointing": True},
    "bf16 autocast": {"autocast": torch.bfloat16},
    "checkpointing + bf16 autocast": {"checkpointing": True, "autocast": torch.bfloat16},
}

_AUTOCAST_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}

#: How the report names each autocast dtype.
_AUTOCAST_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}

_OVERRIDABLE = (
    "model",
    "example_inputs",
    "optimizer",
    "loss_fn",
    "targets",
    "autocast",
    "checkpointing",
    "batch_size",
    "parallel",
    "world_size",
    "rank",
    "accumulation_steps",
    "max_grad_norm",
    "set_to_none",
    "grad_scaler",
    "random_draws",
)


def parse_autocast(value: Any) -> torch.dtype | None:
    """``autocast=`` as a dtype: ``None``/``False`` (off), ``True`` (bfloat16), a dtype, or its name.

    Example::

        >>> parse_autocast("bf16"), parse_autocast(None)
        (torch.bfloat16, None)
    """
    if value is None or value is False:
        return None
    if value is True:
        return torch.bfloat16
    if isinstance(value, torch.dtype) and value in (torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.lower() in _AUTOCAST_NAMES:
        return _AUTOCAST_NAMES[value.lower()]
    raise ValueError(f"autocast must be None, True, torch.bfloat16, torch.float16 or 'bf16'/'fp16'; got {value!r}")


def _run_device(device: torch.device, emulate: bool | None) -> torch.device:
    """Where the fake step runs: on the device when its runtime is here, else on the CPU."""
    if device.type == "cpu":
        return device
    if emulate is False:
        try:
            usable_device(device)
        except ValueError as err:
            # fake tensors of a device whose runtime is missing fail inside autograd's backward
            raise ValueError(
                f"emulate=False runs the fake step with {device.type}'s own runtime, which is not usable here "
                f"({err}); leave emulate=None (or True) to emulate {device.type} on the CPU"
            ) from None
        return device
    if emulate:
        return torch.device("cpu")
    try:
        return usable_device(device)
    except ValueError:
        return torch.device("cpu")


def estimate_memory(
    model: nn.Module | Callable[[], nn.Module],
    example_inputs: Any,
    *,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Any = None,
    autocast: Any = None,
    device: torch.device | str = "cuda",
    batch_size: int | None = None,
    checkpointing: bool | Callable[[str, nn.Module], bool] = False,
    outside: int | None = None,
    workspace: int | None = None,
    fit: bool = True,
    compare: Mapping[str, Mapping[str, Any]] | None = None,
    emulate: bool | None = None,
    parallel: Any = None,
    world_size: int | None = None,
    rank: int = 0,
    measure_kernels: bool = False,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    set_to_none: bool = True,
    grad_scaler: bool = False,
    random_draws: str = "largest",
) -> MemoryEstimate:
    """Estimate one training step's memory on ``device`` without allocating it (no GPU needed).

    Runs forward, loss, backward and the optimizer step twice (so that lazy
    optimizer state exists) under ``FakeTensorMode``, counting the live storages
    with the profiler's storage counter; at two more batch sizes (twice and three
    times the batch) to fit each phase's peak as a line in the batch size and check it.

    Args:
        model: an ``nn.Module`` (copied with fake tensors; never changed), or a function
            that builds one: called inside the fake mode, so a model of any size is
            estimated without its memory (build it on the default device).
        example_inputs: the model's positional input (a tensor), a tuple of them, a dict
            of keyword inputs, or a function ``batch_size -> inputs``. The first
            dimension of the first tensor is the batch.
        optimizer: a callable taking the parameters: ``torch.optim.AdamW``,
            ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``.
        loss_fn: ``loss_fn(output, *targets)`` returns the scalar loss; default: the
            sum of the output.
        targets: a tensor or a tuple of them (or a function ``batch_size -> targets``)
            handed to ``loss_fn`` after the output; resized with the batch.
        autocast: ``None`` (off), ``torch.bfloat16``/``torch.float16``, ``True`` (bf16):
            the forward runs under ``torch.autocast`` (the loss outside it).
        device: the device to estimate for (default ``"cuda"``).
        batch_size: the batch size to estimate at; default: the example's. Needed
            when ``example_inputs`` is a function.
        checkpointing: wrap blocks in ``torch.utils.checkpoint`` (non-reentrant):
            ``True`` for the model's repeated blocks, or ``(name, module) -> bool``.
        outside: bytes outside PyTorch to allow for; default on CUDA
            :data:`~pytorch_mem_profiler.estimate.allocator.CUDA_CONTEXT_ALLOWANCE` (1 GiB), else 0.
        workspace: bytes libraries take from the allocator besides tensors; default on
            CUDA a cuBLAS workspace of 32 MiB (``CUBLAS_WORKSPACE_CONFIG`` if set) for each
            thread the step runs a cuBLAS operator in (a matmul, a linear layer): the forward's
            (the loss's, the optimizer's) and autograd's backward thread; none for a step of
            convolutions alone; else 0.
        fit: also estimate at twice and three times the batch, for
            :meth:`MemoryEstimate.max_batch_size`.
        compare: what-ifs, by name: keyword arguments of this function that differ
            (``{"bf16": {"autocast": torch.bfloat16}}``; :data:`OPTIMIZATIONS` is the
            seed exercise's three); each is estimated and kept in ``alternatives``.
        emulate: run on fake CPU tensors standing in for ``device`` (``None``: only
            where the device's runtime is missing here); autocast then follows the device's
            rules (CUDA's dtypes per operator, :mod:`.autocast_policy`), not the CPU's.
        parallel: ``None`` (one device), ``"ddp"``, ``"fsdp2"``, or
            :class:`~.parallel.DDP` / :class:`~.parallel.FSDP2` with their settings: the figures
            are then one rank's of ``world_size``, for a batch of ``batch_size`` *per rank*
            (see :mod:`~pytorch_mem_profiler.estimate.parallel`). No process group or GPU is needed.
        world_size: the number of ranks (needed with ``parallel``).
        rank: the rank estimated (FSDP2's last ranks may hold smaller shards; default 0).
        measure_kernels: where the estimate runs on fake CUDA tensors (the GPU is here), run
            each distinct convolution and cuDNN recurrent layer (``nn.LSTM``, ``nn.GRU``,
            ``nn.RNN``) of the step once on the GPU, in a separate process, and take its
            measured scratch (cuDNN's workspace) instead of the rule and its bound
            (see :mod:`~pytorch_mem_profiler.estimate.kernel_probe`); off CUDA, or emulated, the rule stands.
        accumulation_steps: forwards and backwards before each optimizer step (gradient
            accumulation: ``batch_size`` is then each micro-batch's); from the second on the
            gradients are alive through the whole backward, and each is summed into them.
        max_grad_norm: clip the gradients' norm before each optimizer step
            (``torch.nn.utils.clip_grad_norm_``, as Lightning's ``gradient_clip_val`` and the
            Hugging Face Trainer's ``max_grad_norm`` do); ``None``: no clipping.
        set_to_none: ``optimizer.zero_grad(set_to_none=...)``: with ``False`` the gradients
            stay allocated (zeroed) from one step into the next.
        grad_scaler: fp16 loss scaling with ``torch.amp.GradScaler``, as under ``autocast=torch.float16``
            (Lightning's ``precision="16-mixed"``, the Trainer's ``fp16=True``):
            ``scaler.scale(loss).backward()``, ``scaler.unscale_`` before clipping,
            ``scaler.step(optimizer)``, ``scaler.update()``; the gradients are taken as finite
            (the step that runs the optimizer; see :mod:`~pytorch_mem_profiler.estimate.grad_scaling`).
        random_draws: where the step reads a value drawn at random in Python (LayerDrop's
            ``if torch.rand([]) < p``, a per-step random choice): ``"largest"`` (default) gives uniform
            draws an end of their range, the top and then the bottom, and keeps the larger step (a
            LayerDrop step that skips no layer, which a run meets); ``"seeded"`` takes the estimate's
            own seeded draws as they come (see :mod:`~pytorch_mem_profiler.estimate.draws`).

    Raises:
        EstimateUnsupported: the step uses an operation the fake mode cannot run
            (data-dependent shapes, ``.item()``, operators without a fake kernel); the
            message names it. Also for an ``nn.DataParallel`` over several GPUs (estimate the
            module it wraps at each GPU's share of the batch, or ``parallel="ddp"``).
        ValueError, TypeError: a bad argument, named.
    """
    target = parse_device(device)
    dtype = parse_autocast(autocast)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    calls_inputs = callable(example_inputs) and not isinstance(example_inputs, torch.Tensor)
    if calls_inputs and batch_size is None:
        raise ValueError("batch_size is needed when example_inputs is a function batch_size -> inputs")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a callable taking the parameters, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (isinstance(model, nn.Module) or callable(model)):
        raise TypeError(f"model must be a torch.nn.Module or a function that builds one, got {type(model).__name__}")
    if isinstance(model, nn.DataParallel) and len(model.device_ids) > 1:
        # It copies the module to each GPU at every forward and splits the batch between the copies:
        # one fake step would put every copy on one device.
        gpus = len(model.device_ids)
        raise EstimateUnsupported(
            f"model is an nn.DataParallel over {gpus} GPUs, which copies the module it wraps to each GPU at every "
            f"forward and gives each copy its share of the batch: estimate that module (model.module) at the batch "
            f"each GPU gets; GPU {model.device_ids[0]} holds more than that estimate (the gathered outputs, the loss, "
            f"the gradients summed onto it). Or estimate the DistributedDataParallel run that replaces it "
            f"(parallel='ddp', world_size={gpus}): PyTorch recommends DDP over DataParallel",
            operation="nn.DataParallel",
        )
    if not isinstance(measure_kernels, bool):
        raise TypeError(f"measure_kernels must be True or False, got {measure_kernels!r}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0):
        raise ValueError(f"max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
    if not isinstance(set_to_none, bool):
        raise TypeError(f"set_to_none must be True or False, got {set_to_none!r}")
    if not isinstance(grad_scaler, bool):
        raise TypeError(f"grad_scaler must be True or False, got {grad_scaler!r}")
    if random_draws not in ("largest", "seeded"):
        raise ValueError(f"random_draws must be 'largest' or 'seeded', got {random_draws!r}")
    for name, value in (("outside", outside), ("workspace", workspace)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
    if compare is not None:
        for name, overrides in compare.items():
            unknown = set(overrides) - set(_OVERRIDABLE)
            if unknown:
                raise ValueError(f"compare[{name!r}] has unknown keys {sorted(unknown)}; allowed: {', '.join(_OVERRIDABLE)}")

    from .parallel import RankSetup, parse_parallel

    parallel_plan = parse_parallel(parallel)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if parallel_plan is not None and world_size is None:
        raise ValueError(f"parallel={parallel!r} needs world_size= (the number of ranks)")
    if parallel_plan is None and world_size not in (None, 1):
        raise ValueError(f"world_size={world_size} needs parallel='ddp' or 'fsdp2'")
    if parallel_plan is not None and (accumulation_steps != 1 or max_grad_norm is not None or not set_to_none or grad_scaler):
        raise ValueError(
            "accumulation_steps, max_grad_norm, set_to_none=False and grad_scaler are not estimated across ranks yet: "
            "leave them at their defaults with parallel="
        )
    ranks = world_size or 1
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"rank must be an integer in [0, world_size={ranks}), got {rank!r}")

    given_workspace = workspace  # each what-if of ``compare`` works out its own from the steps it runs
    run_device = _run_device(target, emulate)
    plan = StepPlan(
        model=model,
        example_inputs=example_inputs,
        optimizer=optimizer,
        device=target,
        loss_fn=loss_fn,
        targets=targets,
        autocast=dtype,
        checkpointing=checkpointing,
        run_device=run_device,
        measure_kernels=measure_kernels,
        accumulation_steps=accumulation_steps,
        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        set_to_none=set_to_none,
        grad_scaler=grad_scaler,
        random_draws=random_draws,
    )
    if parallel_plan is not None:
        rank_setup = RankSetup(parallel_plan, ranks, rank, run_device, target)
        plan.setup, plan.context = rank_setup, rank_setup.context
    batch = batch_size if batch_size is not None else batch_of(example_inputs) if not calls_inputs else None
    step = run_step(plan, batch)
    batch_fit = _fit(plan, step, batch) if fit and batch is not None else None
    on_cuda = target.type == "cuda"
    if workspace is None:
        # cuBLAS keeps a workspace per thread and stream, taken at its first call there: the script's
        # thread and autograd's device thread, where the step runs a cuBLAS operator in them
        blocks = [cublas_workspace_bytes()] * cublas_workspaces(step.blas_phases) if on_cuda else []
        workspace = sum(blocks)
    else:  # the bytes given: as two threads' workspaces
        blocks = [workspace // 2, workspace - workspace // 2] if workspace else []
    # The workspaces are blocks of their own, never freed, made before the step's tensors
    # (at the first matmul, or by an earlier step); replayed first, each takes a segment.
    workspace_events = [(-1 - i, n) for i, n in enumerate(blocks)]
    reserved = step_events = None
    reserved_bound = 0
    shown = step  # the step's figures as reported: on CUDA, its peaks counted in the allocator's whole blocks
    if step.reserved is not None:
        at = {step.peak_event, *step.phase_peak_events.values()}
        reserved, whole = replay_whole_blocks(workspace_events, step.events, at)
        shown = _in_whole_blocks(step, whole)
        if step.headroom and reserved is not None:
            # the same replay with each kernel block that may ask more (split-K partial sums) at its bound
            upper = simulate_reserved([*workspace_events, *with_headroom(step.events, step.headroom)])
            reserved_bound = max(0, (upper or reserved) - reserved)
        if step.step_events is not None:
            step_events = _workspaces(workspace_events) + step.step_events
    reserved_at = peak_at = bound_at = None
    if fit and batch is not None:
        steps = _StepsByBatch(plan, {batch: step})
        peak_at = steps.peak_at
        bound_at = steps.search_bound_at
        if reserved is not None:
            reserved_at = functools.partial(steps.reserved_at, tuple(workspace_events))
    est = MemoryEstimate(
        device=str(target),
        batch_size=batch,
        peak=shown.peak,
        peak_phase=shown.peak_phase,
        phases=shown.phase_peaks,
        peak_breakdown=shown.breakdown,
        peak_layers=step.peak_layers,
        layers=step.layers,
        weights=step.weights,
        buffers=step.buffers,
        gradients=step.gradients,
        optimizer_state=step.optimizer_state,
        inputs=step.inputs,
        reserved=reserved,
        reserved_bound=reserved_bound,
        workspace=workspace,
        kernel_scratch=step.kernel_scratch,
        whole_blocks=shown.peak - step.peak,
        outside=outside if outside is not None else (CUDA_CONTEXT_ALLOWANCE if on_cuda else 0),
        fit=batch_fit,
        emulated=run_device.type != target.type,
        reserved_at=reserved_at,
        peak_at=peak_at,
        search_bound_at=bound_at,
        error_bounds=step.error_bounds,
        transient_bounds=step.transient_bounds,
        fallback_bounds=step.fallback_bounds,
        step_events=step_events,
        parallel=parallel_plan.name if parallel_plan is not None else None,
        world_size=ranks,
        rank=rank,
        parallel_parts=step.parallel_parts,
        step_peaks=step.step_peaks,
        autocast=_AUTOCAST_SHORT[dtype] if dtype is not None else None,
        checkpointing=None if not checkpointing else REPEATED_BLOCKS if checkpointing is True else CHOSEN_BY_FUNCTION,
        checkpointed=step.checkpointed,
        optimizer=_optimizer_text(optimizer, step.optimizer_name),
        training_loop=_loop_text(accumulation_steps, max_grad_norm, set_to_none, grad_scaler),
        parameter_dtypes=step.parameter_dtypes,
        random_reads=step.random_reads,
        random_draws=step.draws_at or "seeded",
        step_notes=step.notes,
    )
    if compare:
        base = dict(
            model=model,
            example_inputs=example_inputs,
            optimizer=optimizer,
            loss_fn=loss_fn,
            targets=targets,
            autocast=autocast,
            batch_size=batch_size,
            checkpointing=checkpointing,
            parallel=parallel,
            world_size=world_size,
            rank=rank,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            set_to_none=set_to_none,
            grad_scaler=grad_scaler,
            random_draws=random_draws,
        )
        alternatives = {
            name: estimate_memory(
                **{**base, **overrides},
                device=target,
                outside=outside,
                workspace=given_workspace,
                fit=fit,
                emulate=emulate,
                measure_kernels=measure_kernels,
            )
            for name, overrides in compare.items()
        }
        est = dataclasses.replace(est, alternatives=alternatives)
    return est


def _in_whole_blocks(step: StepMemory, whole: Mapping[int, int]) -> StepMemory:
    """``step``'s peak and phase peaks as ``torch.cuda.max_memory_allocated()`` counts them: the whole
    blocks alive at each (``whole``: bytes of whole blocks after so many events, see
    :func:`~.allocator.replay_whole_blocks`), the remainders beyond the requests counted in the peak's
    ``other``. The peak stays where the requests peak; a phase is shown at most at the peak."""
    peak = whole.get(step.peak_event, 0)
    if peak <= step.peak:
        return step
    phases = {
        phase: min(peak, max(n, whole.get(step.phase_peak_events.get(phase, -1), 0))) for phase, n in step.phase_peaks.items()
    }
    breakdown = {**step.breakdown, "other": step.breakdown.get("other", 0) + peak - step.peak}
    return dataclasses.replace(step, peak=peak, phase_peaks=MappingProxyType(phases), breakdown=MappingProxyType(breakdown))


def _loop_text(accumulation_steps: int, max_grad_norm: float | None, set_to_none: bool, grad_scaler: bool = False) -> str | None:
    """The training loop's settings where they are not the default, for the report.

    Example::

        >>> _loop_text(2, 1.0, False)
        '2 micro-batches a step (gradient accumulation), gradients clipped to norm 1.0, zero_grad(set_to_none=False)'
        >>> _loop_text(1, None, True) is None
        True
        >>> _loop_text(1, None, True, grad_scaler=True)
        'fp16 loss scaling (torch.amp.GradScaler)'
    """
    parts = []
    if grad_scaler:
        parts.append("fp16 loss scaling (torch.amp.GradScaler)")
    if accumulation_steps > 1:
        parts.append(f"{accumulation_steps} micro-batches a step (gradient accumulation)")
    if max_grad_norm is not None:
        parts.append(f"gradients clipped to norm {float(max_grad_norm)!r}")
    if not set_to_none:
        parts.append("zero_grad(set_to_none=False)")
    return ", ".join(parts) or None


def _optimizer_text(optimizer: Callable[..., Any], made: str | None) -> str:
    """The optimizer as the step made it (its class), with the keywords a ``functools.partial`` gave.

    Example::

        >>> _optimizer_text(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), "SGD")
        'SGD(lr=0.1, momentum=0.9)'
    """
    if made is None:
        return "none (nothing to train)"
    keywords = getattr(optimizer, "keywords", None) if isinstance(optimizer, functools.partial) else None
    if keywords:
        return f"{made}({', '.join(f'{k}={v!r}' for k, v in keywords.items())})"
    return made


def _workspaces(workspace_events: list[tuple[int, int]]) -> StepEvents:
    """The libraries' workspaces as the replay's first events, alive before the steps."""
    return StepEvents(tuple(workspace_events), (), {key: "cuBLAS workspace; before the steps; workspace" for key, _ in workspace_events})


class _StepsByBatch:
    """The fake step at each batch size asked, the last few kept: a batch search asks a batch's
    replay and its error bound, one fake step for both."""

    KEPT = 4

    def __init__(self, plan: StepPlan, known: Mapping[int, StepMemory]) -> None:
        self.plan = plan
        self.steps: dict[int, StepMemory] = dict(known)

    def step(self, batch: int) -> StepMemory:
        found = self.steps.pop(batch, None)
        if found is None:
            found = run_step(self.plan, batch)
        self.steps[batch] = found  # the most recent last
        while len(self.steps) > self.KEPT:
            self.steps.pop(next(iter(self.steps)))
        return found

    def reserved_at(
        self, workspace_events: tuple[tuple[int, int], ...], batch: int, limit: int | None = None, process: str = "warmed"
    ) -> int | None:
        """The allocator replay's reserved bytes for the step at ``batch``, workspaces included;
        ``None`` if it runs out of memory under ``limit`` (see :func:`~.allocator.simulate_reserved`).

        ``process`` (:data:`~.allocator.PROCESSES`): cuBLAS's workspaces made before the step
        (``"warmed"``, as :attr:`~.result.MemoryEstimate.reserved` has them), just after each thread's first
        cuBLAS operator's outputs (``"fresh"``,
        :func:`~.allocator.workspaces_at_first_use`), or both replayed (``"either"``: the larger
        reserved, ``None`` if either runs out). Under ``limit`` a cuDNN workspace that does not fit
        is done without, as cuDNN runs another plan (:attr:`~.allocator.StepEvents.fallback`)."""
        step = self.step(batch)
        first_use = step.step_events.blas_first if step.step_events is not None else ()
        fallback = step.step_events.fallback if step.step_events is not None else frozenset()
        placements = []
        if process in ("warmed", "either") or not first_use or not workspace_events:
            placements.append([*workspace_events, *step.events])
        if process in ("fresh", "either") and first_use and workspace_events:
            placements.append(workspaces_at_first_use(workspace_events, step.events, first_use))
        reserved = [simulate_reserved(events, limit=limit, fallback=fallback) for events in placements]
        return None if None in reserved else max(reserved)

    def peak_at(self, batch: int) -> tuple[int, str]:
        """The step's peak (tensors) and the phase holding it at ``batch``: one fake step."""
        step = self.step(batch)
        return step.peak, step.peak_phase

    def search_bound_at(self, batch: int) -> int:
        """The bytes of the step's error bound at ``batch`` that a batch search leaves free: all but
        the bounds of workspaces that give way under a limit (see :attr:`MemoryEstimate.search_bound`)."""
        step = self.step(batch)
        return search_bound_of(step.error_bounds, step.transient_bounds, step.fallback_bounds)


def _fit(plan: StepPlan, first: StepMemory, batch: int) -> BatchFit:
    """Each phase's peak as a line through ``batch`` and ``2 * batch``, checked at ``3 * batch``."""
    second = run_step(plan, 2 * batch)
    third = run_step(plan, 3 * batch)
    phases = {}
    for phase, low in first.phase_peaks.items():
        high = second.phase_peaks.get(phase)
        if high is None:
            continue
        slope = (high - low) / batch
        phases[phase] = (low - slope * batch, slope)
    moments = {batch: first.peak_phase, 2 * batch: second.peak_phase, 3 * batch: third.peak_phase}
    fit = BatchFit(phases, (batch, 2 * batch), 3 * batch, None, moments)
    predicted = fit.peak_at(3 * batch)
    error = abs(predicted - third.peak) / third.peak if third.peak else 0.0
    return dataclasses.replace(fit, error=error)
