"""Backward formulas that scatter into zeros in place on the device, out of place on fake tensors.

Some of autograd's backward formulas (``torch/csrc/autograd/FunctionsManual.cpp``) make a
zero gradient of the input's shape and add the output's gradient into it, in place,
unless a tensor is "tensor-subclass-like" (``areAnyTensorSubclassLike``, true for every
fake tensor and under any dispatch mode), where they take the out-of-place operator:

- ``torch.gather`` / ``take_along_dim``: ``grad.new_zeros(...)`` then ``scatter_add_``
  (``gather_backward``);
- ``index_select``: ``new_zeros`` then ``index_add_`` (``index_select_backward``);
- advanced indexing ``x[idx]``: ``new_zeros`` then ``_index_put_impl_(..., accumulate=True)``
  (``index_backward``).

Out of place, the fake step makes a second input-sized gradient and frees the zeros after
it, where the device makes one: the estimate's peak in backward is one gradient too high
there, and the blocks lie otherwise. :class:`InPlaceFormulas`, asked by the counter of a
CUDA estimate before each operator, runs the in-place operator instead, on the zeros the
formula made just before (the operator's first argument is the last storage the counter
saw born, by a zero factory, and nothing was born since); the result is that tensor, as
the formula returns it. Only with grad mode off (a backward that builds no graph of its
own). CPU estimates keep the out-of-place operators: the CPU counter they are checked
against runs under a dispatch mode, and takes that branch too.

Example::

    >>> import torch
    >>> formulas = InPlaceFormulas()
    >>> zeros = torch.zeros(4, 3)
    >>> formulas.made(torch.ops.aten.new_zeros.default, zeros, tick=7)
    >>> with torch.no_grad():
    ...     formulas.in_place(torch.ops.aten.scatter_add.default, (zeros, 0, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)), {}, tick=7)
    <OpOverload(op='aten.scatter_add_', overload='default')>
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["InPlaceFormulas", "IN_PLACE"]

_aten = torch.ops.aten

#: The out-of-place operator a backward formula takes for tensor subclasses -> the in-place one it
#: takes on the device.
IN_PLACE = {
    _aten.scatter_add.default: _aten.scatter_add_.default,
    _aten.index_add.default: _aten.index_add_.default,
    _aten.index_put.default: _aten.index_put_.default,
}

#: The factories a formula makes its zero gradient with.
_ZEROS = frozenset({_aten.new_zeros.default, _aten.zeros_like.default, _aten.zeros.default})


class InPlaceFormulas:
    """Which out-of-place operators a CUDA estimate's step runs in place, as the device runs them (see the module)."""

    def __init__(self) -> None:
        self._zeros: weakref.ref | None = None
        self._tick = -1

    def made(self, func: Any, out: Any, tick: int) -> None:
        """Note a zero factory's output, the counter at ``tick`` after counting it (anything born
        later moves the counter on, so the zeros are the formula's only while it stands still)."""
        if func in _ZEROS and isinstance(out, torch.Tensor):
            self._zeros, self._tick = weakref.ref(out), tick

    def in_place(self, func: Any, args: tuple, kwargs: dict, tick: int) -> Any:
        """The operator to run for ``func(*args, **kwargs)``: its in-place form where a backward
        formula's zeros are its first argument (made just before, nothing born since), else ``func``."""
        target = IN_PLACE.get(func)
        if target is None or self._zeros is None or tick != self._tick or torch.is_grad_enabled():
            return func
        if not args or args[0] is not self._zeros():
            return func
        if func is _aten.index_put.default and not (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
            return func  # index_backward accumulates; another index_put is not a formula's
        return target
