"""Fake kernels for operators whose fake kernel is missing or refuses what the real one runs.

A CUDA-only operator without a fake (meta) implementation makes the fake step refuse the model
("has no fake (meta) implementation"), though its outputs follow from its inputs' shapes alone;
a meta implementation stricter than the kernels (one dtype where the kernels take others) makes
it fail with the meta's own error. Each rule here returns what the operator returns (shapes,
dtypes, strides as ATen makes them) and makes what it allocates inside (contiguous copies of
non-contiguous inputs), freed before it returns:

- ``aten._weight_norm_interface_backward`` (``weight_norm``'s fused backward; torch 2.4 has no fake
  kernel for it): the gradients of ``v`` and ``g``, each like its tensor;
- ``aten._grouped_mm`` (``F.grouped_mm``: a mixture of experts' per-expert matmuls in one call,
  transformers 5's default MoE path): the meta implementation takes bfloat16 and float16 only,
  while the CPU kernel (and CUDA's fallback) takes float32 too. The output's shape follows the
  operands' (2-D or 3-D each, the groups' offsets where one is 2-D), in ``out_dtype`` or the first
  operand's, its rows padded to 16 bytes as ATen's ``create_grouped_gemm_output_tensor`` pads them
  for the tensor-memory-access kernels (on every build but ROCm's);

- torch's fused optimizer steps in place (``aten._fused_sgd_``, ``_fused_adagrad_``, the ``tensor_lr``
  overloads of ``_fused_adam_`` and ``_fused_adamw_``: ``SGD(..., fused=True)``, ``Adam(lr=torch.tensor(1e-3),
  fused=True)``), which have no fake kernel where their siblings have one that does nothing: each
  updates the parameters and the state it is given in place and returns nothing, allocating
  nothing (the state they update is made in Python before the call, and counted there);

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


def _grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    given = {**dict(zip(names, args)), **kwargs}
    a, b, offs = given["mat_a"], given["mat_b"], given.get("offs")
    if a.dim() == 2 and b.dim() == 2:
        size = [offs.shape[0], a.shape[0], b.shape[1]]  # the contraction split into groups
    elif a.dim() == 2:
        size = [a.shape[0], b.shape[-1]]  # the rows split into groups
    elif b.dim() == 2:
        size = [a.shape[1], b.shape[1]]  # the columns split into groups
    else:
        size = [a.shape[0], a.shape[1], b.shape[-1]]  # one matmul per group
    dtype = given.get("out_dtype") or a.dtype
    if torch.version.hip:
        return a.new_empty(size, dtype=dtype)
    alignment = max(1, 16 // dtype.itemsize)
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=a.device)


def _weight_norm_backward(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    names = ("grad_w", "saved_v", "saved_g", "saved_norms", "dim")
    given = {**dict(zip(names, args)), **kwargs}
    v, g = given["saved_v"], given["saved_g"]
    return torch.empty_like(v, memory_format=torch.contiguous_format), torch.empty_like(g, memory_format=torch.contiguous_format)


#: The rules by operator (the fake mode looks them up with the others of its kind).
KERNEL_RULES: dict[Any, Callable[[tuple, dict], Any]] = {}
if hasattr(aten, "cudnn_grid_sampler"):
    KERNEL_RULES[aten.cudnn_grid_sampler.default] = _grid_sampler
if hasattr(aten, "cudnn_grid_sampler_backward"):
    KERNEL_RULES[aten.cudnn_grid_sampler_backward.default] = _grid_sampler_backward

if hasattr(aten, "_grouped_mm"):
    KERNEL_RULES[aten._grouped_mm.default] = _grouped_mm
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_norm_interface_backward", "Meta"):
    KERNEL_RULES[aten._weight_norm_interface_backward.default] = _weight_norm_backward  # torch 2.4: no fake kernel


def _updates_in_place(args: tuple, kwargs: dict) -> None:
    """A fused optimizer step: every tensor it is given is updated in place, nothing is made."""
    return None


def _fused_optimizer_steps() -> list[Any]:
    """The overloads of ``aten._fused_<name>_`` (torch's fused optimizer steps, in place) that return
    nothing and have no fake kernel in this torch: the four torch has, and any other the dispatcher
    lists (``torch._C._dispatch_get_all_op_names``, where this torch has it)."""
    listed = getattr(torch._C, "_dispatch_get_all_op_names", lambda: [])()
    names = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
    names.update(q.partition(".")[0][len("aten::") :] for q in listed if q.startswith("aten::_fused_"))
    found = []
    for name in sorted(n for n in names if n.endswith("_")):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op._schema.returns:
                continue
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                found.append(op)
    return found


for _step in _fused_optimizer_steps():
    KERNEL_RULES[_step] = _updates_in_place


def kernel_rule(func: Any) -> Callable[[tuple, dict], Any] | None:
    """The rule for ``func`` (an operator without a fake kernel, or whose fake kernel refuses what the
    real one runs), or ``None``. Call it inside the fake mode."""
    return KERNEL_RULES.get(func)
