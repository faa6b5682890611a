"""The fake training step's ingredients: a fake mode, a fake copy of the model, inputs, an optimizer.

Nothing here allocates real memory: parameters, buffers and inputs are fake
tensors with the shapes, strides and types of the real ones. A model given built
is copied (its parameters replaced by fake ones, ties kept); the user's model is
never changed. A model given as a function is built inside the fake mode.

Where the target device cannot run autograd here (a CUDA estimate on a machine
without a GPU: torch's autograd engine needs the device's runtime), the step runs
on fake CPU tensors and the choices that differ on the device are made as the
device would make them: optimizers take their ``foreach`` path, as they do by
default on CUDA.

Example::

    >>> import torch
    >>> mode = fake_mode()
    >>> real = torch.nn.Linear(1000, 1000)
    >>> with mode:
    ...     model = fake_model(real, torch.device("cpu"), mode)
    >>> type(model.weight).__name__, model.weight.shape, real.weight.abs().sum() > 0
    ('FakeTensor', torch.Size([1000, 1000]), tensor(True))
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten

from ..measure.accounting import part_of_a_storage
from ..measure.trees import tensors_in
from .conv_workspace import memory_format
from .draws import HOST_VALUE_NUMEL, SMALL_VALUE_NUMEL, Draws, value_sized, values_set_aside
from .scalar_overflow import check_fill_fits
from .layouts import MAKES_SPARSE, foreach_as_loop, has_other_layout, sparse_rule
from .kernel_fakes import KERNEL_RULES
from .lengths import LENGTH_RULES

__all__ = [
    "EstimateFakeMode",
    "FakeKernelRefused",
    "eager_modules",
    "fake_mode",
    "fake_model",
    "fake_like",
    "fake_inputs",
    "batch_of",
    "make_optimizer",
    "FOREACH_DEVICES",
    "HOST_VALUE_NUMEL",
]


#: Device types whose optimizers take the ``foreach`` path by default (real tensors only:
#: torch's check looks at the tensor's Python type, so fake ones would take the loop).
FOREACH_DEVICES = ("cuda", "xpu")


#: Operators the fake mode runs by a rule of the estimate's, not by torch's fake kernel: those whose
#: shapes follow a lengths tensor's values (:mod:`.lengths`), and CUDA operators torch gives no fake
#: kernel (:mod:`.kernel_fakes`). One lookup for every operator the step runs.
_OPERATOR_RULES: dict[Any, Any] = {**LENGTH_RULES, **KERNEL_RULES}


class FakeKernelRefused(RuntimeError):
    """torch's fake (meta) kernel for :attr:`func` raised a plain ``RuntimeError`` (a check stricter
    than the real kernel's, or the step's own error): the message is torch's, the operator named."""

    def __init__(self, func: Any, err: RuntimeError) -> None:
        super().__init__(str(err))
        self.func = func


