"""One training step under the fake mode, counted: what would be alive, by category and by layer.

:func:`run_step` builds the fake model, inputs and optimizer, starts a
:class:`~.counter.StorageLifeCounter` above the fake mode and runs the step
twice (the first makes the optimizer's lazy state): forward (under autocast if
asked, with a ``saved_tensors_hooks`` pack hook and a module stack putting each
saved storage down to the module that saved it, as the profiler's per-layer mode
does), the loss, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``; the output and the loss are dropped at
the end of each step, as they are when a step is a function. Phases are named as
in the records: ``forward``, ``backward`` (the whole ``backward()`` call),
``optimizer``, ``other`` (the loss, gradient clipping, ``zero_grad``). The loop's
settings (:class:`StepPlan`): ``accumulation_steps`` forwards and backwards of the batch
before each optimizer step (each micro-step's output and loss dropped after its backward,
the last one's at the step's end), the gradients clipped to ``max_grad_norm``
(``torch.nn.utils.clip_grad_norm_``) before the step, and ``zero_grad(set_to_none=...)``:
with ``False`` the gradients stay allocated, zeroed, into the next step.

Example::

    >>> import functools, torch
    >>> plan = StepPlan(model=torch.nn.Linear(256, 256), example_inputs=torch.zeros(8, 256),
    ...                 optimizer=functools.partial(torch.optim.SGD, lr=0.1), device=torch.device("cpu"))
    >>> step = run_step(plan, 8)
    >>> step.breakdown["weights"] == (256 * 256 + 256) * 4
    True
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch._subclasses import fake_tensor as _fake
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..measure.accounting import optimizer_state_tensors
from ..measure.devices import cuda_multiprocessors
from ..measure.engine_sums import EngineAccumulation
from ..measure.saved_tensors import kept_without_node
from ..measure.trees import tensors_in
from ..stats import ACTIVATIONS, INPUT, PEAK_CATEGORIES, WEIGHT_COPIES, LayerFeatureMaps
from .allocator import StepEvents, block_size, cublas_thread, simulate_reserved
from .counter import COLLECTIVE_ROLE, Life, StorageLifeCounter
from .cpu_kernels import CpuKernels
from .emulation import HostScalars, capturable_on_stand_ins, cuda_rules
from .fast_paths import FusedFastPaths, fast_paths_kept
from .build import build_model
from .draws import user_line
from .compiled import CompiledModules
from .global_caches import fake_values_left_out_of_caches
from .grad_scaling import FiniteGradScaler, grad_scaler_note
from .fake import FakeKernelRefused, eager_modules, fake_inputs, fake_mode, fake_model, make_optimizer
from .parallel import PARALLEL_ROLES
from .attention_rules import MathAttentionRules
from .backward_formulas import InPlaceFormulas
from .linear_rules import LinearBiasRules
from .output_order import allocation_order
from .loss_rules import LossRules
from .rnn import CudnnRNNRules, flatten_weights
from .library_rules import library_rules
from .module_conversions import swappable_fakes
from .packed_sequences import padded_as_aten_does
from .scalar_indices import scalar_indices_taken_as_zero
from .tensor_checks import checks_taken_as_passing
from .scripted import scripted_as_python
from .scratch import KernelScratch

__all__ = ["StepPlan", "StepMemory", "EstimateUnsupported", "run_step", "checkpoint_blocks", "moved_order"]

#: The function modes the step runs under: the modules' fast-path checks do not see them
#: (:func:`~.fast_paths.fast_paths_kept`), so that the step takes the path the device's takes.
OWN_FUNCTION_MODES = (MathAttentionRules, LinearBiasRules, CudnnRNNRules, LossRules, HostScalars, FusedFastPaths)

#: What the estimate tells a user to do instead when the fake mode cannot run their step.
REAL_PROFILER = (
    "estimate_memory cannot count this step without running it; measure a real step on the "
    "device instead: MemoryProfiler(model, print_period=1) around one training iteration"
)


class EstimateUnsupported(RuntimeError):
    """The step uses an operation the fake mode cannot run: the estimate would be wrong, so there is none.

    Attributes:
        operation: the operator's name (``aten.nonzero.default``), or ``None`` if unknown.
    """

    def __init__(self, message: str, operation: str | None = None) -> None:
        super().__init__(message)
        self.operation = operation


@dataclass
class StepPlan:
    """Everything needed to run the step again at another batch size (see ``estimate_memory``)."""

    model: Any
    example_inputs: Any
    optimizer: Callable[..., torch.optim.Optimizer]
    device: torch.device
    loss_fn: Callable[..., torch.Tensor] | None = None
    targets: Any = None
    autocast: torch.dtype | None = None
    checkpointing: bool | Callable[[str, nn.Module], bool] = False
    #: where the fake tensors live: ``device``, or the CPU where ``device`` cannot run autograd here
    run_device: torch.device | None = None
    #: ``model -> (model, {role: () -> tensors})``: wraps the fake model (DDP, FSDP2; see
    #: :mod:`.parallel`) and says what holds tensors it made, counted from the start with that role
    setup: Callable[[nn.Module], tuple[nn.Module, Mapping[str, Callable[[], list[torch.Tensor]]]]] | None = None
    #: what the step runs inside (a fake process group)
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    #: on fake CUDA tensors with the GPU here: measure each convolution's scratch on it (:mod:`.kernel_probe`)
    measure_kernels: bool = False
    #: forwards and backwards of the batch before each optimizer step (gradient accumulation)
    accumulation_steps: int = 1
    #: ``torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)`` before each optimizer step (``None``: no clipping)
    max_grad_norm: float | None = None
    #: ``optimizer.zero_grad(set_to_none=...)`` after each optimizer step
    set_to_none: bool = True
    #: fp16 loss scaling: ``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update()`` (:mod:`.grad_scaling`)
    grad_scaler: bool = False
    #: ``"largest"``: where the step reads a drawn value, uniform draws at the end of their range
    #: that gives the larger step; ``"seeded"``: the seeded draws as they come (:mod:`.draws`)
    random_draws: str = "largest"
    #: the end chosen for ``"largest"`` by the first step run (``None``: none run yet), kept for every
    #: batch size after it, so that all of them take the same branches
    draws_at: str | None = None


@dataclass
class StepMemory:
    """What one batch size's step would hold, in bytes (as the target device counts them)."""

    batch_size: int | None
    peak: int
    peak_phase: str
    phase_peaks: Mapping[str, int]
    breakdown: Mapping[str, int]
    peak_layers: Mapping[str, int]
    layers: LayerFeatureMaps
    weights: int
    buffers: int
    gradients: int
    optimizer_state: int
    inputs: int
    reserved: int | None = None
    #: the allocations (+bytes) and frees (-bytes) by storage, in time order, for the allocator's replay (CUDA only)
    events: tuple[tuple[int, int], ...] = ()
    #: ``events`` with where each phase of each step begins and what made each storage (CUDA only)
    step_events: StepEvents | None = None
    #: bytes a kernel block may ask beyond its figure, by its key in ``events`` (``Life.headroom``;
    #: empty: none may), for the replay's upper figure (:func:`~.allocator.with_headroom`)
    headroom: Mapping[int, int] = field(default_factory=dict)
    #: bytes of kernel scratch in ``peak`` (in ``breakdown["other"]``): an operator's own buffers (CUDA only)
    kernel_scratch: int = 0
    #: operations whose memory follows an unmeasured rule: the bytes the peak may be off by, per operation
    error_bounds: Mapping[str, int] = field(default_factory=dict)
    #: the operations of ``error_bounds`` whose bound is a kernel's own buffer inside one operator
    #: (never alive together with another's: the peak may be off by the largest of them, not their sum)
    transient_bounds: frozenset[str] = frozenset()
    #: the operations of ``error_bounds`` whose bound is of workspaces that give way under a memory
    #: limit (cuDNN's convolutions run another plan): a batch search leaves no room for them
    fallback_bounds: frozenset[str] = frozenset()
    #: bytes at the peak of each parallel role (:data:`.parallel.PARALLEL_ROLES`; in ``breakdown["other"]``)
    parallel_parts: Mapping[str, int] = field(default_factory=dict)
    #: the peak of each of the two steps run: the first (no optimizer state before its
    #: optimizer step; DDP's first-iteration buckets) and the steady one
    step_peaks: tuple[int, ...] = ()
    #: what ``checkpointing`` acted on: the modules wrapped, sorted (``None``: checkpointing off;
    #: empty: asked for, but no module was chosen)
    checkpointed: tuple[str, ...] | None = None
    #: the optimizer's class name (``None``: nothing to train, no optimizer step)
    optimizer_name: str | None = None
    #: the dtypes of the model's floating-point parameters, by name (``"float32"``), once each
    parameter_dtypes: tuple[str, ...] = ()
    #: the lines that read a value drawn at random (a branch a draw decided: LayerDrop), and how
    #: often, over the two steps (see :mod:`.draws`); empty when the step read none
    random_reads: Mapping[str, int] = field(default_factory=dict)
    #: where uniform draws were put: ``"top"``/``"bottom"`` of their range, or ``None`` (seeded)
    draws_at: str | None = None
    #: how the step was estimated where it is not plain (compiled modules, see :mod:`.compiled`)
    notes: tuple[str, ...] = ()
    #: how many of ``events`` come at or before the step's peak, and each phase's (CUDA only): the
    #: allocator replay counts the whole blocks alive there (:func:`~.allocator.replay_whole_blocks`)
    peak_event: int = 0
    phase_peak_events: Mapping[str, int] = field(default_factory=dict)
    #: the phases an operator running cuBLAS on CUDA ran in (``None``: unknown, compiled code ran),
    #: for the workspaces (:func:`~.allocator.cublas_workspaces`)
    blas_phases: frozenset[str] | None = None


