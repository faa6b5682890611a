"""Building a model from a function without its memory, while its constructor computes on small tensors.

A model given to ``estimate_memory`` as a function is built here. Constructors
compute on tensors: timm's vision transformers take their stochastic-depth rates
from ``[x.item() for x in torch.linspace(0, rate, depth)]``, Swin computes its
shifted-window masks, a rotary embedding its inverse frequencies. Built inside
the fake mode, ``.item()`` has no value to read. Built for real, a 7B-parameter
model would take 28 GB.

:class:`SmallTensorsReal` is a ``TorchFunctionMode`` for the length of the
constructor that splits tensors by size: a tensor a factory makes (``torch.empty``,
``zeros``, ``linspace``, ``arange``, ``randn``, ``Tensor.new_*`` ...) of at most
:data:`SMALL_TENSOR_BYTES` is real, on the CPU, so ``.item()``, ``.tolist()``
and Python branches on its values work; a larger one goes to the ``meta``
device, where it has a shape and no memory, and in-place initialisers
(``normal_``, ``trunc_normal_``, ``copy_``) do nothing. An operator that mixes
the two runs on ``meta``; one whose real result would exceed the size (a
mask computed from small tensors) has that result moved to ``meta``. Moves
(``.to("cuda")``, ``.cuda()``) keep a tensor where it is (the dtype and the memory
format still change: ``model.to(memory_format=torch.channels_last)``), so a constructor
that moves its tensors needs no GPU. The
random-number state is saved and restored around the build: estimating a
model leaves the process's generator where it was.

:func:`~.fake.fake_model` then makes every parameter and buffer a fake tensor
on the device the step runs on.

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rates = [x.item() for x in torch.linspace(0, 0.1, 4)]  # a constructor reading values
    ...         self.big = nn.Linear(20_000, 20_000)                        # 1.6 GB if it were real
    >>> net = build_model(Net)
    >>> net.big.weight.device.type, net.big.bias.device.type, round(net.rates[-1], 2)
    ('meta', 'cpu', 0.1)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SMALL_TENSOR_BYTES", "SmallTensorsReal", "build_model"]

#: Tensors a constructor makes of at most this many bytes are real (on the CPU); larger ones are ``meta``.
SMALL_TENSOR_BYTES = 1 << 20

_META = torch.device("meta")
_CPU = torch.device("cpu")


def _factories() -> frozenset[Any]:
    names = (
        "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange", "range",
        "linspace", "logspace", "eye", "empty_strided", "tril_indices", "triu_indices",
    )  # fmt: skip
    found = {getattr(torch, n) for n in names if hasattr(torch, n)}
    found |= {getattr(torch.Tensor, n) for n in ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")}
    return frozenset(found)


_FACTORIES = _factories()
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "meta"


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=_META)
    return out.requires_grad_(t.requires_grad) if t.is_leaf and t.requires_grad else out


class SmallTensorsReal(TorchFunctionMode):
    """Small tensors real (CPU), large ones ``meta``, while a model's constructor runs (see the module).

    Args:
        limit: the most bytes of a tensor kept real.
    """

    def __init__(self, limit: int = SMALL_TENSOR_BYTES) -> None:
        super().__init__()
        self.limit = limit

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in _MOVES and args and isinstance(args[0], torch.Tensor):
            return self._move(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in flat):
            # meta wins: a real tensor beside a meta one (a small mask applied to a large weight) goes to meta
            args, kwargs = tree_map(lambda v: _to_meta(v) if _real(v) and v.dim() > 0 else v, (args, kwargs))
        given = {id(v) for v in flat if isinstance(v, torch.Tensor)}
        out = func(*args, **kwargs)
        return tree_map(lambda v: v if id(v) in given else self._shrink(v), out)

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        probe = func(*args, **{**kwargs, "device": _META})
        if not isinstance(probe, torch.Tensor) or _storage_bytes(probe) > self.limit:
            return probe
        if isinstance(args[0] if args else None, torch.Tensor) and args[0].device.type == "meta":
            return probe  # new_* of a meta tensor stays with it
        return func(*args, **{**kwargs, "device": _CPU})

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # the tensor stays where it is; its dtype and memory format change as asked
        # (model.to(memory_format=torch.channels_last) lays each weight out channels-last)
        tensor = args[0]
        dtype, memory_format = None, kwargs.get("memory_format")
        if func is torch.Tensor.to:
            parsed = torch._C._nn._parse_to(*args[1:], **kwargs)
            dtype, memory_format = parsed[1], parsed[3]
            if isinstance(args[1] if len(args) > 1 else None, torch.Tensor):
                dtype = args[1].dtype
        if memory_format is not None and memory_format is not torch.preserve_format:
            return tensor.to(dtype=dtype or tensor.dtype, memory_format=memory_format)  # its own device
        return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)

    def _shrink(self, value: Any) -> Any:
        if _real(value) and not isinstance(value, nn.Parameter) and _storage_bytes(value) > self.limit:
            return _to_meta(value)
        return value


def build_model(factory: Callable[[], Any], *, limit: int = SMALL_TENSOR_BYTES) -> Any:
    """``factory()`` under :class:`SmallTensorsReal`, leaving the random-number state as it was."""
    with torch.random.fork_rng(devices=[]), SmallTensorsReal(limit):
        return factory()