class EstimateFakeMode(FakeTensorMode):
    """torch's fake mode, with the estimate's rules for what it lacks.

    - Sparse tensors and ``_foreach_*`` operators over them hold the memory their real
      kernels do (:mod:`.layouts`).
    - Operators whose output shapes follow a lengths tensor's values (CTC loss) make them
      from the values, or from the padded targets' width (:mod:`.lengths`).
    - While :attr:`draws` is on (the step, see :mod:`.draws`), tiny tensors made from
      nothing get real values, so a branch on a random draw (LayerDrop) is taken as a
      real step takes it; the values read are noted in ``draws.reads``. Integer and boolean
      tensors made from host data (a mask from numpy) keep theirs up to
      :data:`HOST_VALUE_NUMEL` elements, so indexing by them has its real shape.
    - While the inputs are made (:meth:`.Draws.inputs`), what the user fixed in them (a mask of
      ones, position ids) keeps its values up to :data:`HOST_VALUE_NUMEL` elements.
    - A fill whose number overflows its tensor's dtype raises the real kernel's error
      (:mod:`.scalar_overflow`): the step fails for real too.

    ``allow_fallback_kernels=False``: an operator without a fake implementation
    raises instead of running its real kernel on made-up data (which would allocate
    real memory, on the GPU for a CUDA extension). Real tensors met inside (a
    constant kept in a closure) are converted.
    """

    def __init__(self, kernels: str | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True, allow_fallback_kernels=False)
        self.draws = Draws()
        #: The device type whose kernels the sparse rules follow (``"cuda"`` for fake CPU tensors
        #: standing in for CUDA ones); ``None``: the tensors' own.
        self.kernels = kernels

    def may_turn_const(self, t: torch.Tensor) -> bool:
        # while the step runs, values computed from values stay up to the size draws get them;
        # integer and boolean ones (masks and indices made from host data, as wav2vec2's time
        # mask from numpy) up to HOST_VALUE_NUMEL, so that indexing by them has its real shape
        if self.draws.active or self.draws.making_inputs:
            return value_sized(t) and not self.is_our_fake(t) and t.device.type != "meta"
        return super().may_turn_const(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        check_fill_fits(func, args, kwargs)  # a fill that overflows its dtype fails here as on the device
        by_rule = _OPERATOR_RULES.get(func)
        if by_rule is not None:
            with self:
                return by_rule(args, kwargs)
        if func in MAKES_SPARSE or has_other_layout(args) or has_other_layout(kwargs.values()):
            name = getattr(getattr(func, "_schema", None), "name", "")
            rule = sparse_rule(func, self.kernels or _device_type(args)) or (
                (lambda a, k: foreach_as_loop(func, a, k)) if name.startswith("aten::_foreach_") else None
            )
            if rule is not None:
                with self:
                    out = rule(args, kwargs)
                if out is not NotImplemented:
                    return out
        fallback = super().__torch_dispatch__
        if kwargs.get("layout") not in (None, torch.strided) or func in _MAKES_OTHER_LAYOUT:
            # torch's constant propagation fails on a sparse result (it has no storage to
            # invalidate), so a sparse tensor made from tensors with values is made without them
            with values_set_aside(tree_flatten((args, kwargs))[0]):
                return fallback(func, types, args, kwargs)
        try:
            if self.draws.active or self.draws.making_inputs or self.draws.kept_elsewhere:
                return self.draws.dispatch(self, func, args, kwargs, lambda f, a, k: fallback(f, types, a, k))
            return fallback(func, types, args, kwargs)
        except RuntimeError as err:
            if type(err) is not RuntimeError:  # the fake mode's own refusals, already named
                raise
            raise FakeKernelRefused(func, err) from err


#: operators that make a tensor of another layout than strided without a ``layout`` argument
_MAKES_OTHER_LAYOUT = frozenset(
    getattr(getattr(torch.ops.aten, name), overload)
    for name, overload in (("_to_sparse", "default"), ("_to_sparse", "sparse_dim"), ("_to_sparse_csr", "default"), ("_to_sparse_csc", "default"))
    if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), overload)
)


def _device_type(args: tuple) -> str:
    """The device type of a tensor among ``args`` (an operator's tensors share one); ``"cpu"`` if none."""
    found = tensors_in(args, limit=1)
    return found[0].device.type if found else "cpu"


def fake_mode(kernels: str | None = None) -> EstimateFakeMode:
    """A fake mode for the estimate's step (:class:`EstimateFakeMode`); ``kernels``: the device
    type whose kernels its sparse rules follow (default: the tensors' own)."""
    return EstimateFakeMode(kernels)