# -- errors ----------------------------------------------------------------------
class _NotInThisTorch(Exception):
    """Stands for an exception class that this torch does not have: never raised."""


#: Newer torch names the fake mode's device mismatch (torch 2.11 does not: there it is a
#: plain RuntimeError, which reaches the user as it is).
_DEVICE_MISMATCH: type[BaseException] = getattr(_fake, "FakeTensorDeviceMismatchError", _NotInThisTorch)


def _reading_line(err: BaseException) -> str:
    """`` (at file:line: code)`` for the innermost frame of ``err``'s traceback outside torch and
    this package (see :func:`~.draws.user_line`)."""
    import traceback

    line = user_line(traceback.extract_tb(err.__traceback__))
    return f" (at {line})" if line else ""


@contextlib.contextmanager
def _unsupported_as_errors() -> Iterator[None]:
    """The fake mode's refusals as :class:`EstimateUnsupported`, naming the operation."""
    try:
        yield
    except DynamicOutputShapeException as err:
        name = str(err.func)
        raise EstimateUnsupported(
            f"{name}{_reading_line(err)}: its output's shape depends on the values of its input (a "
            f"data-dependent shape), which a fake tensor does not have. {REAL_PROFILER}",
            name,
        ) from err
    except DataDependentOutputException as err:
        name = str(err.func)
        raise EstimateUnsupported(
            f"{name}{_reading_line(err)}: it reads the values of a tensor (.item(), a Python `if` on a "
            f"tensor, a data-dependent branch), which a fake tensor does not have. {REAL_PROFILER}",
            name,
        ) from err
    except UnsupportedOperatorException as err:
        name = str(err.func)
        # an ATen operator on a sparse tensor has no sparse meta kernel; anything else is an extension's
        what = (
            "no fake (meta) kernel for sparse tensors"
            if "Sparse" in str(err.__cause__ or err.__context__ or "")
            else "no fake (meta) implementation (a custom operator or a CUDA extension without a registered fake kernel)"
        )
        raise EstimateUnsupported(
            f"{name} has {what}; running its real kernel would allocate real memory. {REAL_PROFILER}",
            name,
        ) from err
    except UnsupportedFakeTensorException as err:
        raise EstimateUnsupported(f"the fake mode cannot run this step: {err.reason}. {REAL_PROFILER}") from err
    except _DEVICE_MISMATCH as err:
        name = str(getattr(err, "func", "an operator"))
        raise EstimateUnsupported(
            f"{name} mixes tensors of {getattr(err, 'common_device', '?')} and {getattr(err, 'device', '?')}: tensors the model makes "
            f"on a fixed device do not follow the estimate's device. {REAL_PROFILER}",
            name,
        ) from err
    except RuntimeError as err:
        # torch.library.custom_op without register_fake says so in a plain RuntimeError
        found = re.search(r"no fake impl registered for <CustomOpDef\((.+?)\)>", str(err))
        if found is None:
            if isinstance(err, FakeKernelRefused):
                name = str(err.func)
                raise EstimateUnsupported(
                    f"{name}{_reading_line(err)}: torch's fake kernel for it refused the call ({err}). If the "
                    f"real step fails there the same way, the inputs or the model are at fault, not the estimate; "
                    f"where the real step runs this call, that kernel is stricter than the real one and the "
                    f"estimate has no rule for it. {REAL_PROFILER}",
                    name,
                ) from err
            raise
        name = found.group(1)
        raise EstimateUnsupported(
            f"{name} has no fake implementation (a custom operator without register_fake); running "
            f"its real kernel would allocate real memory. {REAL_PROFILER}",
            name,
        ) from err


