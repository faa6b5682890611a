"""Contiguous copies that CUDA kernels make of their arguments inside the operator.

Many CUDA kernels read their tensors in one memory layout and call
``.contiguous(memory_format)`` on what they are handed first: a copy, from the
caching allocator, alive until the operator returns, where the argument is not in
that layout already. Autograd hands such operators non-contiguous gradients
where a concatenation's backward slices its gradient (a U-Net's skips: the
gradient reaching ``upsample_bilinear2d_backward`` is a channel slice, and the
operator's scratch on an H100 is that gradient's bytes, 134,217,728 for
(8, 64, 256, 256) fp32).

:func:`layout_copies` gives the copies' blocks (bytes) for the operators whose
CUDA code is known to copy so:

- ``upsample_bilinear2d_backward``, ``upsample_nearest2d_backward``: the
  gradient, into ``channels_last`` where it suggests that layout and has 4
  channels or more (the NHWC kernel), else into contiguous;
- ``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``,
  ``_adaptive_avg_pool2d_backward``: the gradient, the input (and the indices)
  into the input's suggested layout;
- ``cudnn_batch_norm_backward``: the gradient into the input's layout;
- ``mm``, ``addmm``: a matrix cuBLAS cannot read in place (ATen's
  ``prepare_matrix_for_cublas``: not dense, and neither column- nor row-major
  with a leading dimension at least its other size), into contiguous. The
  gradient of a ``sum()`` or ``mean()`` loss reaches the last linear layer
  expanded from one number (strides 0): its ``mm`` backward copies it whole,
  once for the input's gradient and once for the weight's (a language model's
  logits' size: 196,608,000 bytes for 48 x 128 x 8,000 fp32 on an H200, the
  step's peak there).

- ``_softmax``, ``_log_softmax``: the input, into contiguous (``host_softmax``);
- ``_softmax_backward_data``: first the product ``grad_output * output``, a
  temporary of the gradient's size on every call (``softmax_backward_cuda_out``),
  then, as ``host_softmax_backward`` reads contiguous tensors, that product where
  TensorIterator laid it out otherwise (torch's ``compute_elementwise_output_strides``
  gives its layout) and the softmax's output where it is not contiguous. On an H100 (torch 2.11) an
  ``nn.MultiheadAttention`` whose per-head weights are used took one block of the
  weights' size, 268,435,456 bytes for (16 x 16, 512, 512) fp32, in its backward
  that nothing the operator returns holds;
- ``_log_softmax_backward_data``: the gradient and the output, into contiguous.

Measured on an H100 (``benchmarks/conv_workspace_rules.py``, fp32 and bf16, the
gradient a channel slice): each of the first five operators' scratch is the sliced
gradient's bytes, to the byte (134,217,728 for bilinear and nearest upsampling of
(8, 64, 128, 128) fp32, 8,388,608 for max and average pooling, 100,352 for
adaptive average pooling to 7x7); contiguous and ``channels_last`` gradients take none.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     grad = torch.empty(8, 96, 256, 256)[:, :64]       # a slice of a concatenation's gradient
    >>> layout_copies(torch.ops.aten.upsample_bilinear2d_backward.default, (grad, [256, 256], [8, 64, 128, 128], False), {})
    (134217728,)
    >>> layout_copies(torch.ops.aten.upsample_bilinear2d_backward.default, (grad.contiguous(), [256, 256], [8, 64, 128, 128], False), {})
    ()
    >>> with torch.device("meta"):
    ...     expanded, weight = torch.empty(()).expand(6144, 8000), torch.empty(8000, 128)  # a sum loss's gradient
    >>> layout_copies(torch.ops.aten.mm.default, (expanded, weight), {}), layout_copies(torch.ops.aten.mm.default, (weight.t(), weight), {})
    ((196608000,), ())
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._prims_common import compute_elementwise_output_strides, make_contiguous_strides_for

from .allocator import block_size
from .conv_workspace import memory_format

__all__ = ["layout_copies", "COPYING_OPERATORS"]


def _format(tensor: torch.Tensor, channels_last: bool) -> bool:
    if channels_last and tensor.dim() == 4:
        return tensor.is_contiguous(memory_format=torch.channels_last)
    if channels_last and tensor.dim() == 5:
        return tensor.is_contiguous(memory_format=torch.channels_last_3d)
    return tensor.is_contiguous()


def _copy(tensor: Any, channels_last: bool) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0 or _format(tensor, channels_last):
        return 0
    return block_size(tensor.numel() * tensor.element_size())


def _upsample_backward(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    grad = args[0] if args else kwargs.get("grad_output")
    if not isinstance(grad, torch.Tensor) or grad.dim() != 4:
        return ()
    nhwc = memory_format(grad) == "channels_last" and grad.shape[1] >= 4
    return tuple(b for b in (_copy(grad, nhwc),) if b)


def _by_input_layout(grad_index: int, input_index: int, others: Sequence[int] = ()):  # type: ignore[no-untyped-def]
    def rule(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
        if len(args) <= max(grad_index, input_index, *others) or not isinstance(args[input_index], torch.Tensor):
            return ()
        channels_last = memory_format(args[input_index]) == "channels_last"
        copies = [_copy(args[i], channels_last) for i in (grad_index, input_index, *others)]
        return tuple(b for b in copies if b)

    return rule


def _grad_and_output(args: Sequence[Any], kwargs: dict) -> tuple[Any, Any]:
    """A softmax backward's ``(grad_output, output)``."""
    grad = args[0] if args else kwargs.get("grad_output")
    return grad, args[1] if len(args) > 1 else kwargs.get("output")


