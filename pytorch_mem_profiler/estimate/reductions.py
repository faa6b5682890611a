"""What CUDA's sum and mean take inside the operator: the reduction kernel's global buffer.

ATen's reduction kernel (``gpu_reduce_kernel``, ``Reduce.cuh``) sizes its launch from the
reduction's layout as ``TensorIterator`` lays it out, and where each output has many inputs to
add up and few outputs fill the device, splits the inputs across thread blocks that meet in a
buffer of float partial sums with a semaphore per column of blocks, both taken from the caching
allocator for the call and given back before it returns. This module follows those two steps:

- :func:`reduction_layout`: the iterator's dimensions, reduced ones first, each group ordered by
  stride (the output's for kept dimensions, the input's for reduced ones), neighbours that are
  one stretch of memory merged (``reorder_dimensions`` and ``coalesce_dimensions``);
- :func:`reduction_scratch`: ``setReduceConfig``'s choice of block shape, vectorization and
  thread blocks per output from that layout, and the bytes of the buffer and the semaphores.

Any sum or mean over any dimensions of a tensor of any strides is covered, where the column
rule (:func:`~.scratch.column_reduction_scratch`) took a contiguous tensor's leading dimensions
only: the reduction a broadcast's gradient makes over a middle dimension (a selective scan's
``A[None, :, None, :]``: the 64 MiB of Falcon-Mamba's backward on an H200), over a transposed
gradient (its ``dt_proj`` bias: 4 MiB), and a loss's full sum (128 bytes and 4).

A sum to another dtype than its input's first copies the input to that dtype
(:func:`reduction_cast_copy`, ``make_reduction``'s ``self.to(in_dtype)``): a boolean or integer
tensor's sum is int64's, so ``mask.sum(dim)`` of a boolean mask copies it at 8 bytes an element
(the backward of ``amax``/``amin``/``max(dim)`` sums the mask of the maxima: 256 MiB for a
(64, 1024, 512) activation). Half precision summed to float32 is read as it is. The partial sums
are float32's for float32, bfloat16 and float16, and 8 bytes each for int64 and float64
(:data:`WIDE_ACCUMULATORS`, twice the buffer, measured). Not covered: tensors split for 32-bit
indexing (over 2**31 elements), the partial sums of other dtypes.

Example::

    >>> reduction_scratch((8, 512, 128, 16), (1048576, 2048, 16, 1), (0, 2), 4)   # Falcon-Mamba's dA
    (67108864, 512)
    >>> reduction_scratch((8, 512, 128), (65536, 1, 512), (0, 2), 4)              # a transposed bias gradient
    (4194304, 512)
    >>> reduction_scratch((8, 128, 256), (32768, 256, 1), None, 4)                # a loss's sum(): 128 + 4 bytes
    (512, 512)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch._prims_common import make_contiguous_strides_for

from ..measure.accounting import non_overlapping_and_dense
from .allocator import block_size

__all__ = [
    "DEFAULT_MULTIPROCESSORS",
    "DEFAULT_THREADS_PER_MULTIPROCESSOR",
    "PARTIAL_BYTES",
    "REDUCED_DTYPES",
    "WIDE_ACCUMULATORS",
    "copy_strides",
    "reduction_cast_copy",
    "reduction_layout",
    "reduction_scratch",
]

#: Streaming multiprocessors assumed when no CUDA device is present: an H100 SXM's or H200's 132.
DEFAULT_MULTIPROCESSORS = 132
#: Resident threads per multiprocessor assumed when no CUDA device is present (2048 since Volta).
DEFAULT_THREADS_PER_MULTIPROCESSOR = 2048
#: The input dtypes whose partial sums are float32 and whose reductions were measured.
REDUCED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The dtypes whose partial sums are 8 bytes (int64's, float64's): a sum's copy to them, measured.
WIDE_ACCUMULATORS = (torch.int64, torch.float64)
#: ATen's ``ReduceConfig`` constants: threads a reduction's block may have, the values a thread
#: should add up (16 to 256), and the input vectorization of its loads (CUDA's sum and mean unroll
#: as many, so it applies wherever the input allows it).
_MAX_THREADS = 512
_WARP = 32
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
_INPUT_VECTOR = 4
#: Bytes of a partial sum (float32 for the dtypes above) and of a semaphore.
PARTIAL_BYTES = 4
_SEMAPHORE = 4


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def reduction_layout(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int] | int | None) -> list[tuple[int, int, bool]]:
    """The reduction's dimensions as ``TensorIterator`` iterates them: ``(size, input stride,
    reduced)`` each, reduced ones first, fastest first within each group, merged where memory runs on.

    ``dims``: the reduced dimensions (``None`` or empty: all). Dimensions of size 1 are left out
    (the iterator merges them into a neighbour).

    Example::

        >>> reduction_layout((8, 512, 128, 16), (1048576, 2048, 16, 1), (0, 2))
        [(128, 16, True), (8, 1048576, True), (16, 1, False), (512, 2048, False)]
        >>> reduction_layout((64, 128, 768), (98304, 768, 1), (0, 1))    # a bias gradient: one column reduction
        [(8192, 768, True), (768, 1, False)]
    """
    ndim = len(shape)
    chosen = set(range(ndim)) if dims is None or (not isinstance(dims, int) and len(dims) == 0) else \
        {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}  # fmt: skip
    # the output: contiguous over the kept dimensions in their order, 0 over the reduced ones
    out_strides = [0] * ndim
    running = 1
    for d in reversed(range(ndim)):
        if d not in chosen:
            out_strides[d] = running
            running *= shape[d]
    order = [d for d in reversed(range(ndim)) if shape[d] != 1]  # innermost first, as ATen starts

    def should_swap(d0: int, d1: int) -> int:
        # the output first: reduced dimensions to the front; then each operand's strides decide
        s0, s1 = out_strides[d0], out_strides[d1]
        if (s0 == 0) != (s1 == 0):
            return 1 if s1 == 0 else -1
        for t0, t1 in ((s0, s1), (strides[d0], strides[d1])):
            if t0 == 0 or t1 == 0:
                continue
            if t0 != t1:
                return -1 if t0 < t1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, len(order)):  # ATen's insertion sort (reorder_dimensions)
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(order[d0], order[d1])
            if comparison > 0:
                order[d0], order[d1] = order[d1], order[d0]
                d1 = d0
            elif comparison < 0:
                break
    merged: list[list[int]] = []  # [size, input stride, output stride]
    for d in order:
        size, stride, out = shape[d], strides[d], out_strides[d]
        if merged:
            last = merged[-1]
            if last[0] * last[1] == stride and last[0] * last[2] == out:
                last[0] *= size
                continue
        merged.append([size, stride, out])
    return [(size, stride, out == 0) for size, stride, out in merged]


def reduction_scratch(
    shape: Sequence[int],
    strides: Sequence[int],
    dims: Sequence[int] | int | None,
    itemsize: int,
    *,
    storage_offset: int = 0,
    multiprocessors: int = DEFAULT_MULTIPROCESSORS,
    threads_per_multiprocessor: int = DEFAULT_THREADS_PER_MULTIPROCESSOR,
    accumulator: int = PARTIAL_BYTES,
) -> tuple[int, ...]:
    """The blocks (bytes, each rounded to the allocator's 512) CUDA's sum or mean of a tensor of
    ``shape`` and ``strides`` (elements of ``itemsize`` bytes) over ``dims`` takes beside its
    output: ``(partial sums, semaphores)`` where the kernel splits each output's inputs across
    thread blocks, else ``()``. ``accumulator``: the bytes of one partial sum (4: float32's, for
    float32, bfloat16 and float16; 8: int64's and float64's, twice the buffer, as an H200 measured).

    Example::

        >>> reduction_scratch((2048, 2048), (2048, 1), (0,), 4)   # a bias gradient (the column rule's)
        (33554432, 512)
        >>> reduction_scratch((64, 768), (768, 1), (1,), 4)       # a row's sum: one block of threads each
        ()
    """
    layout = reduction_layout(shape, strides, dims)
    if not layout or any(size == 0 for size in shape):
        return ()
    reduced = sum(1 for _, _, r in layout if r)
    outputs = 1
    for size, _, r in layout:
        if not r:
            outputs *= size
    inputs = 1
    for size, _, r in layout:
        if r:
            inputs *= size
    if inputs <= 1:
        return ()
    on_fastest = reduced == len(layout) or layout[0][1] < layout[reduced][1]
    if on_fastest:
        dim0, dim1, fastest = inputs, outputs, layout[0][1]
    else:
        dim0, dim1, fastest = outputs, inputs, layout[reduced][1]
    vector_out = 1
    if fastest == 1:
        if on_fastest and dim0 > 128 and reduced == 1:  # vectorized along the one reduced dimension
            dim0 //= _INPUT_VECTOR
        elif not on_fastest:  # vectorized along the outputs, where every stride and the first kept size allow
            vector_out = 4
            for n in (storage_offset, layout[reduced][0], *(s for i, (_, s, _) in enumerate(layout) if i != reduced)):
                while n % vector_out:
                    vector_out //= 2
            dim0 //= vector_out
    most = _MAX_THREADS // vector_out
    dim0_pow2 = _pow2_floor(dim0) if dim0 < most else most
    dim1_pow2 = _pow2_floor(dim1) if dim1 < most else most
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, most // width)
    width = min(dim0_pow2, most // height)
    threads = width * height
    step_input = step_output = 1
    if on_fastest:
        step_input *= width
    else:
        step_output *= width
    split_across_warps = -(-inputs // step_input) >= min(height * _MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD)
    if split_across_warps:
        step_input *= height
    else:
        step_output *= height
    grid = -(-(outputs // vector_out) // step_output)
    target = multiprocessors * (threads_per_multiprocessor // threads)
    per_thread = -(-inputs // step_input)
    if not split_across_warps or per_thread < _MAX_VALUES_PER_THREAD or grid > target:
        return ()
    ctas = max(min(-(-target // grid), -(-per_thread // _MIN_VALUES_PER_THREAD)), -(-per_thread // _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return ()
    partials = accumulator * outputs * ctas
    if not on_fastest:  # each lane of a block keeps its own partial sums
        partials *= width * vector_out
    return (block_size(partials), block_size(_SEMAPHORE * grid))


def reduction_cast_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.dtype, int]:
    """CUDA's sum of ``tensor`` (to ``dtype``: ``None`` for the default) reduces a tensor of the
    dtype returned: the input's own, or a copy of it, whose bytes (rounded to the allocator's 512)
    come second (0: none). ATen's ``make_reduction`` copies the input to the result's dtype unless it
    is that dtype already, or half precision summed to float32 (read as it is); a boolean or integer
    tensor's sum is int64 (``sum``'s type promotion). The copy keeps the input's strides where they
    are dense and non-overlapping (``Tensor.to``), else it is contiguous: the same bytes either way.

    Example::

        >>> mask = torch.empty(64, 1024, 512, dtype=torch.bool, device="meta")
        >>> reduction_cast_copy(mask, None)                      # amax's backward: mask.sum(-1, keepdim=True)
        (torch.int64, 268435456)
        >>> reduction_cast_copy(mask.to(torch.bfloat16), torch.float32)   # read as it is
        (torch.bfloat16, 0)
    """
    if dtype is None:
        dtype = tensor.dtype if tensor.is_floating_point() or tensor.is_complex() else torch.int64
    if dtype == tensor.dtype or (tensor.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32):
        return tensor.dtype, 0
    return dtype, block_size(tensor.numel() * dtype.itemsize)


def copy_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides ``tensor.to(dtype)`` gives its copy: the input's where they lay it out densely
    without overlap (any order of the dimensions), else contiguous ones.

    Example::

        >>> base = torch.empty(3, 8, device="meta")
        >>> copy_strides(base.t()), copy_strides(base[:, ::2].t())   # transposed; strided
        ((1, 8), (3, 1))
    """
    if non_overlapping_and_dense(tensor):
        return tuple(tensor.stride())
    return tuple(make_contiguous_strides_for(tensor.shape))