# -- gradient checkpointing --------------------------------------------------------
def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the children of the outermost ``ModuleList``/``Sequential`` containers whose
    children repeat one class (transformer layers, ResNet stages' blocks)."""
    chosen: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            kids = list(module.named_children())
            kinds = {type(child) for _, child in kids}
            if len(kids) >= 2 and len(kinds) == 1:
                chosen += [f"{name}.{child}" if name else child for child, _ in kids]
                taken.append(name)
    return chosen


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def _inside(name: str, outer: Iterable[str]) -> bool:
    """Whether the module ``name`` is one of ``outer`` or inside one (``""``, the model, holds all)."""
    return any(not o or name == o or name.startswith(o + ".") for o in outer)


def _transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models inside ``model`` (itself included) that checkpoint their own
    layers (``supports_gradient_checkpointing``), by name."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if _inside(name, (n for n, _ in found)):
            continue
        enable = getattr(module, "activation_checkpointing_enable", None) or getattr(module, "gradient_checkpointing_enable", None)
        if getattr(module, "supports_gradient_checkpointing", False) and callable(enable):
            found.append((name, module))
    return found


def _checkpoint_own_layers(name: str, module: nn.Module) -> list[str]:
    """A transformers model's own checkpointing, non-reentrant, as its users turn it on: it also turns
    the key-value cache off, which a wrapper around each layer would leave to be filled in forward and
    filled again in recomputation (T5 and Marian then save other tensors; Gemma2 attends over its keys
    stored twice). The names of the modules it checkpoints."""
    kwargs = {"use_reentrant": False}
    enable = getattr(module, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    prefix = f"{name}." if name else ""
    return [f"{prefix}{sub}" if sub else name for sub, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def checkpoint_blocks(model: nn.Module, which: bool | Callable[[str, nn.Module], bool]) -> list[str]:
    """Run the chosen modules' forward through ``torch.utils.checkpoint`` (non-reentrant).

    ``which``: ``True`` for :func:`repeated_blocks`, or a function ``(name, module) -> bool``.
    With ``True``, a transformers model inside checkpoints its own layers, as its users turn it on
    (:func:`_checkpoint_own_layers`), and the repeated blocks elsewhere are wrapped. Changes
    ``model`` (the estimate's own copy); returns the names of the modules checkpointed.
    """
    names: set[str] = set()
    if which is True:
        own = _transformers_models(model)
        for name, module in own:
            names.update(_checkpoint_own_layers(name, module))
        wrapped = {n for n in repeated_blocks(model) if not _inside(n, [o for o, _ in own])}
    else:
        wrapped = {name for name, module in model.named_modules() if name and which(name, module)}  # type: ignore[operator]
    for name, module in model.named_modules():
        if name in wrapped:
            module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
    return sorted(names | wrapped)


# -- autocast ----------------------------------------------------------------------
def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# -- saved tensors by module ---------------------------------------------------------
class _SavedByModule:
    """During one forward: which module's forward saved each storage autograd keeps.

    The module stack is kept by global module hooks (as the profiler's per-layer
    attribution keeps it); the pack hook marks each saved storage's :class:`Life`
    as activations of the innermost module running.
    """

    def __init__(self, model: nn.Module, counter: StorageLifeCounter) -> None:
        self.counter = counter
        self.names = {id(m): name for name, m in model.named_modules()}
        self.root = id(model)
        self.param_ids = {id(p) for p in model.parameters()}
        self.stack = [""]
        self.keys: list[int] = []
        self.by_module: dict[tuple[str, str], int] = {}
        self.calls: dict[str, int] = {}
        self.seen: set[int] = set()

    def __enter__(self) -> _SavedByModule:
        self.handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) == self.root or self.counter.paused_depth:
            return  # the root, or a compiled module's trace
        name = self.names.get(id(module), self.stack[-1])
        if id(module) in self.names:
            self.calls[name] = self.calls.get(name, 0) + 1
        self.stack.append(name)
        self.keys.append(id(module))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.keys and self.keys[-1] == id(module) and not self.counter.paused_depth:
            self.keys.pop()
            self.stack.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a saved output kept with its node would keep a branch backward never reaches alive
        self._note(t)
        return kept_without_node(t)

    def _note(self, t: torch.Tensor) -> None:
        if self.counter.paused_depth:
            return
        life = self.counter.life_of(t)
        if life is None or id(life) in self.seen:
            return
        self.seen.add(id(life))
        if "weights" in life.roles:
            return
        if isinstance(t, nn.Parameter):
            # a parameter not among the model's weights: FSDP2's gathered (unsharded) one
            life.roles.add("regrown")
            return
        if "inputs" in life.roles:
            slot = (INPUT, ACTIVATIONS)
        else:
            slot = (self.stack[-1], WEIGHT_COPIES if self._is_weight_copy(t) else ACTIVATIONS)
            life.roles.add("activations")
            life.saved_by = self.stack[-1]
        self.by_module[slot] = self.by_module.get(slot, 0) + life.nbytes

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        if t._is_view() and t._base is not None:
            t = t._base
        node = t.grad_fn
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return False
        return any(id(getattr(n, "variable", None)) in self.param_ids for n, _ in node.next_functions)

    def result(self) -> LayerFeatureMaps:
        total = sum(n for (m, _), n in self.by_module.items() if m != INPUT)
        inputs = sum(n for (m, _), n in self.by_module.items() if m == INPUT)
        return LayerFeatureMaps(
            by_module=MappingProxyType(dict(self.by_module)),
            calls=MappingProxyType(dict(self.calls)),
            total=total,
            inputs=inputs,
            unattributed=0,
        )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


# -- the step ----------------------------------------------------------------------
#: Parallel roles that make a storage "other" whatever else it is: DDP's buckets (the gradients'
#: views with ``gradient_as_bucket_view``), FSDP's gathered parameters (saved for backward too).
_OWNING_PARALLEL_ROLES = frozenset(PARALLEL_ROLES) - {COLLECTIVE_ROLE}


def _category(life: Life) -> str:
    roles = life.roles
    if "scratch" in roles or not roles.isdisjoint(_OWNING_PARALLEL_ROLES):
        return "other"  # a kernel's own buffer; DDP's buckets, FSDP's gathered parameters, the mesh
    for role in ("weights", "gradients", "optimizer_state", "inputs", "activations"):
        if role in roles:
            return role
    if COLLECTIVE_ROLE in roles:
        return "other"  # a communication buffer that is nothing else (a reduce-scatter's output is the gradients)
    return "activation_gradients" if life.phase == "backward" else "other"


def _parallel_part(life: Life) -> str | None:
    """The parallel role a storage in "other" is shown under (``None``: none, or not in "other")."""
    if "scratch" in life.roles:
        return None
    for role in PARALLEL_ROLES:
        if role in life.roles:
            return role
    return None


def _construct(plan: StepPlan) -> tuple[nn.Module | None, BaseException | None]:
    """A model given as a function, built outside the fake mode with its small tensors real and
    its large ones on ``meta`` (see :mod:`.build`); ``(None, error)`` if that fails."""
    if isinstance(plan.model, nn.Module) or not callable(plan.model):
        return None, None
    try:
        made = build_model(plan.model)
    except Exception as err:  # noqa: BLE001 - built again inside the fake mode, which may manage
        return None, err
    if not isinstance(made, nn.Module):
        raise TypeError(f"model() must return a torch.nn.Module; it returned {type(made).__name__}")
    return made, None


def _caused_by_the_outside_build(error: BaseException) -> bool:
    """Whether a constructor built outside the fake mode failed for how it was built there (it read
    or copied a large tensor's data on ``meta``: torch's errors name the meta device or have no meta
    kernel; or it asked for a device this machine lacks), not for a mistake of its own."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).lower()
        if isinstance(current, NotImplementedError) or any(word in text for word in ("meta", "cuda", "driver", "device")):
            return True
        current = current.__cause__ or current.__context__
    return False


def _build(
    plan: StepPlan, mode: Any, run_device: torch.device, made: nn.Module | None = None
) -> tuple[nn.Module, tuple[str, ...] | None]:
    """The step's fake model, and the modules checkpointing wrapped (``None``: checkpointing off)."""
    model = plan.model
    if made is not None:
        built = fake_model(made, run_device, mode, owned=True)
    elif isinstance(model, nn.Module):
        built = fake_model(model, run_device, mode)
    elif callable(model):
        # the constructor failed outside the fake mode: inside it every tensor is fake from the start
        with torch.device(run_device):
            made = model()
        if not isinstance(made, nn.Module):
            raise TypeError(f"model() must return a torch.nn.Module; it returned {type(made).__name__}")
        built = fake_model(made, run_device, mode, owned=True)
    else:
        raise TypeError(f"model must be a torch.nn.Module or a function that builds one, got {type(model).__name__}")
    checkpointed = None
    if plan.checkpointing:
        if built is model:
            built = fake_model(model, run_device, mode)
        checkpointed = tuple(checkpoint_blocks(built, plan.checkpointing))
    return built, checkpointed


def run_step(plan: StepPlan, batch_size: int | None) -> StepMemory:
    """Run ``plan``'s training step twice under the fake mode at ``batch_size``; what it would hold.

    With ``plan.measure_kernels`` on fake CUDA tensors, the convolutions and cuDNN
    recurrent layers the step met that are not measured yet are measured on the GPU
    and the step run again.

    Raises:
        EstimateUnsupported: the step uses an operation the fake mode cannot run.
    """
    if plan.random_draws == "seeded":
        return _kernels_measured_step(plan, batch_size, None)
    if plan.draws_at is not None:
        return _kernels_measured_step(plan, batch_size, plan.draws_at)
    # the first step: the uniform draws at the top of their range; where the step read a drawn
    # value, again at the bottom, and the larger kept (see :mod:`.draws`). One end may fail where the
    # other runs: every layer skipped leaves nothing to differentiate, as a real step drawing so would
    read: dict[str, int] = {}
    try:
        step = _kernels_measured_step(plan, batch_size, "top", read)
    except Exception as at_the_top:
        if not read:
            raise  # no draw was read before it: the step's own failure, at any end
        try:
            step = _kernels_measured_step(plan, batch_size, "bottom")
        except Exception:
            raise at_the_top from None
    else:
        if step.random_reads:
            try:
                other = _kernels_measured_step(plan, batch_size, "bottom")
            except Exception:  # noqa: BLE001 - this end's step cannot run; the other end's stands
                other = None
            if other is not None and other.peak > step.peak:
                step = other
    plan.draws_at = step.draws_at
    return step


def _kernels_measured_step(plan: StepPlan, batch_size: int | None, draws_at: str | None, read: dict[str, int] | None = None) -> StepMemory:
    """The step at ``batch_size`` with uniform draws at ``draws_at``; ``read`` (where given) gets the
    lines that read a drawn value as they are read, a failed step's included."""
    run_device = plan.run_device or plan.device
    measure = plan.measure_kernels and plan.device.type == "cuda" and run_device.type == "cuda"
    scratch = kernel_scratch(plan.device, measured=measure)
    step = _run_step(plan, batch_size, scratch, draws_at, read)
    if scratch is not None and scratch.pending:
        from .kernel_probe import measure_convolutions

        found = measure_convolutions(scratch.pending, run_device)
        scratch.pending.clear()
        if found:
            step = _run_step(plan, batch_size, scratch, draws_at, read)
    return step


def _run_step(
    plan: StepPlan, batch_size: int | None, scratch: KernelScratch | None, draws_at: str | None, read: dict[str, int] | None = None
) -> StepMemory:
    # a library's process-wide cache keeps no fake tensor for the user's real model to compute on
    with fake_values_left_out_of_caches():
        return _fake_step(plan, batch_size, scratch, draws_at, read)


def _fake_step(
    plan: StepPlan, batch_size: int | None, scratch: KernelScratch | None, draws_at: str | None = None, read: dict[str, int] | None = None
) -> StepMemory:
    target = plan.device
    run_device = plan.run_device or target
    size_of = block_size if target.type == "cuda" else None
    # the CPU's kernels where they return other dtypes, strides or buffers than the fake ones (CUDA's: those it shares)
    outputs = CpuKernels(device_type=target.type) if target.type in ("cpu", "cuda") else None
    # no mode watches the real step (the CPU counter's restores the engine's in-place sums):
    # autograd's engine sums gradient pieces in place there
    sums = EngineAccumulation()
    order = allocation_order if target.type == "cuda" else None  # CUDA's kernels make some outputs in another order
    # backward formulas scatter into their zeros in place on the device (not under a mode)
    formulas = InPlaceFormulas() if target.type == "cuda" else None
    counter = StorageLifeCounter(run_device, size_of=size_of, scratch=scratch, outputs=outputs, accumulation=sums,
                                 output_order=order, formulas=formulas)  # fmt: skip
    mode = fake_mode(kernels=target.type)  # the target's sparse kernels, on fake CPU tensors standing in too
    mode.draws.extreme = draws_at
    if read is not None:
        mode.draws.reads = read  # the caller sees the reads of a step that fails
    # Fake CPU tensors standing in for CUDA ones take CUDA's attention kernels and autocast precisions.
    rules = cuda_rules() if target.type == "cuda" and run_device.type == "cpu" else contextlib.nullcontext()
    # cuDNN's recurrent layers, with its reserve, workspace and weight buffer, on fake tensors
    pending = scratch.pending if scratch is not None and scratch.measured else None
    # on fake CUDA tensors (a GPU here) cuDNN is asked its sizes for each call, as ATen asks them
    rnn = (CudnnRNNRules(run_device.type, multiprocessors=cuda_multiprocessors(target), pending=pending, exact=run_device.type == "cuda")
           if target.type == "cuda" else None)  # fmt: skip
    # losses ATen's CUDA code writes as composites, with their temporaries
    losses = LossRules(run_device.type) if target.type == "cuda" else contextlib.nullcontext()
    # a linear layer over a non-contiguous input adds its bias in place on the device (not under a mode)
    linear = LinearBiasRules(run_device.type) if target.type == "cuda" else contextlib.nullcontext()
    # math attention adds its mask in place on the device (fake CPU tensors: the emulation's attention does)
    attention = MathAttentionRules() if target.type == "cuda" and run_device.type == "cuda" else contextlib.nullcontext()
    made, build_error = _construct(plan)
    context = plan.context() if plan.context is not None else contextlib.nullcontext()
    kept = fast_paths_kept(OWN_FUNCTION_MODES)  # an encoder in eval without gradients runs fused, as on the device
    swappable = swappable_fakes(mode)  # a forward may convert its own layers (module.to(dtype)), as it does for real
    fused = FusedFastPaths() if target.type == "cuda" else contextlib.nullcontext()  # ... with the kernels' own blocks
    with context, mode, _unsupported_as_errors(), kept, swappable, rules, rnn if rnn is not None else contextlib.nullcontext(), losses, linear, attention, fused:
        try:
            with _unsupported_as_errors():  # named here, so that a failed build outside can lead below
                model, checkpointed = _build(plan, mode, run_device, made)
        except Exception as err:
            if build_error is None:
                raise
            if isinstance(err, EstimateUnsupported):
                if not _caused_by_the_outside_build(build_error):
                    # a mistake in the constructor (a TypeError of its own), past a value it reads that
                    # the fake build stopped at: the user's error, as a real build raises it
                    raise build_error
                # both builds failed: the constructor's own error leads (a real build likely raises it too)
                raise EstimateUnsupported(
                    f"model() raised {type(build_error).__name__}: {build_error} (built with its small tensors "
                    f"real and its large ones on the meta device); built inside the fake mode instead, it "
                    f"stopped at: {err}",
                    err.operation,
                ) from build_error
            raise err from build_error
        compiled = CompiledModules(counter, target, key=plan.model)
        model = compiled.install(model, source=made if made is not None else plan.model if isinstance(plan.model, nn.Module) else None)
        if model is not plan.model:  # the step's own copy: what is not estimated as compiled runs eagerly,
            model = eager_modules(model)  # so Dynamo stays out of the fake step (torch 2.4, 2.13)
        # on CUDA, model.to(device) leaves each recurrent layer's weights in one buffer of cuDNN's
        flattened = flatten_weights(model) if target.type == "cuda" else {}
        set_up: Mapping[str, Callable[[], list[torch.Tensor]]] = {}
        if plan.setup is not None:
            model, set_up = plan.setup(model)
        params = list(model.parameters())
        dtypes = tuple(sorted({str(p.dtype).replace("torch.", "") for p in params if p.is_floating_point()}))
        # an optimizer's counts made with no device stay in host memory beside CUDA parameters
        host = HostScalars(counter.paused) if target.type == "cuda" and run_device.type == "cpu" else None

        def hosting() -> contextlib.ExitStack:  # entered at construction and each step
            stack = contextlib.ExitStack()
            if host is not None:  # emulated: capturable=True takes CUDA's path on the stand-ins
                stack.enter_context(host)
                stack.enter_context(capturable_on_stand_ins())
            return stack

        # the user's own tensors among its settings (lr=torch.tensor(1e-3)) keep their values: the
        # constructor checks them in Python (``if not 0.0 <= lr``), as they are made for the inputs
        with hosting(), mode.draws.settings():
            # a model with nothing to train has no optimizer step
            optimizer = make_optimizer(plan.optimizer, model, target.type) if any(p.requires_grad for p in params) else None
        if optimizer is not None and _step_needs_closure(optimizer):
            name = type(optimizer).__name__
            raise EstimateUnsupported(
                f"{name}.step needs a closure: it runs the forward and backward again inside the step, as often as "
                f"it decides from the loss's value (torch.optim.LBFGS reads it), which a fake step cannot read. "
                f"Measure a real step on the device instead: MemoryProfiler(model, print_period=1) around one "
                f"{name} iteration",
                operation=f"{name}.step(closure)",
            )
        counter.start()
        with counter.paused():
            sums.calibrate()  # under the step's modes, before anything is counted
        try:
            # on the device in the order model.to(device) copies them: what the replay starts from
            _adopt_weights(counter, model, flattened)
            # the buffers' bytes as the step starts, not the buffers: a forward that replaces one
            # (a positional table cast to autocast's dtype, self.pe = self.pe.to(x.dtype)) frees the
            # old one, as for real; a list of them here would keep it alive through both steps
            buffer_bytes = _bytes_of(counter, [b for b in model.buffers() if b is not None])
            _adopt_set_up(counter, set_up)
            # state an optimizer makes when it is built (Adagrad's sums), after the weights, as a user's
            # script makes it: counted from the start, as the step's own state is from its first step
            if optimizer is not None:
                made = [t for t in optimizer_state_tensors([optimizer]) if host is None or not host.holds(t)]
                counter.adopt(made, role="optimizer_state")
            # what the user fixed in the inputs (a mask of ones) keeps its values: libraries read them
            inputs = fake_inputs(plan.example_inputs, batch_size, run_device, mode)
            targets = fake_inputs(plan.targets, batch_size, run_device, mode) if plan.targets is not None else None
            # Loop variables would keep the last tensor alive past its time: give roles in a call.
            _give_role(counter, [*tensors_in(inputs), *tensors_in(targets)], "inputs")
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            kwargs: dict[str, Any] = {}
            if isinstance(inputs, dict):
                args, kwargs = (), inputs
            target_args = () if targets is None else (targets if isinstance(targets, tuple) else (targets,))
            attribution = None
            gradients = optimizer_state = 0
            # torch's own scaler, taking the gradients as finite (the step that runs the optimizer)
            scaler = FiniteGradScaler(run_device.type) if plan.grad_scaler and optimizer is not None else None
            step_peaks = []
            # tiny tensors the step makes from nothing get values (a LayerDrop draw read in Python);
            # scripted functions run as Python (a fused TorchScript kernel would read fake memory)
            # libraries' choices from values (transformers' packed sequences) as the real step makes them
            # packed sequences padded back by ATen's own steps (its kernel writes through a pointer);
            # a library's check on values the step does not have taken as passing, and noted
            with contextlib.ExitStack() as around_the_step:  # one block: Python limits how deep blocks nest
                around_the_step.enter_context(mode.draws.on())
                around_the_step.enter_context(scripted_as_python(model, enabled=run_device.type == "cuda"))
                around_the_step.enter_context(library_rules([*tensors_in(inputs), *tensors_in(targets)]))
                around_the_step.enter_context(padded_as_aten_does())
                checks_taken = around_the_step.enter_context(checks_taken_as_passing())
                # a 0-d integer index without a value selects a view, whichever position: index 0, noted
                indices_taken = around_the_step.enter_context(scalar_indices_taken_as_zero())
                for step_number in (1, 2):
                    counter.step = step_number
                    for bounded in (rnn, scratch, outputs):
                        if bounded is not None:
                            bounded.bounds.clear()  # the bounds of one step: the last
                    if rnn is not None:
                        rnn.reserve_bounds.clear()
                    counter.reset_peak()
                    for micro_step in range(plan.accumulation_steps):
                        if micro_step:
                            del output, loss  # the previous micro-step's, dropped after its backward
                        counter.enter_phase("forward")
                        attribution = _SavedByModule(model, counter)
                        with attribution, _autocast(run_device, plan.autocast):
                            output = model(*args, **kwargs)
                        counter.enter_phase("other")
                        loss = plan.loss_fn(output, *target_args) if plan.loss_fn is not None else _default_loss(output)
                        counter.enter_phase("backward")
                        if scaler is not None:
                            scaler.scale(loss).backward()  # the scaled loss, dropped as backward returns
                        else:
                            loss.backward()
                    gradients = _give_role(counter, [p.grad for p in params if p.grad is not None], "gradients")
                    if optimizer is not None:
                        if plan.max_grad_norm is not None:
                            counter.enter_phase("other")
                            if scaler is not None:
                                scaler.unscale_(optimizer)  # the true gradients are clipped
                            torch.nn.utils.clip_grad_norm_(params, plan.max_grad_norm)
                        counter.enter_phase("optimizer")
                        # a number scaling an update (Adafactor); the counts made in host memory
                        with mode.draws.stand_ins_in_step(), hosting():
                            if scaler is not None:
                                scaler.step(optimizer)
                            else:
                                optimizer.step()
                        optimizer_state = _give_role(counter, list(optimizer_state_tensors([optimizer])), "optimizer_state")
                        counter.enter_phase("other")
                        if scaler is not None:
                            scaler.update()
                        optimizer.zero_grad(set_to_none=plan.set_to_none)
                    del output, loss
                    step_peaks.append(counter.read().peak_allocated)
            # what the set-up made while the steps ran (DDP's rebuilt buckets) has its role too
            for role, holding in set_up.items():
                _give_role(counter, holding(), role)
            assert attribution is not None
            layers = attribution.result()
        finally:
            counter.stop()
    step = _summarize(counter, batch_size, layers, params, buffer_bytes, optimizer_state, gradients, target)
    step = dataclasses.replace(
        step,
        step_peaks=tuple(step_peaks),
        checkpointed=checkpointed,
        optimizer_name=type(optimizer).__name__ if optimizer is not None else None,
        parameter_dtypes=dtypes,
        random_reads=MappingProxyType(dict(mode.draws.reads)),
        draws_at=draws_at if mode.draws.reads else None,
        # compiled code calls its kernels past the counter: which of them run cuBLAS is not seen
        blas_phases=None if compiled.outcomes else frozenset(counter.blas_first),
    )
    # a kernel's own buffers inside one operator (cuDNN's workspaces) are never alive together with
    # another operator's; outputs a rule may have mis-sized (oneDNN's kept workspaces, what a compiled
    # module keeps) are, and add up
    transient = {**(rnn.transient_bounds() if rnn is not None else {}), **(scratch.bounds if scratch is not None else {})}
    bounds = {
        **transient,
        **(rnn.kept_bounds() if rnn is not None else {}),
        **(outputs.bounds if outputs is not None else {}),
        **compiled.bounds(step.peak_layers, step.breakdown),
    }
    if bounds:
        fallback = frozenset(scratch.fallback_bounds) if scratch is not None else frozenset()
        step = dataclasses.replace(step, error_bounds=MappingProxyType(bounds), transient_bounds=frozenset(transient),
                                   fallback_bounds=fallback)  # fmt: skip
    notes = (*compiled.notes(), *_stand_in_notes(mode.draws.stand_ins), *_check_notes(checks_taken), *_index_notes(indices_taken),
             *grad_scaler_note(scaler))  # fmt: skip
    return dataclasses.replace(step, notes=notes)


def _stand_in_notes(stand_ins: Mapping[str, int]) -> tuple[str, ...]:
    """The report's note on numbers the optimizer's step read from tensors without values (see
    :meth:`.Draws.stand_ins_in_step`)."""
    if not stand_ins:
        return ()
    n = sum(stand_ins.values())
    return (
        f"The optimizer's step read {n} number{'s' if n != 1 else ''} from tensors without values "
        f"({'; '.join(stand_ins)}): 1 stood in for each; they scale updates made in place, which allocate "
        f"the same whatever the number",
    )


def _check_notes(taken: Mapping[str, int]) -> tuple[str, ...]:
    """The report's note on checks of values the step does not have (see :mod:`.tensor_checks`)."""
    return _lines_note(taken, "checked {n} condition{s} on values it does not have",
                       "taken as passing, as in a step that runs; a check that fails stops the real step")  # fmt: skip


def _index_notes(taken: Mapping[str, int]) -> tuple[str, ...]:
    """The report's note on indexing by positions the step does not have (see :mod:`.scalar_indices`)."""
    return _lines_note(taken, "indexed by {n} position{s} it does not have",
                       "taken as 0; a 0-d integer index selects a view of the same shape and memory whichever "
                       "position it picks")  # fmt: skip


def _lines_note(taken: Mapping[str, int], what: str, then: str) -> tuple[str, ...]:
    """One note for what the step did at the lines of ``taken`` (with how often), or none."""
    if not taken:
        return ()
    n = sum(taken.values())
    return (f"The step {what.format(n=n, s='s' if n != 1 else '')} ({'; '.join(taken)}): {then}",)


def kernel_scratch(target: torch.device, *, measured: bool = False) -> KernelScratch | None:
    """The kernel scratch rules for ``target``: CUDA's, sized by its multiprocessors where this
    machine has the device (else an H100's or H200's); ``None`` elsewhere (a CPU kernel's
    scratch is a tensor the counter sees). ``measured``: convolutions measured on the GPU."""
    if target.type != "cuda":
        return None
    found = cuda_multiprocessors(target)
    return KernelScratch(*(found or ()), measured=measured)


def moved_order(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters and buffers in the order ``module.to(device)`` (``nn.Module._apply``)
    makes their copies on the device: each child first, then the module's own parameters, then its
    buffers (``parameters()`` lists a module's own before its children's, and every buffer after
    every parameter). The caching allocator packs blocks in the order they are asked for.

    Example::

        >>> class Scaled(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = nn.Parameter(torch.ones(3))
        ...         self.norm = nn.BatchNorm1d(2)
        >>> [tuple(t.shape) for t in moved_order(Scaled())]
        [(2,), (2,), (2,), (2,), (), (3,)]
    """
    return [t for _, tensors in _moved_by_module(module) for t in tensors]


def _moved_by_module(module: nn.Module) -> Iterator[tuple[nn.Module, list[torch.Tensor]]]:
    """Each module (children first) with its own parameters and buffers, in :func:`moved_order`."""
    for child in module.children():
        yield from _moved_by_module(child)
    own = [p for p in module._parameters.values() if p is not None]
    yield module, own + [b for b in module._buffers.values() if b is not None]


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes a closure it cannot do without (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _adopt_weights(counter: StorageLifeCounter, model: nn.Module, flattened: Mapping[int, tuple[int, ...]]) -> None:
    """Count the model's weights as ``model.to(device)`` makes them: in :func:`moved_order`, and for
    a recurrent layer cuDNN flattened (``flattened``, from :func:`~.rnn.flatten_weights`) each
    weight's own copy, then the flat buffer, then the copies freed (``nn.RNNBase._apply``)."""
    for module, tensors in _moved_by_module(model):
        replaced = flattened.get(id(module))
        if replaced is None:
            counter.adopt(tensors, role="weights")
        else:
            counter.adopt_replacing(replaced, tensors, role="weights")


def _adopt_set_up(counter: StorageLifeCounter, set_up: Mapping[str, Callable[[], list[torch.Tensor]]]) -> None:
    """Count what the parallel set-up holds now (counted from the start) and give it its role."""
    for role, holding in set_up.items():
        counter.adopt(holding(), role=role)


def _give_role(counter: StorageLifeCounter, tensors: list[torch.Tensor], role: str) -> int:
    """Give ``role`` to each tensor's storage; their bytes, each storage once."""
    for tensor in tensors:
        counter.give_role(tensor, role)
    return _bytes_of(counter, tensors)


def _default_loss(output: Any) -> torch.Tensor:
    tensors = tensors_in(output)
    if not tensors:
        raise TypeError("the model's output holds no tensor; give loss_fn= to turn it into a loss")
    loss = tensors[0].float().sum() if tensors[0].dtype != torch.float32 else tensors[0].sum()
    for t in tensors[1:]:
        if t.is_floating_point() and t.requires_grad:
            loss = loss + t.float().sum()
    return loss


def _summarize(
    counter: StorageLifeCounter,
    batch_size: int | None,
    layers: LayerFeatureMaps,
    params: list[torch.Tensor],
    buffer_bytes: int,
    optimizer_state: int,
    gradients: int,
    target: torch.device,
) -> StepMemory:
    at_peak = counter.alive_at(counter.peak_tick)
    breakdown = dict.fromkeys(PEAK_CATEGORIES, 0)
    scratch = sum(life.nbytes for life in at_peak if "scratch" in life.roles)
    parallel_parts = dict.fromkeys(PARALLEL_ROLES, 0)
    peak_layers: dict[str, int] = {}
    for life in at_peak:
        category = _category(life)
        breakdown[category] += life.nbytes
        part = _parallel_part(life) if category == "other" else None
        if part is not None:
            parallel_parts[part] += life.nbytes
        if category == "activations" and life.saved_by is not None:
            peak_layers[life.saved_by] = peak_layers.get(life.saved_by, 0) + life.nbytes
    phase_peaks = dict(counter.phase_peaks)
    peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p]) if phase_peaks else "other"
    param_bytes = _bytes_of(counter, params)
    inputs = sum(life.nbytes for life in counter.lives if "inputs" in life.roles and life.died is None)
    reserved = None
    events: tuple[tuple[int, int], ...] = ()
    headroom: dict[int, int] = {}
    step_events = None
    peak_event = 0
    phase_peak_events: dict[str, int] = {}
    if target.type == "cuda":
        step_events, ticks = _step_events(counter)
        events = step_events.events
        headroom = {key: life.headroom for key, life in enumerate(counter.lives) if life.headroom and life.nbytes > 0}
        reserved = simulate_reserved(events)
        # the events at or before the peak's tick, and each phase's, placed as the marks are
        peak_event = bisect.bisect_right(ticks, counter.peak_tick)
        phase_peak_events = {phase: bisect.bisect_right(ticks, tick) for phase, tick in counter.phase_peak_ticks.items()}
    return StepMemory(
        batch_size=batch_size,
        peak=counter.peak,
        peak_phase=peak_phase,
        phase_peaks=MappingProxyType(phase_peaks),
        breakdown=MappingProxyType(breakdown),
        peak_layers=MappingProxyType(dict(sorted(peak_layers.items(), key=lambda kv: -kv[1]))),
        layers=layers,
        weights=param_bytes,
        buffers=buffer_bytes,
        gradients=gradients,
        optimizer_state=optimizer_state,
        inputs=inputs,
        reserved=reserved,
        events=events,
        headroom=MappingProxyType(headroom),
        step_events=step_events,
        kernel_scratch=scratch,
        parallel_parts=MappingProxyType({k: v for k, v in parallel_parts.items() if v}),
        peak_event=peak_event,
        phase_peak_events=MappingProxyType(phase_peak_events),
    )


def _bytes_of(counter: StorageLifeCounter, tensors: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        for life in counter.lives_of(t):  # a sparse tensor: its indices and values
            if id(life) not in seen:
                seen.add(id(life))
                total += life.nbytes
    return total


def _events(lives: list[Life]) -> list[tuple[int, int]]:
    """Allocation (+bytes) and free (-bytes) events in time order, for the allocator's replay."""
    return [(key, nbytes) for _, key, nbytes in _timeline(lives)]


def _timeline(lives: list[Life]) -> list[tuple[int, int, int]]:
    """``(tick, key, +/-bytes)`` of every storage's birth and death, in time order (a key is the life's index)."""
    timeline: list[tuple[int, int, int]] = []
    for key, life in enumerate(lives):
        if life.nbytes <= 0:
            continue
        timeline.append((life.born, key, life.nbytes))
        if life.died is not None:
            timeline.append((life.died, key, -life.nbytes))
    timeline.sort()
    return timeline


def _step_events(counter: StorageLifeCounter) -> tuple[StepEvents, list[int]]:
    """The counted storages' births and deaths for the replay, where each phase of each step begins
    (the counter's marks, by tick), and what made each storage; and each event's tick, in order (the
    events at or before a tick: ``bisect.bisect_right(ticks, tick)``)."""
    timeline = _timeline(counter.lives)
    ticks = [tick for tick, _, _ in timeline]
    marks = tuple((bisect.bisect_right(ticks, tick), step, phase) for tick, step, phase in counter.marks)
    sources = {}
    fallback = set()
    for key, life in enumerate(counter.lives):
        if life.nbytes > 0:
            made = "adopted before the step" if life.op is None else str(life.op)
            sources[key] = f"{made}; {life.phase}; {_category(life)}"
            if life.fallback:
                fallback.add(key)
    # each thread's first cuBLAS operator (the first of its phases')
    firsts: dict[str, int] = {}
    for phase, tick in counter.blas_first.items():
        thread = cublas_thread(phase)
        firsts[thread] = min(tick, firsts.get(thread, tick))
    blas_first = tuple(bisect.bisect_right(ticks, tick) for tick in sorted(firsts.values()))
    events = StepEvents(tuple((key, nbytes) for _, key, nbytes in timeline), marks, MappingProxyType(sources), blas_first,
                        frozenset(fallback))  # fmt: skip
    return events, ticks
