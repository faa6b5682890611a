"""Bytes held by a model and its optimizers, computed from the tensors themselves.

Pure functions over modules, parameters and optimizers; no device counters.
A tensor's bytes are ``numel() * element_size()``; a sparse tensor's (COO, CSR,
CSC, BSR, BSC: ``nn.Embedding(sparse=True)`` gradients) are the bytes of its index
and value storages. Two tensors over the same memory (tied weights, views) count
once, under the first name met; tensors that are parts of a larger storage (a flat
buffer of weights, a slice kept as a buffer) hold all of it, once.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(4, 3)                # 12 + 3 float32 values
    >>> params = unique_parameters(model, torch.device("cpu"))
    >>> dict(weight_bytes(params))
    {'weight': 48, 'bias': 12}
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

__all__ = [
    "PLAIN_TENSORS",
    "non_overlapping_and_dense",
    "tensor_bytes",
    "storage_parts",
    "storage_holder",
    "parts_on",
    "allocation_bytes",
    "same_device",
    "DeviceMatch",
    "unique_parameters",
    "weight_bytes",
    "gradient_bytes",
    "GradientSizes",
    "buffer_bytes",
    "buffers_total",
    "optimizer_state_tensors",
    "optimizer_state_bytes",
    "optimizer_holds_any",
    "part_of_a_storage",
]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: The types whose strided instances are their own one piece of memory (:func:`storage_parts`),
#: for hot paths that skip the helpers for them (``type(t) in PLAIN_TENSORS``; subclasses such
#: as DTensor take the helpers).
PLAIN_TENSORS = _PLAIN_TENSORS

_COMPRESSED_ROWS = (torch.sparse_csr, torch.sparse_bsr)
_COMPRESSED_COLUMNS = (torch.sparse_csc, torch.sparse_bsc)


def storage_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold a tensor's memory: itself, a sparse tensor's
    indices and values, or a wrapper subclass's inner tensors.

    A wrapper subclass (``DTensor``, any ``__tensor_flatten__`` subclass) has a storage
    of its own that holds no data and claims the bytes of its *global* shape: a DTensor
    sharded over two ranks would count twice its rank's memory. Its memory is its inner
    tensors' (a DTensor's local shard).

    Example::

        >>> import torch
        >>> sparse = torch.eye(3).to_sparse()             # COO: indices and values
        >>> [tuple(p.shape) for p in storage_parts(sparse)]
        [(2, 3), (3,)]
    """
    if type(tensor) not in _PLAIN_TENSORS:
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = flatten()
            inner = (getattr(tensor, name) for name in names)
            return tuple(part for t in inner if isinstance(t, torch.Tensor) for part in storage_parts(t))
    layout = tensor.layout
    if layout is torch.strided:
        return (tensor,)
    if layout is torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if layout in _COMPRESSED_ROWS:
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    if layout in _COMPRESSED_COLUMNS:
        return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    return (tensor,)