def _softmax_forward(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    source = args[0] if args else kwargs.get("self")
    return tuple(b for b in (_copy(source, False),) if b)


def _softmax_backward(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    grad, output = _grad_and_output(args, kwargs)
    if not isinstance(grad, torch.Tensor) or not isinstance(output, torch.Tensor) or grad.numel() == 0:
        return ()
    # tmp = grad * output, in the dtype they promote to, laid out as TensorIterator lays it out
    # (torch's own account of that layout: compute_elementwise_output_strides)
    product = block_size(grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize)
    contiguous = tuple(compute_elementwise_output_strides(grad, output)) == make_contiguous_strides_for(grad.shape)
    blocks = (product, 0 if contiguous else product, _copy(output, False))
    return tuple(b for b in blocks if b)


def _log_softmax_backward(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    grad, output = _grad_and_output(args, kwargs)
    return tuple(b for b in (_copy(grad, False), _copy(output, False)) if b)


def _cublas_copy(matrix: Any) -> int:
    """The block of the contiguous copy ATen's ``prepare_matrix_for_cublas`` makes of ``matrix`` (0: none)."""
    if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2 or matrix.numel() == 0:
        return 0
    (rows, cols), (row_stride, col_stride) = matrix.shape, matrix.stride()
    # dense, without overlap or gaps: row- or column-major (a size-1 dimension's stride is free)
    if (cols == 1 or col_stride == 1) and (rows == 1 or row_stride == cols):
        return 0
    if (rows == 1 or row_stride == 1) and (cols == 1 or col_stride == rows):
        return 0
    if row_stride == 1 and col_stride >= max(1, rows):  # column-major with its leading dimension
        return 0
    if col_stride == 1 and row_stride >= max(1, cols):  # row-major with its leading dimension
        return 0
    return block_size(matrix.numel() * matrix.element_size())


def _matrices(*indices: int):  # type: ignore[no-untyped-def]
    def rule(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
        copies = [_cublas_copy(args[i]) for i in indices if i < len(args)]
        return tuple(b for b in copies if b)

    return rule


_aten = torch.ops.aten
#: The operators covered, and how each picks the layout it copies into.
COPYING_OPERATORS = {
    _aten.upsample_bilinear2d_backward.default: _upsample_backward,
    _aten.upsample_nearest2d_backward.default: _upsample_backward,
    # (grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)
    _aten.max_pool2d_with_indices_backward.default: _by_input_layout(0, 1, (7,)),
    # (grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    _aten.avg_pool2d_backward.default: _by_input_layout(0, 1),
    # (grad_output, self)
    _aten._adaptive_avg_pool2d_backward.default: _by_input_layout(0, 1),
    # (input, grad_output, weight, running_mean, running_var, save_mean, save_var, epsilon, reserve)
    _aten.cudnn_batch_norm_backward.default: _by_input_layout(1, 0),
    # (self, mat2); (self, mat1, mat2, beta, alpha): the matrices cuBLAS reads
    _aten.mm.default: _matrices(0, 1),
    _aten.addmm.default: _matrices(1, 2),
    # (self, dim, half_to_float); (grad_output, output, dim, input_dtype)
    _aten._softmax.default: _softmax_forward,
    _aten._log_softmax.default: _softmax_forward,
    _aten._softmax_backward_data.default: _softmax_backward,
    _aten._log_softmax_backward_data.default: _log_softmax_backward,
}


def layout_copies(func: Any, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The blocks (bytes) of the copies ``func`` makes of its arguments on CUDA (``()``: none, or not covered)."""
    rule = COPYING_OPERATORS.get(func)
    return rule(args, kwargs) if rule is not None else ()
