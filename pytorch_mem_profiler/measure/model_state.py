"""The model a meter measures: its parameters, weights, buffers and gradients on the device measured.

A :class:`ModelState` lists the model's parameters (each piece of memory once, those on the
device measured), counts their weights and the model's buffers, and names the gradients'
sizes. All of it changes only when the model does, so it is counted when the meter is made and
again at :meth:`ModelState.refresh` (each epoch's end, or the model moved), never per
iteration; a watched iteration only checks that no module replaced a buffer
(:meth:`ModelState.recount_replaced_buffers`). What every record carries of it is one
:class:`ModelFigures`, the same object until the model changes.

It also knows where the model is: the device given, or the one the model's tensors are on
(each rank's own under torch.distributed), which it follows when the model moves
(:meth:`ModelState.moved`).

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 2), torch.nn.BatchNorm1d(2))
    >>> state = ModelState(model)
    >>> state.device, state.parameter_names
    (device(type='cpu'), ['0.weight', '0.bias', '1.weight', '1.bias'])
    >>> state.figures.weights == (8 * 2 + 2 + 2 + 2) * 4  # float32: 4 bytes each
    True
    >>> state.figures.buffers  # running mean and variance (2 floats each), the batch count (an int64)
    24
    >>> dict(state.gradients_by_name([64, 8, 0, 8]))  # sizes in parameter order, in bytes
    {'0.weight': 64, '0.bias': 8, '1.weight': 0, '1.bias': 8}
    >>> state.moved() is None  # still where it was
    True
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import torch

from .accounting import buffer_bytes, buffers_total, unique_parameters, weight_bytes
from .data_parallel import ddp_gradient_bucket_bytes
from .devices import rank_device, resolve_device

__all__ = ["ModelFigures", "ModelState", "model_device"]

#: no gradient sizes named yet
_NO_GRADIENTS: Mapping[str, int] = MappingProxyType({})


class ModelFigures(NamedTuple):
    """What every record carries of the model, unchanged while the model does not change (bytes)."""

    device: str
    weights: int
    weights_by_name: Mapping[str, int]
    buffers: int
    ddp_gradient_buckets: int | None
    rank: int | None
    model_name: str


def model_device(model: torch.nn.Module, rank_info: Any = None) -> torch.device:
    """The device ``model`` is on: this rank's own where ``rank_info`` (a
    :class:`~pytorch_mem_profiler.distributed.RankInfo`) is given, else that of its first tensor.

    Example::

        >>> model_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    if rank_info is not None:
        return rank_device(model, rank_info)
    return resolve_device(model)


class ModelState:
    """A model's parameters, weights, buffers and gradient sizes on one device.

    Args:
        model: the model being trained.
        device: the device measured; ``None``: the model's (:func:`model_device`), followed
            when the model moves.
        rank_info: this process's rank under torch.distributed (``None``: one process); the
            records then carry the rank and the size of DDP's gradient buckets.

    Attributes:
        model: the model.
        rank_info: as given.
        device: the device measured.
        params: ``(name, parameter)`` of each parameter counted, each piece of memory once.
        figures: what every record carries of the model (:class:`ModelFigures`); another
            object once the model changed.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ModelState(model)
        >>> before = state.figures
        >>> _ = model.weight.requires_grad_(False)
        >>> state.refresh()  # the model changed: a frozen weight has no gradient
        >>> dict(state.gradients_by_name([0, 8])), state.figures is before
        ({'bias': 8}, False)
    """

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None, rank_info: Any = None) -> None:
        self.model = model
        self.rank_info = rank_info
        # A device given is the user's choice; one found is where the model was, and moves with it.
        self._follows = device is None
        self.device = device if device is not None else model_device(model, rank_info)
        self.refresh()

    @property
    def parameter_names(self) -> list[str]:
        """The names of the parameters counted, each piece of memory once."""
        return [name for name, _ in self.params]

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters counted, in :attr:`params`' order."""
        return [p for _, p in self.params]

    def refresh(self, device: torch.device | None = None) -> None:
        """Count the model again (it may have changed): parameters, weights, buffers, DDP's
        buckets; measured on ``device`` from now on where one is given (the model moved)."""
        if device is not None:
            self.device = device
        model, device = self.model, self.device
        self.params = unique_parameters(model, device)
        weights = weight_bytes(self.params)
        self._requires_grad = [p.requires_grad for _, p in self.params]
        self._last_gradient_sizes: list[int] | None = None
        self._gradients_by_name = _NO_GRADIENTS
        # which buffer tensors were counted (:meth:`recount_replaced_buffers`); None: not compared yet
        self._buffer_ids: tuple[int, ...] | None = None
        # The model's modules are listed now, their buffers read when asked (:meth:`buffers`).
        self._modules: list[torch.nn.Module] | None = None
        rank_info = self.rank_info
        self.figures = ModelFigures(
            device=str(device),
            weights=sum(n for _, n in weights),
            weights_by_name=MappingProxyType(dict(weights)),
            buffers=sum(n for _, n in buffer_bytes(model, device)),
            ddp_gradient_buckets=ddp_gradient_bucket_bytes(model, device) if rank_info is not None else None,
            rank=rank_info.rank if rank_info is not None else None,
            model_name=type(model).__name__,
        )

    def moved(self) -> torch.device | None:
        """The device the model is on now, where that is not the one measured and the model is
        followed (no device was given); ``None`` otherwise."""
        if not self._follows:
            return None
        now = model_device(self.model, self.rank_info)
        return now if now != self.device else None

    def buffers(self) -> list[torch.Tensor]:
        """The model's buffers as they are now (one reassigned since the last refresh included)."""
        # The modules are listed once per refresh, their buffers read at each call:
        # ``model.buffers()`` walks the module tree with a generator per module, most of a
        # reported per-layer iteration's bookkeeping on a 150-module model.
        modules = self._modules
        if modules is None:
            modules = self._modules = list(self.model.modules())
        return [b for m in modules for b in m._buffers.values() if b is not None]

    def recount_replaced_buffers(self) -> bool:
        """Count the buffers again where a module replaced one since; whether their bytes changed
        (:attr:`figures` is then another object).

        Assigning a tensor to a registered buffer's name in ``forward`` is how modules keep a
        cache they build lazily (timm's ConViT builds its relative positions at the first
        forward, 12 bytes at construction, 3 KB after). Only the identities are compared each
        time (a buffer replaced is a new tensor made while the old one lived); the bytes are
        counted when they changed. A buffer resized in place waits for :meth:`refresh`.
        """
        buffers = self.buffers()
        ids = tuple(map(id, buffers))
        if ids == self._buffer_ids:
            return False
        self._buffer_ids = ids
        total = buffers_total(buffers, self.device)
        if total == self.figures.buffers:
            return False
        self.figures = self.figures._replace(buffers=total)
        return True

    def gradients_by_name(self, sizes: list[int]) -> Mapping[str, int]:
        """Gradient bytes by parameter name, from ``sizes`` (one per parameter of :attr:`params`,
        in order): the trainable parameters', and a frozen one's only where it has a gradient.
        The same mapping while the sizes repeat, as they do from one iteration to the next."""
        if sizes != self._last_gradient_sizes:
            self._last_gradient_sizes = sizes
            self._gradients_by_name = MappingProxyType(
                {name: n for (name, _), n, trainable in zip(self.params, sizes, self._requires_grad) if trainable or n}
            )
        return self._gradients_by_name