def fake_like(tensor: torch.Tensor, device: torch.device, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A fake tensor (call inside the fake mode) with ``tensor``'s type and strides, on ``device``.

    With ``shape`` given it is dense with that shape, in ``tensor``'s memory format
    (``channels_last`` images stay so: cuDNN's layout, and what it copies, follow it).
    Made by a factory, not ``.to()``: moving to a device this machine lacks needs
    that device's runtime.
    """
    if shape is not None:
        layout = torch.contiguous_format
        if len(shape) == tensor.dim() in (4, 5) and memory_format(tensor) == "channels_last":
            layout = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        return torch.empty(shape, dtype=tensor.dtype, device=device, memory_format=layout)
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=device)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    dev = tensor.device
    return isinstance(tensor, FakeTensor) and dev.type == device.type and (dev.index or 0) == (device.index or 0)


def walk_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model``'s modules with their names, in ``named_modules()``'s order, each once, read from
    the modules' own ``_modules`` rather than by ``named_modules()``: a module may act when walked so
    (peft's LoRA over ``nn.MultiheadAttention`` registers its weights again, as new parameters: inside
    the fake mode, fake ones on the user's model), and the user's model is only read.

    Example::

        >>> [name for name, _ in walk_modules(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU())))]
        ['', '0', '1', '1.0']
    """
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((name, module))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return out


def fake_model(model: nn.Module, device: torch.device, mode: FakeTensorMode, *, owned: bool = False) -> nn.Module:
    """``model`` with fake parameters and buffers on ``device`` (call inside ``mode``).

    ``owned``: the model was built for the estimate (see :mod:`.build`): one whose
    tensors are already fake and on ``device`` is returned as it is, and tensors it
    keeps as plain attributes (not registered) are made fake on ``device`` too. Any other is copied with
    ``copy.deepcopy``, each parameter and buffer replaced by a fake one on
    ``device`` (one per storage, so tied weights stay tied); ``requires_grad`` is
    kept; tensors it keeps as plain attributes (a positional table assigned as
    ``self.pe = ...``) become fake tensors on their own device, where
    ``model.to(device)`` leaves them. The user's model is never changed: it is walked by
    :func:`walk_modules`, which calls none of its methods.
    """
    modules = [module for _, module in walk_modules(model)]
    tensors = [t for m in modules for store in (m._parameters, m._buffers) for t in store.values() if t is not None]
    if owned and all(_on(t, device) for t in tensors):
        return model
    memo: dict[int, Any] = {}
    by_storage: dict[Any, torch.Tensor] = {}
    bases: dict[Any, torch.Tensor] = {}  # a larger storage that tensors are parts of, made once
    for module in modules:
        # tensors kept as plain attributes: a model built for the estimate's follow it to the device;
        # a user's stay on their own device, as model.to(device) leaves them (deepcopy of a real
        # tensor inside the fake mode fails, so each is made fake here)
        plain = _plain_tensors(module)
        for store in (module._parameters, module._buffers, plain):
            for t in store.values():
                if t is None or id(t) in memo:
                    continue
                to = device if owned or store is not plain else t.device
                if _on(t, to):
                    memo[id(t)] = t
                    continue
                key = _storage_identity(t)
                fake: torch.Tensor | None = by_storage.get(key) if key is not None else None
                if fake is None or fake.device != to:
                    fake = _fake_part(t, to, bases, key[0]) if key is not None and part_of_a_storage(t) else fake_like(t, to)
                    if key is not None:
                        by_storage[key] = fake
                    if store is module._buffers and _small_integers(t) and fake.device.type == "cpu":
                        # a size or index table the forward may read in Python (peft's FroD: .tolist(),
                        # BatchNorm's num_batches_tracked under momentum=None); on the CPU and emulated
                        # only: a value beside a fake CUDA tensor routes every operator through the
                        # device-values path, not yet checked on a GPU for every BatchNorm net
                        with no_dispatch():
                            value = t.detach().to("cpu", copy=True)
                        fake = mode.draws.placed(mode, fake, value) if isinstance(mode, EstimateFakeMode) else fake
                if isinstance(t, nn.Parameter):
                    fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                memo[id(t)] = fake
    return copy.deepcopy(model, memo)


def _small_integers(t: torch.Tensor) -> bool:
    """A real integer buffer of at most ``SMALL_VALUE_NUMEL`` elements whose value the fake copy keeps."""
    return (not isinstance(t, FakeTensor) and t.device.type != "meta" and t.layout is torch.strided
            and not (t.is_floating_point() or t.is_complex()) and 0 < t.numel() <= SMALL_VALUE_NUMEL)


def _fake_part(t: torch.Tensor, device: torch.device, bases: dict[Any, torch.Tensor], anchor: Any) -> torch.Tensor:
    """``t``, a part of a larger storage (a slice kept as a buffer or a parameter,
    ``torch.hann_window(n)``'s ``n`` of ``n + 1`` values), as a fake view at its offset and strides
    of a fake storage as large as its own: one per storage, shared by the storage's other parts."""
    base = bases.get(anchor)
    if base is None:
        nbytes = t.untyped_storage().nbytes()
        base = bases[anchor] = torch.empty(-(-nbytes // t.element_size()), dtype=t.dtype, device=device)
    if base.dtype != t.dtype:
        return fake_like(t, device)  # parts of one storage in two dtypes: each its own
    return base.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _plain_tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    """The tensors ``module`` keeps as plain attributes, alone or in lists, tuples and dicts
    (torchvision's ``AnchorGenerator`` keeps its ``cell_anchors`` in a list), by ``id``.
    ``copy.deepcopy`` of a real tensor inside the fake mode fails, so each must be in the memo."""
    found: dict[int, torch.Tensor] = {}
    pending: list[tuple[Any, int]] = [
        (v, 0) for k, v in vars(module).items() if k not in ("_parameters", "_buffers", "_modules")
    ]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, torch.Tensor):
            found[id(value)] = value
        elif depth < 4 and isinstance(value, (list, tuple)):
            pending.extend((v, depth + 1) for v in value)
        elif depth < 4 and isinstance(value, dict):
            pending.extend((v, depth + 1) for v in value.values())
    return found


def _compile_wrapped(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile(module)`` wrapper (Dynamo's ``OptimizedModule``) holds, else ``None``."""
    return module._modules.get("_orig_mod") if type(module).__name__ == "OptimizedModule" else None


def eager_modules(model: nn.Module) -> nn.Module:
    """The step's own copy of a model with every ``torch.compile`` taken off, in place: its eager forward.

    Under the estimate's counting mode torch 2.14 runs compiled frames eagerly by itself,
    so the figures are those of the eager step either way. Taken off here, Dynamo stays out
    of the fake step on every torch: torch 2.4 would compile the fake step with a fake mode
    of its own and fail, and torch 2.13 marks a frame it skipped under a dispatch mode to be
    skipped for good, so the user's own compiled model would run eagerly ever after.

    Example::

        >>> inner = torch.nn.Linear(2, 2)
        >>> model = torch.nn.Sequential(torch.compile(inner))
        >>> model.compile()
        >>> eager = eager_modules(model)
        >>> eager[0] is inner, eager._compiled_call_impl is None
        (True, True)
    """
    while (inner := _compile_wrapped(model)) is not None:
        model = inner
    pending = [model]
    while pending:
        module = pending.pop()
        if getattr(module, "_compiled_call_impl", None) is not None:  # nn.Module.compile()
            module._compiled_call_impl = None
        for name, child in module._modules.items():
            while child is not None and (inner := _compile_wrapped(child)) is not None:
                child = module._modules[name] = inner
            if child is not None:
                pending.append(child)
    return model


def _storage_identity(t: torch.Tensor) -> Any:
    """What makes two tensors one piece of memory: same storage, offset, shape and strides."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        anchor: Any = id(storage)
    else:
        anchor = (storage.data_ptr(), t.device.type, t.device.index)
    return (anchor, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def batch_of(inputs: Any) -> int | None:
    """The batch size of example inputs: the first dimension of the first tensor."""
    for t in _tensors(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def fake_inputs(example: Any, batch_size: int | None, device: torch.device, mode: EstimateFakeMode | None = None) -> Any:
    """Fake inputs on ``device`` (call inside the fake mode) for a batch of ``batch_size``.

    ``example`` is a tensor, a tuple, list or dict of them (or other values, passed
    on), or a function ``batch_size -> inputs`` (called here, so big inputs cost
    nothing). Tensors of a template whose first dimension is the template's batch
    get ``batch_size`` there; the others keep their shapes.

    With ``mode`` given, what the user fixed keeps its values (:meth:`.Draws.inputs`), on the CPU
    and on a GPU alike (:meth:`.Draws.placed`): a function's integer and boolean tensors made
    without randomness, tensors a fill factory made, and a template's integer and boolean
    tensors, their rows repeated to ``batch_size``.
    """
    values = mode.draws.inputs() if mode is not None else contextlib.nullcontext()
    with values:
        if callable(example) and not isinstance(example, torch.Tensor):
            made = example(batch_size) if batch_size is not None else example()

            def place(t: torch.Tensor) -> torch.Tensor:
                if _on(t, device):
                    return t
                moved = fake_like(t, device)
                if mode is None or device.type == "cpu":  # on the CPU the function's tensors already carry theirs
                    return moved
                # made on the CPU and sent to the device, as a user's loop sends its batch: the value
                # the function gave it (a mask of ones) goes along
                value = getattr(t, "constant", None) if isinstance(t, FakeTensor) else _template_values(t, None)
                return mode.draws.placed(mode, moved, value)

            return _map(made, place)
        template_batch = batch_of(example)

        def resize(t: torch.Tensor) -> torch.Tensor:
            rows = batch_size if batch_size is not None and t.dim() > 0 and t.shape[0] == template_batch else None
            kept = _template_values(t, rows) if mode is not None and not isinstance(t, FakeTensor) else None
            if kept is not None and device.type == "cpu":  # made by an operator, as every input is: the step counts it
                return mode.draws.host_value(mode, kept).clone()
            made = fake_like(t, device, tuple(t.shape) if rows is None else (rows, *t.shape[1:]))
            return made if kept is None else mode.draws.placed(mode, made, kept)

        return _map(example, resize)


def _template_values(t: torch.Tensor, rows: int | None) -> torch.Tensor | None:
    """A template's integer or boolean tensor, on the CPU, with its rows repeated to ``rows`` (a
    batch of another size has the template's masks and positions, row after row), else ``None``.
    A template already on the GPU (a real tensor: its device is here) is read back to the CPU."""
    if isinstance(t, FakeTensor) or t.device.type == "meta" or t.layout is not torch.strided or t.is_floating_point() or t.is_complex():
        return None
    numel = t.numel() if rows is None or t.shape[0] == 0 else t.numel() // t.shape[0] * rows
    if numel > HOST_VALUE_NUMEL or (rows is not None and t.shape[0] == 0):
        return None
    with no_dispatch():
        host = t.detach().cpu() if t.device.type != "cpu" else t.detach()
        if rows is None:
            return host.clone()
        return host[torch.arange(rows) % t.shape[0]].contiguous()


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(item, fn) for item in obj)
    if isinstance(obj, list):
        return [_map(item, fn) for item in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def make_optimizer(factory: Callable[..., torch.optim.Optimizer], model: nn.Module, device_type: str) -> torch.optim.Optimizer:
    """``factory(model.parameters())``, taking the path the real device would take by default.

    torch picks ``foreach`` kernels on CUDA only for plain tensors: fake parameters
    would take the per-parameter loop, whose temporaries are smaller. Groups that
    leave ``foreach`` to torch get what torch gives real tensors on ``device_type``.
    """
    optimizer = factory(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a callable that takes the parameters and returns a torch.optim.Optimizer "
            f"(torch.optim.AdamW, functools.partial(torch.optim.SGD, lr=0.1)); it returned {type(optimizer).__name__}"
        )
    if device_type in FOREACH_DEVICES:
        for group in optimizer.param_groups:
            # torch itself leaves foreach off for a tensor learning rate that is not capturable
            tensor_lr = isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable")
            if "foreach" in group and group["foreach"] is None and not group.get("fused") and not group.get("differentiable") and not tensor_lr:
                group["foreach"] = True
    return optimizer
