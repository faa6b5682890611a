"""Fake kernels for CUDA operators torch gives none: what they return, for fake tensors.

A CUDA-only operator without a fake (meta) implementation makes the fake step refuse the model
("has no fake (meta) implementation"), though its outputs follow from its inputs' shapes alone.
Each rule here returns what the operator returns (shapes, dtypes, contiguous as ATen makes
them) and makes what it allocates inside (contiguous copies of non-contiguous inputs), freed
before it returns:

- ``aten.cudnn_grid_sampler`` (``F.grid_sample`` on CUDA, bilinear, zero padding, 4-D, where
  cuDNN takes it): the output ``(N, C, H_out, W_out)`` from the input ``(N, C, H, W)`` and the
  grid ``(N, H_out, W_out, 2)``; ATen's ``cudnn_grid_sampler_forward`` makes the input and the grid
  contiguous first;
- ``aten.cudnn_grid_sampler_backward``: the input's and the grid's gradients, each contiguous in
  the shape of its tensor, after contiguous copies of the input, the grid and the output's gradient.

Example::

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     x, grid = torch.empty(2, 3, 8, 8), torch.empty(2, 5, 6, 2)
    ...     out = kernel_rule(torch.ops.aten.cudnn_grid_sampler.default)((x, grid), {})
    >>> tuple(out.shape)
    (2, 3, 5, 6)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["KERNEL_RULES", "kernel_rule"]

aten = torch.ops.aten


def _contiguous_inside(*tensors: torch.Tensor) -> None:
    """What ``.contiguous()`` copies inside the operator (freed when it returns)."""
    copies = [t.contiguous() for t in tensors if not t.is_contiguous()]
    del copies


def _grid_sampler(args: tuple, kwargs: dict) -> torch.Tensor:
    given = {**dict(zip(("self", "grid"), args)), **kwargs}
    x, grid = given["self"], given["grid"]
    _contiguous_inside(x, grid)
    return x.new_empty((x.shape[0], x.shape[1], grid.shape[1], grid.shape[2]))


def _grid_sampler_backward(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    names = ("self", "grid", "grad_output")
    given = {**dict(zip(names, args)), **kwargs}
    x, grid, grad_output = given["self"], given["grid"], given["grad_output"]
    _contiguous_inside(x, grid, grad_output)
    return x.new_empty(x.shape), grid.new_empty(grid.shape)


#: The rules by operator (the fake mode looks them up with the others of its kind).
KERNEL_RULES: dict[Any, Callable[[tuple, dict], Any]] = {}
if hasattr(aten, "cudnn_grid_sampler"):
    KERNEL_RULES[aten.cudnn_grid_sampler.default] = _grid_sampler
if hasattr(aten, "cudnn_grid_sampler_backward"):
    KERNEL_RULES[aten.cudnn_grid_sampler_backward.default] = _grid_sampler_backward


def kernel_rule(func: Any) -> Callable[[tuple, dict], Any] | None:
    """The rule for ``func`` (a CUDA operator without a fake kernel), or ``None``. Call it inside the fake mode."""
    return KERNEL_RULES.get(func)
