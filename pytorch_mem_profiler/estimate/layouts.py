"""Operators on sparse tensors, and ``_foreach_*`` operators over them, as their real kernels hold memory.

The fake mode's sparse (COO) kernels run on ``meta`` sparse tensors, which keep
shapes but not the number of stored entries: ``clone``, ``add`` and ``copy_``
of a sparse fake tensor give one with no entries, and ``mul_`` by a scalar has
no kernel at all. A sparse gradient (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``) is made by a kernel that does keep them, but
an optimizer's update of it lost them or stopped the estimate. The rules here
give each such operator the index and value tensors its CPU and CUDA kernels
make, by their code (``SparseTensorMath.cpp``, ``SparseCUDATensorMath.cu``):

- ``clone``, ``copy_``: a copy of the source's indices and values;
- ``mul``/``div`` by a scalar (or a 0-dimensional tensor): in place, nothing new, but
  CUDA's ``mul_`` makes a copy of the indices and new values and drops the old ones
  (measured on an H100, torch 2.11: SGD's momentum ``_foreach_mul_`` over sparse
  buffers); not in place, a copy of the indices and new values;
- ``add`` of a sparse tensor to a dense one (the weight's update): the dense result, in place
  or new;
- ``add`` of two sparse tensors (``buf.add_(grad)``: SGD's momentum): new
  indices and values with room for both operands' entries, ``nnz(a) + nnz(b)``
  (CUDA concatenates them; the CPU merges sorted runs into tensors of that size
  and narrows them, so on the CPU the count is exact for the first merge and an
  upper bound after); with one operand empty, a copy of the other;
- ``nn.EmbeddingBag(sparse=True)``'s gradient (``_embedding_bag_backward``): one new row
  of values per index, at the indices themselves (the meta kernel gives no entries);
- ``coalesce`` of an uncoalesced tensor: the number of entries it keeps depends
  on how many indices repeat (Adagrad coalesces each sparse gradient), so it is
  refused as a data-dependent shape, naming ``aten._coalesce``.

A ``_foreach_*`` operator (in place or not) over a list holding a tensor of
another layout than strided runs as what it is defined as, the per-tensor
operator on each index in turn (:func:`foreach_as_loop`): that is what the
real kernel does for such lists (its slow path), and each per-tensor call
takes the rule above or the fake kernel. The loop runs inside the fake mode's
handling of the one operator, so a counter watching operators sees it as the
real ``_foreach_`` call is seen: one operator.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> with fake_mode():
    ...     grad = sparse_like(torch.empty(1000, 8), torch.empty(1, 64, dtype=torch.long), torch.empty(64, 8))
    ...     buf = grad.clone()
    ...     _ = torch._foreach_mul_([buf], 0.9)
    ...     _ = buf.add_(grad)
    >>> buf._nnz(), buf._values().untyped_storage().nbytes() == 128 * 8 * 4
    (128, True)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from .operator_args import bound_arguments

__all__ = ["sparse_rule", "foreach_as_loop", "sparse_like", "has_other_layout", "MAKES_SPARSE"]

aten = torch.ops.aten


def has_other_layout(values: Any) -> bool:
    """Whether a tensor among ``values`` (or in a list among them) is not strided."""
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.layout is not torch.strided:
                return True
    return False


def sparse_like(
    template: torch.Tensor | tuple[int, ...], indices: torch.Tensor, values: torch.Tensor, coalesced: bool = False
) -> torch.Tensor:
    """A sparse COO tensor of ``template``'s size (a tensor or a shape) holding ``indices`` and
    ``values`` (no copy)."""
    shape = list(template.shape) if isinstance(template, torch.Tensor) else list(template)
    sparse_dim = indices.shape[0]
    return aten._sparse_coo_tensor_with_dims_and_tensors(
        sparse_dim,
        len(shape) - sparse_dim,
        shape,
        indices,
        values,
        dtype=values.dtype,
        layout=torch.sparse_coo,
        device=values.device,
        is_coalesced=coalesced,
    )


def _replace(target: torch.Tensor, made: torch.Tensor) -> torch.Tensor:
    """``target`` now holds ``made``'s indices and values, in place (its old ones are dropped).

    ``Tensor.data =`` swaps the sparse implementation's members (indices, values,
    entries, the coalesced flag) and keeps the object, as an in-place kernel does.
    """
    target.data = made
    return target


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or (value.dim() == 0 and value.layout is torch.strided)


def _coo(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo


def _clone(args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if not _coo(self):
        return NotImplemented
    return sparse_like(self, self._indices().clone(), self._values().clone(), self.is_coalesced())


def _copy_(args: tuple, kwargs: dict) -> Any:
    self, src = args[0], args[1]
    if not (_coo(self) and _coo(src)):
        return NotImplemented
    if self is src:
        return self
    values = src._values().to(dtype=self.dtype, copy=True)
    return _replace(self, sparse_like(src, src._indices().clone(), values, src.is_coalesced()))


def _scaled(inplace: bool, op: Callable[..., torch.Tensor]) -> Callable[[tuple, dict], Any]:
    """``mul``/``div`` of a sparse tensor by a scalar: its values scaled, in place or into new ones."""

    def rule(args: tuple, kwargs: dict) -> Any:
        self, other = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if not _coo(self) or not _is_scalar(other):
            return NotImplemented
        rest = {k: v for k, v in kwargs.items() if k != "other"}
        if inplace:
            op(self._values(), other, **rest)  # a strided fake tensor in place: no memory
            return self
        return sparse_like(self, self._indices().clone(), op(self._values(), other, **rest), self.is_coalesced())

    return rule


def _scaled_anew(op: Callable[..., torch.Tensor]) -> Callable[[tuple, dict], Any]:
    """CUDA's ``mul_`` of a sparse tensor by a scalar: a copy of the indices and new values (in
    that order) take the old ones' place, as ``mul`` into a new tensor would make them."""
    anew = _scaled(False, op)

    def rule(args: tuple, kwargs: dict) -> Any:
        made = anew(args, kwargs)
        return made if made is NotImplemented else _replace(args[0], made)

    return rule