def storage_holder(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s memory: a wrapper subclass's one inner
    tensor (a DTensor's local shard), else ``tensor`` itself.

    Example::

        >>> import torch
        >>> t = torch.ones(2)
        >>> storage_holder(t) is t
        True
    """
    if type(tensor) not in _PLAIN_TENSORS:
        parts = storage_parts(tensor)
        if len(parts) == 1:
            return parts[0]
    return tensor


def parts_on(tensors: Iterable[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    """The pieces of memory (:func:`storage_parts`) of ``tensors`` that live on ``device``.

    Example::

        >>> import torch
        >>> [tuple(p.shape) for p in parts_on([torch.eye(3).to_sparse(), torch.ones(2)], torch.device("cpu"))]
        [(2, 3), (3,), (2,)]
    """
    for tensor in tensors:
        for part in storage_parts(tensor):
            if same_device(part, device):
                yield part


def _sparse_bytes(tensor: torch.Tensor) -> int:
    return sum(part.untyped_storage().nbytes() for part in storage_parts(tensor))


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements: ``numel() * element_size()``.

    For a DTensor (FSDP2, tensor parallel) this is the local shard: what this
    rank really holds. For a sparse tensor, the bytes of its index and value
    storages.
    """
    if type(tensor) in _PLAIN_TENSORS:  # the hot path: no attribute probing
        # ``nbytes`` raises for COO and is the dense size for CSR: neither is what a sparse tensor holds.
        return tensor.nbytes if tensor.layout is torch.strided else _sparse_bytes(tensor)
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        tensor = local
    if tensor.layout is not torch.strided:
        return _sparse_bytes(tensor)
    return tensor.numel() * tensor.element_size()


def allocation_bytes(tensor: torch.Tensor) -> int:
    """Bytes of memory the tensor holds: its elements, or its storage when that is smaller.

    An expanded view (``torch.ones(()).expand(1000)``, as autograd makes for
    the gradient of a sum) has 1000 elements over 4 bytes of storage.
    """
    if tensor.layout is not torch.strided:
        return _sparse_bytes(tensor)
    try:
        return min(tensor_bytes(tensor), tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return tensor_bytes(tensor)


class DeviceMatch(dict):
    """Whether a tensor on the device given as the key lives on ``device`` (an index-less device
    matches any index): ``match[tensor.device]``.

    ``torch.device.type`` makes a new string at each read (about 0.8 us, more than the rest of a
    saved tensor's check); a dict lookup of the device object costs a sixth of that. Each device
    met is compared once, then remembered (there are only a few).

    Example::

        >>> match = DeviceMatch(torch.device("cpu"))
        >>> match[torch.ones(1).device], match[torch.device("meta")]
        (True, False)
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __missing__(self, dev: torch.device) -> bool:
        device = self.device
        on = self[dev] = dev.type == device.type and (device.index is None or dev.index in (None, device.index))
        return on


#: one :class:`DeviceMatch` per device asked about by :func:`same_device`
_MATCHES: dict[torch.device, DeviceMatch] = {}


def same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """True when ``tensor`` lives on ``device`` (an index-less device matches any index)."""
    match = _MATCHES.get(device)
    if match is None:
        match = _MATCHES[device] = DeviceMatch(device)
    return match[tensor.device]


def _memory_key(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Identifies the memory a tensor covers: start address, byte count, device index.

    A sparse tensor has no ``data_ptr()``: its values' address stands for it.
    """
    local = getattr(tensor, "_local_tensor", tensor)
    first = storage_parts(local)[-1]
    return (first.data_ptr(), tensor_bytes(local), local.device.index or 0)


def unique_parameters(
    model: torch.nn.Module, device: torch.device
) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's named parameters on ``device``, each piece of memory once.

    ``named_parameters()`` already drops a Parameter registered under two
    names; this also drops distinct Parameters that cover the same memory.
    """
    seen: set[tuple[int, int, int]] = set()
    result = []
    for name, param in model.named_parameters():
        if param.device.type == "meta" or not same_device(param, device):
            continue
        key = _memory_key(param)
        if key[1] and key in seen:
            continue
        seen.add(key)
        result.append((name, param))
    return result


def weight_bytes(params: Sequence[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, int]]:
    """``(name, bytes)`` of each parameter, in order.

    Parameters that are parts of one larger storage hold all of it (a flat buffer of weights,
    a slice kept as a parameter): see :func:`_whole_storages`.

    Example::

        >>> flat = torch.zeros(10)                       # one storage of 40 B, two parameters in it
        >>> a, b = torch.nn.Parameter(flat[:3]), torch.nn.Parameter(flat[5:7])
        >>> weight_bytes([("a", a), ("b", b)])
        [('a', 32), ('b', 8)]
    """
    return [(name, n) for (name, _), n in zip(params, _held_bytes([p for _, p in params]))]


def gradient_bytes(params: Sequence[tuple[str, torch.nn.Parameter]]) -> list[int]:
    """Bytes of each parameter's ``.grad`` (0 where it is ``None``), in order.

    Gradients that are parts of one larger storage hold all of it: see :func:`_whole_storages`.
    """
    return _held_bytes([p.grad for _, p in params])


def _held_bytes(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """Bytes of each tensor (0 for ``None``), in order; tensors that are parts of one larger
    storage hold all of it, once (:func:`_whole_storages`)."""
    sizes = [0 if t is None else tensor_bytes(t) for t in tensors]
    views = [i for i, t in enumerate(tensors) if part_of_a_storage(t)]
    if views:
        _whole_storages(sizes, tensors, views)
    return sizes


def non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory once each, in some order of its dims
    (``TensorImpl::is_non_overlapping_and_dense``), read from its shape and strides alone.

    Example::

        >>> base = torch.empty(3, 8, device="meta")
        >>> non_overlapping_and_dense(base.t()), non_overlapping_and_dense(base[:, ::2])
        (True, False)
    """
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(tensor.shape, tensor.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def part_of_a_storage(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` (a plain strided one) covers other than its whole storage: a part of a
    larger storage (a slice, a member of a flat buffer), or an expanded view of a smaller one."""
    return (
        tensor is not None
        and type(tensor) in _PLAIN_TENSORS
        and tensor.layout is torch.strided
        and tensor.device.type != "meta"
        and tensor.untyped_storage().nbytes() != tensor.nbytes
    )


def _whole_storages(sizes: list[int], tensors: Sequence[torch.Tensor | None], views: Sequence[int]) -> None:
    """Tensors at ``views`` cover part of their storage (found by its size: ``.grad`` has no
    ``_base``), which stays alive whole while any of them does.

    Autograd splits one gradient among parameters used through a concatenation (timm's EVA and
    BEiT concatenate ``q_bias``, zeros and ``v_bias`` into one ``qkv`` bias: the q and v gradients
    are parts of the 3x-long gradient), and ``AccumulateGrad`` keeps each part as ``.grad``; DDP's
    ``gradient_as_bucket_view`` makes every gradient a part of its bucket. Weights and buffers may
    be parts too: a flat buffer of parameters, a slice registered as a buffer
    (``torch.hann_window(n)`` is the first ``n`` of ``n + 1`` values). The storage is counted once:
    each part keeps its own bytes, and the first of a storage's parts also carries what none of
    them covers; parts that overlap, or an expanded one, are cut so that together they are the
    storage. ``sizes`` is changed in place."""
    groups: dict[tuple[int, str], list[int]] = {}
    storages: dict[tuple[int, str], int] = {}
    for i in views:
        storage = tensors[i].untyped_storage()  # type: ignore[union-attr]
        key = (storage.data_ptr(), str(storage.device))
        groups.setdefault(key, []).append(i)
        storages[key] = storage.nbytes()
    for key, members in groups.items():
        covered = sum(sizes[i] for i in members)
        if covered <= storages[key]:
            sizes[members[0]] += storages[key] - covered
            continue
        left = storages[key]
        for i in members:
            sizes[i] = min(sizes[i], left)
            left -= sizes[i]


class GradientSizes:
    """:func:`gradient_bytes` of a fixed parameter list, made cheap for the hot path (twice per backward).

    A dense parameter's gradient is dense or sparse COO (autograd allows no other
    layout for it), and ``nbytes`` raises for COO: so a dense parameter's
    gradient needs no layout check. Only when a parameter itself is sparse is
    every gradient checked.

    Example::

        >>> import torch
        >>> emb = torch.nn.Embedding(10, 4, sparse=True)
        >>> emb(torch.tensor([1, 1, 2])).sum().backward()     # a COO gradient: 3 indices, 3 rows
        >>> GradientSizes(list(emb.named_parameters()))() == [3 * 8 + 3 * 4 * 4]
        True
    """

    __slots__ = ("_params", "_named", "_dense")

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self._named = list(params)
        self._params = [p for _, p in self._named]
        self._dense = all(p.layout is torch.strided for p in self._params)

    def __call__(self) -> list[int]:
        if not self._dense:
            return gradient_bytes(self._named)
        sizes = []
        append = sizes.append
        views = None
        for p in self._params:
            grad = p.grad
            if grad is None:
                append(0)
            elif type(grad) is not torch.Tensor:  # a DTensor: its local shard
                append(tensor_bytes(grad))
            else:
                try:
                    n = grad.nbytes
                except RuntimeError:  # "nbytes is not defined for sparse tensors"
                    append(tensor_bytes(grad))
                    continue
                append(n)
                if grad.untyped_storage().nbytes() != n:  # part of a larger storage (rare; 80 ns to ask)
                    if views is None:
                        views = []
                    views.append(len(sizes) - 1)
        if views is not None:
            _whole_storages(sizes, [p.grad for p in self._params], views)
        return sizes


def buffer_bytes(model: torch.nn.Module, device: torch.device) -> list[tuple[str, int]]:
    """``(name, bytes)`` of the model's registered buffers on ``device``, each once."""
    return list(_unique_buffer_bytes(model.named_buffers(), device))


def buffers_total(buffers: Iterable[torch.Tensor | None], device: torch.device) -> int:
    """Bytes of ``buffers`` on ``device``, each piece of memory once (as :func:`buffer_bytes`
    counts them), from tensors already listed: no walk of the module tree.

    Example::

        >>> bn = torch.nn.BatchNorm1d(4)   # running mean and variance (16 B each), a step count (8 B)
        >>> buffers_total([*bn.buffers(), bn.running_mean], torch.device("cpu"))
        40
    """
    return sum(n for _, n in _unique_buffer_bytes(((None, b) for b in buffers), device))


def _unique_buffer_bytes(
    named: Iterable[tuple[Any, torch.Tensor | None]], device: torch.device
) -> Iterator[tuple[Any, int]]:
    seen: set[tuple[int, int, int]] = set()
    names: list[Any] = []
    kept: list[torch.Tensor] = []
    for name, buf in named:
        if buf is None or buf.device.type == "meta" or not same_device(buf, device):
            continue
        key = _memory_key(buf)
        if key[1] and key in seen:
            continue
        seen.add(key)
        names.append(name)
        kept.append(buf)
    yield from zip(names, _held_bytes(kept))  # parts of one larger storage hold all of it


def optimizer_state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizers' ``state`` (moments, step counters, ...)."""
    for opt in optimizers:
        for per_param in list(opt.state.values()):
            if isinstance(per_param, dict):
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        yield value
            elif isinstance(per_param, torch.Tensor):
                yield per_param


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> int:
    """Bytes of the optimizers' state tensors on ``device``, each piece of memory once.

    Adam's ``step`` counters live on the CPU unless ``capturable`` or
    ``fused`` is set, so on a GPU they do not count.
    """
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for tensor in optimizer_state_tensors(optimizers):
        if not same_device(tensor, device):
            continue
        key = _memory_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def optimizer_holds_any(optimizer: torch.optim.Optimizer, param_ids: set[int]) -> bool:
    """True when the optimizer steps at least one parameter whose ``id`` is in ``param_ids``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in param_ids:
                return True
    return False