def _sum(inplace: bool, kernels: str = "cpu") -> Callable[[tuple, dict], Any]:
    """``add`` of two sparse tensors: new indices and values with room for both operands' entries
    (``kernels``: the device type whose kernel runs: only the CPU's merge keeps a result coalesced)."""

    def rule(args: tuple, kwargs: dict) -> Any:
        self, other = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if not _coo(other) or not isinstance(self, torch.Tensor):
            return NotImplemented
        dtype = self.dtype if inplace else torch.promote_types(self.dtype, other.dtype)
        if self.layout is torch.strided:
            # dense + sparse: the dense result, in place or new (the kernel's coalesced copy of the
            # sparse operand, on the CPU, lives inside it; the meta kernel cannot coalesce)
            return self if inplace else torch.empty(self.shape, dtype=dtype, device=self.device)
        if not _coo(self):
            return NotImplemented
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if other._nnz() == 0:
            return self if inplace else _clone((self,), {})  # a copy of self into the result
        if self._nnz() == 0:
            # the other's entries, times alpha, into new tensors
            made = sparse_like(other, other._indices().clone(), (other._values() * alpha).to(dtype), other.is_coalesced())
        else:
            indices = torch.cat([self._indices(), other._indices()], 1)
            values = torch.cat([self._values().to(dtype), other._values().to(dtype)], 0)
            coalesced = self.is_coalesced() and other.is_coalesced() and kernels == "cpu"
            made = sparse_like(self, indices, values, coalesced)
        return _replace(self, made) if inplace else made

    return rule


def _embedding_bag_backward(args: tuple, kwargs: dict) -> Any:
    """``nn.EmbeddingBag(sparse=True)``'s gradient: each index's row of the output gradient (new
    values, one row per index) at the indices themselves (the input, viewed; copied to int64 if
    it is not). The meta kernel reads the bag of each index from the forward's ``offset2bag``,
    which the CPU's sum and mean leave empty (the real backward makes it), and gives no entries."""
    names = ("grad", "indices", "offsets", "offset2bag", "bag_size", "maximum_indices", "num_weights",
             "scale_grad_by_freq", "mode", "sparse", "per_sample_weights", "padding_idx")  # fmt: skip
    given = dict(zip(names, args))
    given.update(kwargs)
    if not given.get("sparse"):
        return NotImplemented
    if given.get("padding_idx", -1) is not None and given.get("padding_idx", -1) >= 0:
        # the rows of padding indices are dropped: how many depends on the indices' values
        raise DynamicOutputShapeException(aten._embedding_bag_backward.default)
    grad, indices = given["grad"], given["indices"]
    index = indices.reshape(1, -1)
    if index.dtype != torch.int64:
        index = index.to(torch.int64)
    values = grad.new_empty((indices.numel(), grad.shape[-1]))
    return sparse_like((given["num_weights"], grad.shape[-1]), index, values)


def _coalesce(args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if not _coo(self):
        return NotImplemented
    raise DynamicOutputShapeException(aten._coalesce.default)


_RULES: dict[Any, Callable[[tuple, dict], Any]] = {
    aten.clone.default: _clone,
    aten.copy_.default: _copy_,
    aten.mul_.Tensor: _scaled(True, torch.Tensor.mul_),
    aten.mul_.Scalar: _scaled(True, torch.Tensor.mul_),
    aten.mul.Tensor: _scaled(False, torch.mul),
    aten.mul.Scalar: _scaled(False, torch.mul),
    aten.div_.Tensor: _scaled(True, torch.Tensor.div_),
    aten.div_.Scalar: _scaled(True, torch.Tensor.div_),
    aten.div.Tensor: _scaled(False, torch.div),
    aten.div.Scalar: _scaled(False, torch.div),
    aten.add_.Tensor: _sum(True),
    aten.add.Tensor: _sum(False),
    aten._coalesce.default: _coalesce,
    aten._embedding_bag_backward.default: _embedding_bag_backward,
}

#: Where CUDA's kernels hold other memory than the CPU's (measured on an H100, torch 2.11).
_CUDA_RULES: dict[Any, Callable[[tuple, dict], Any]] = {
    **_RULES,
    aten.mul_.Tensor: _scaled_anew(torch.mul),
    aten.mul_.Scalar: _scaled_anew(torch.mul),
    aten.add_.Tensor: _sum(True, "cuda"),
    aten.add.Tensor: _sum(False, "cuda"),
}

#: Operators that make a sparse tensor from strided ones and whose fake kernel gets it wrong.
MAKES_SPARSE = frozenset({aten._embedding_bag_backward.default})


def sparse_rule(func: Any, kernels: str = "cpu") -> Callable[[tuple, dict], Any] | None:
    """The rule for ``func`` on sparse COO tensors (it returns ``NotImplemented`` for other
    arguments) as ``kernels``' (a device type) kernels hold memory, or ``None``. Call it inside
    the fake mode."""
    return (_CUDA_RULES if kernels == "cuda" else _RULES).get(func)


# -- _foreach_ operators as loops ------------------------------------------------------
def _type_name(arg: Any) -> str:
    """An argument's type without ``Optional``: ``Tensor``, ``List[Tensor]``, ``number``, ``int``."""
    text = str(arg.type)
    while text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1]
    return text


def _element(text: str) -> str:
    return text[len("List["):-1] if text.startswith("List[") else text


def _per_tensor_op(func: Any) -> tuple[Any, list[bool]] | None:
    """The per-tensor operator a ``_foreach_`` operator loops over (``aten._foreach_add_.List``:
    ``aten.add_.Tensor``), and for each argument whether it is a list handed on item by item."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    if not name.startswith("_foreach_"):
        return None
    packet = getattr(aten, name[len("_foreach_"):], None)
    if packet is None:
        return None
    types = [_type_name(a) for a in schema.arguments]
    wanted = [_element(t) for t in types]
    for overload in packet.overloads():
        op = getattr(packet, overload)
        params = list(op._schema.arguments)
        if any(p.kwarg_only and p.alias_info is not None and p.alias_info.is_write for p in params):
            continue  # an out= variant
        if len(params) < len(wanted) or any(not p.has_default_value() for p in params[len(wanted):]):
            continue
        optional = [str(a.type).startswith("Optional[") for a in schema.arguments]
        if all(
            _type_name(params[i]) == wanted[i] and (not optional[i] or str(params[i].type).startswith("Optional["))
            for i in range(len(wanted))
        ):
            return op, [t.startswith("List[") for t in types]
    return None


def foreach_as_loop(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` (a ``_foreach_`` operator) as the loop of its per-tensor operator (call it
    inside the fake mode); ``NotImplemented`` when no per-tensor operator takes its arguments."""
    found = _per_tensor_op(func)
    if found is None:
        return NotImplemented
    op, each = found
    given = list(bound_arguments(func, args, kwargs).values())
    length = min((len(value) for value, is_list in zip(given, each) if is_list), default=0)
    params = list(op._schema.arguments)
    results = []
    for index in range(length):
        positional, keywords = [], {}
        for value, is_list, param in zip(given, each, params):
            item = value[index] if is_list else value
            if param.kwarg_only:
                keywords[param.name] = item
            else:
                positional.append(item)
        results.append(op(*positional, **keywords))
    return results if func._schema.returns else None
