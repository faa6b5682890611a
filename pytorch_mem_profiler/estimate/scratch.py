"""Kernel scratch on CUDA: memory a kernel takes from the caching allocator inside an operator.

A fake tensor sees what an operator returns, never the buffers a CUDA kernel
takes from the caching allocator while it runs and gives back before the
operator returns. Most kernels take none; those that do were measured on an H200
and an H100 (``benchmarks/op_scratch.py``, ``benchmarks/conv_workspace_rules.py``:
the allocator's peak inside each operator, less the larger of what was allocated
before and after it), and have a rule here giving the bytes of the blocks they take:

- **column reductions** (:func:`column_reduction_scratch`): ``aten.sum.dim_IntList``
  and ``aten.mean.dim`` over the leading dimensions of a contiguous fp32, bf16 or
  fp16 tensor (a bias's gradient is the sum of the output gradient over the
  batch and sequence). When each output has many rows to add up, the reduction is
  split across thread blocks that meet in a global buffer of float partial sums
  plus a small semaphore array. The rule follows how the reduction kernel sizes
  that split (rows by threads, thread blocks by the number of multiprocessors, 16
  blocks of 128 threads each), which reproduces every measured shape to the byte:
  0 up to 512 rows; ``8 * rows * cols + 512`` bytes for 256 columns and more from
  1024 rows; ``2 * rows * cols + 512`` for 64 columns from 2048 rows; at most
  ``multiprocessors`` MiB + 512 (132 on an H100 or H200) while each thread adds at
  most 256 rows (more rows than that take more).
- **embedding backward** (:func:`embedding_backward_scratch`):
  ``aten.embedding_dense_backward`` above 3072 indices sorts the indices and sums
  the gradient rows of each distinct index into float partials: an upper bound
  (every index distinct) of ``4 * N * D + N * (0.4 * D + 50)`` bytes for ``N``
  indices of width ``D``, plus a contiguous copy of the gradient (and of the
  indices) where the operator is handed a non-contiguous one.

- **convolutions** (:mod:`.conv_workspace`): ``aten.convolution`` and
  ``aten.convolution_backward`` take the layout copies ATen makes for cuDNN
  (exact) and cuDNN's workspace for each pass, which on Hopper with cuDNN 9 holds
  the pass's tensors transformed to NHWC (measured to the byte for UNet's, ResNet's
  and a VGG's 3x3 and 7x7 convolutions: 268,546,560 bytes for fp32 (8, 96, 256,
  256) -> 32). The passes of a backward are taken in turn (:class:`Passes`). Which
  plan cuDNN picks is cuDNN's: each call's class carries the spread measured
  around it as an error bound (``bounds``, by operator, which the estimate reports
  in ``MemoryEstimate.error_bounds``); ``measure_kernels=True`` measures instead,
  on the GPU (:mod:`.kernel_probe`);
- **sliced gradients** (:mod:`.layout_copies`): upsampling, pooling and cuDNN
  batch norm backward copy a gradient that is not contiguous first (a U-Net's
  concatenation hands its parts slices of its gradient), exact;
- **cuDNN's NHWC batch norm**: a workspace of about 1 MB measured, bounded at
  4 MiB (``BATCH_NORM_WORKSPACE_BOUND``), not estimated.

Not covered: other kernels' scratch (cuDNN's attention workspaces, sorts,
``index_put`` with accumulation), reductions over inner or middle dimensions,
float64 reductions, tensors split for 32-bit indexing (over 2**31 elements), and
data-dependent sizes (an embedding's scratch with repeated indices is less than
the bound).

Example::

    >>> column_reduction_scratch(2048, 2048)          # a bias gradient: (2048, 2048) summed over dim 0
    (33554432, 512)
    >>> sum(column_reduction_scratch(512, 3072)), sum(column_reduction_scratch(65536, 3072)) == (132 << 20) + 512
    (0, True)
    >>> embedding_backward_scratch(3072, 768), sum(embedding_backward_scratch(4096, 768))
    ((), 14046208)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .allocator import block_size
from .conv_workspace import convolution_backward_scratch, convolution_scratch, memory_format
from .kernel_probe import MEASURED, convolution_key
from .layout_copies import COPYING_OPERATORS

__all__ = [
    "DEFAULT_MULTIPROCESSORS",
    "DEFAULT_THREADS_PER_MULTIPROCESSOR",
    "column_reduction_scratch",
    "embedding_backward_scratch",
    "KernelScratch",
    "Passes",
]

#: How the report names the convolutions' bounds (cuDNN's workspace, by the plan its heuristics pick).
CONVOLUTION_BOUND = "aten.convolution (cuDNN workspace)"
CONVOLUTION_BACKWARD_BOUND = "aten.convolution_backward (cuDNN workspace)"
BATCH_NORM_BOUND = "batch norm, channels_last (cuDNN workspace)"
#: The bound for cuDNN's NHWC batch norm workspace: four times the 1.06 MB measured.
BATCH_NORM_WORKSPACE_BOUND = 4 << 20

#: Streaming multiprocessors assumed when no CUDA device is present: an H100 SXM's or H200's 132.
DEFAULT_MULTIPROCESSORS = 132
#: Resident threads per multiprocessor assumed when no CUDA device is present (2048 since Volta).
DEFAULT_THREADS_PER_MULTIPROCESSOR = 2048

#: The dtypes the reduction rule was measured for (their partial sums are float32).
_REDUCED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Indices up to this many take the embedding backward's direct kernel, which needs no scratch.
_EMBEDDING_DIRECT_LIMIT = 3072
_WARP = 32
_THREADS_PER_REDUCTION = 512


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def column_reduction_scratch(
    rows: int,
    cols: int,
    *,
    multiprocessors: int = DEFAULT_MULTIPROCESSORS,
    threads_per_multiprocessor: int = DEFAULT_THREADS_PER_MULTIPROCESSOR,
) -> tuple[int, ...]:
    """The blocks (bytes) a CUDA sum or mean of a contiguous ``(rows, cols)`` tensor over dim 0 takes.

    ``rows``: the product of the reduced (leading) dimensions; ``cols``: of the
    kept (trailing) ones. ``()`` when the kernel needs no global buffer; else the
    buffer of float partial sums and the semaphores, each rounded to the
    allocator's 512-byte blocks.
    """
    if rows <= 1 or cols <= 1:
        return ()  # nothing to add up, or a reduction along the innermost dimension
    # Loads are vectorized along the outputs, 4 at a time where the row length allows.
    vec = 4 if cols % 4 == 0 else 2 if cols % 2 == 0 else 1
    most = _THREADS_PER_REDUCTION // vec
    lanes = most if cols // vec >= most else _pow2_floor(cols // vec)
    depth = most if rows >= most else _pow2_floor(rows)
    width = min(lanes, _WARP)
    height = min(depth, most // width)
    width = min(lanes, most // height)
    threads = width * height
    # Each warp row adds its own share of the rows only when that leaves 16 or more each.
    if rows < min(16 * height, 256):
        return ()
    per_thread = math.ceil(rows / height)
    grid = math.ceil(math.ceil(cols / vec) / width)
    target = multiprocessors * (threads_per_multiprocessor // threads)
    if per_thread < 256 or grid > target:
        return ()
    # More thread blocks per output, to fill the device, keeping 16 to 256 rows per thread.
    ctas = max(min(math.ceil(target / grid), math.ceil(per_thread / 16)), math.ceil(per_thread / 256))
    if ctas <= 1:
        return ()
    partials = 4 * cols * ctas * width * vec
    semaphores = 4 * grid
    return (block_size(partials), block_size(semaphores))


def embedding_backward_scratch(
    num_indices: int,
    dim: int,
    *,
    grad_contiguous: bool = True,
    grad_element_size: int = 4,
    indices_contiguous: bool = True,
    index_element_size: int = 8,
    scale_grad_by_freq: bool = False,
) -> tuple[int, ...]:
    """An upper bound on the blocks (bytes) a CUDA ``embedding_dense_backward`` takes for itself.

    ``num_indices`` indices (``N``) of an embedding of width ``dim`` (``D``). A
    non-contiguous gradient (a slice of a concatenation's gradient) is copied first,
    and so are non-contiguous indices. Above 3072 indices (or with
    ``scale_grad_by_freq``) the indices are sorted and each distinct index's rows
    summed into float partials: with every index distinct, ``4 * N * D`` bytes of
    partials and about ``N * (0.4 * D + 48)`` of sort buffers and offsets
    (measured; 50 here, an upper bound within 1% of every measured shape).
    """
    if num_indices <= 0 or dim <= 0:
        return ()
    blocks = []
    if not grad_contiguous:
        blocks.append(block_size(num_indices * dim * grad_element_size))
    if not indices_contiguous:
        blocks.append(block_size(num_indices * index_element_size))
    if num_indices > _EMBEDDING_DIRECT_LIMIT or scale_grad_by_freq:
        blocks.append(block_size(4 * num_indices * dim))
        blocks.append(block_size(math.ceil(num_indices * (0.4 * dim + 50))))
    return tuple(blocks)


def _leading_reduction(tensor: torch.Tensor, dims: Sequence[int] | int | None) -> tuple[int, int] | None:
    """``(rows, cols)`` when ``dims`` are leading dimensions of contiguous ``tensor`` and some stay."""
    if tensor.dtype not in _REDUCED_DTYPES or not tensor.is_contiguous():
        return None
    ndim = tensor.dim()
    if dims is None or ndim == 0:
        return None
    chosen = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
    if not chosen:
        return None  # an empty dim list reduces everything
    shape = tensor.shape
    reduced = [d for d in range(ndim) if d in chosen and shape[d] > 1]
    kept = [d for d in range(ndim) if d not in chosen and shape[d] > 1]
    if not reduced or not kept or max(reduced) > min(kept):
        return None
    return math.prod(shape[d] for d in reduced), math.prod(shape[d] for d in kept)


class Passes(tuple):
    """Blocks an operator takes in passes: ``held`` alive throughout, each of ``passes`` in turn.

    As a tuple it is the held blocks and the largest pass's, what is alive at once at
    the operator's peak; the counter takes each pass and gives it back before the
    next, as the kernels do, so the allocator's replay sees each pass's blocks.

    Example::

        >>> blocks = Passes(held=(1024,), passes=((4096,), (8192, 512)))
        >>> sum(blocks), blocks.passes
        (9728, ((4096,), (8192, 512)))
    """

    held: tuple[int, ...]
    passes: tuple[tuple[int, ...], ...]

    def __new__(cls, held: Sequence[int] = (), passes: Sequence[Sequence[int]] = ()) -> Passes:
        held = tuple(n for n in held if n > 0)
        kept = tuple(tuple(n for n in one if n > 0) for one in passes)
        kept = tuple(one for one in kept if one)
        largest = max(kept, key=sum, default=())
        made = super().__new__(cls, held + largest)
        made.held, made.passes = held, kept
        return made


class KernelScratch:
    """The rules by operator: ``scratch(func, args, kwargs)`` gives the blocks (bytes) it takes.

    Args:
        multiprocessors: the device's streaming multiprocessors (``multi_processor_count``).
        threads_per_multiprocessor: its resident threads per multiprocessor.
    """

    def __init__(
        self,
        multiprocessors: int = DEFAULT_MULTIPROCESSORS,
        threads_per_multiprocessor: int = DEFAULT_THREADS_PER_MULTIPROCESSOR,
        *,
        cudnn_benchmark: bool | None = None,
        measured: bool = False,
    ) -> None:
        self.multiprocessors = multiprocessors
        self.threads_per_multiprocessor = threads_per_multiprocessor
        #: ``torch.backends.cudnn.benchmark`` for the convolutions' rules (``None``: as set when made)
        self.cudnn_benchmark = bool(torch.backends.cudnn.benchmark) if cudnn_benchmark is None else cudnn_benchmark
        #: operations whose scratch follows a rule measurements do not pin down: the bytes it may be
        #: off by, by operation (the largest call's: an operator's scratch is gone when the next one runs)
        self.bounds: dict[str, int] = {}
        #: take convolutions' scratch from :data:`.kernel_probe.MEASURED` where measured; calls not
        #: measured yet are kept in ``pending`` (and take the rule) for the caller to measure
        self.measured = measured
        self.pending: set[tuple] = set()
        aten = torch.ops.aten
        self._rules: dict[Any, Callable[[tuple, dict], tuple[int, ...]]] = {
            aten.sum.dim_IntList: self._reduction,
            aten.mean.dim: self._reduction,
            aten.embedding_dense_backward.default: self._embedding_backward,
            aten.convolution.default: self._convolution,
            aten.convolution_backward.default: self._convolution_backward,
            **COPYING_OPERATORS,
        }
        for op in (aten.cudnn_batch_norm.default, aten.cudnn_batch_norm_backward.default, aten.native_batch_norm.default,
                   aten._native_batch_norm_legit.default, aten.native_batch_norm_backward.default):  # fmt: skip
            self._rules[op] = self._batch_norm_bound(self._rules.get(op))

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> tuple[int, ...]:
        rule = self._rules.get(func)
        if rule is None:
            return ()
        return rule(args, kwargs)

    def _reduction(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        tensor = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(tensor, torch.Tensor):
            return ()
        shape = _leading_reduction(tensor, dims)
        if shape is None:
            return ()
        return column_reduction_scratch(
            *shape, multiprocessors=self.multiprocessors, threads_per_multiprocessor=self.threads_per_multiprocessor
        )

    def _batch_norm_bound(self, rule: Callable[[tuple, dict], tuple[int, ...]] | None) -> Callable[[tuple, dict], tuple[int, ...]]:
        """cuDNN's NHWC batch norm takes a workspace (1.06 MB forward, 0.70 MB backward measured for
        fp32 (8, 64, 128, 128)), its size otherwise unmeasured: a bound, no estimate."""

        def bounded(args: tuple, kwargs: dict) -> tuple[int, ...]:
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            if any(t.dim() == 4 and memory_format(t) == "channels_last" for t in tensors):
                self._bound(BATCH_NORM_BOUND, BATCH_NORM_WORKSPACE_BOUND)
            return rule(args, kwargs) if rule is not None else ()

        return bounded

    def _bound(self, operation: str, nbytes: int) -> None:
        if nbytes > 0:
            self.bounds[operation] = max(self.bounds.get(operation, 0), nbytes)

    def _measured(self, func: Any, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """The call's measured scratch, as one block; ``None`` where there is none (then pending)."""
        if not self.measured:
            return None
        key = convolution_key(func, args, kwargs)
        value = MEASURED.get(key)
        if value is None:
            if key not in MEASURED:
                self.pending.add(key)
            return None
        return Passes((), ((value,),))

    def _convolution(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        measured = self._measured(torch.ops.aten.convolution.default, args, kwargs)
        if measured is not None:
            return measured
        # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
        bound = {**dict(zip(names, args)), **kwargs}
        found = convolution_scratch(
            bound["input"], bound["weight"], stride=bound["stride"], padding=bound["padding"], dilation=bound["dilation"],
            transposed=bool(bound["transposed"]), groups=int(bound["groups"]), output_padding=bound["output_padding"],
            benchmark=self.cudnn_benchmark,
        )  # fmt: skip
        self._bound(CONVOLUTION_BOUND, found.bound)
        return Passes(found.held, found.passes)

    def _convolution_backward(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        measured = self._measured(torch.ops.aten.convolution_backward.default, args, kwargs)
        if measured is not None:
            return measured
        names = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
                 "output_padding", "groups", "output_mask")  # fmt: skip
        bound = {**dict(zip(names, args)), **kwargs}
        found = convolution_backward_scratch(
            bound["grad_output"], bound["input"], bound["weight"], stride=bound["stride"], padding=bound["padding"],
            dilation=bound["dilation"], transposed=bool(bound["transposed"]), groups=int(bound["groups"]),
            output_mask=bound["output_mask"], output_padding=bound["output_padding"], benchmark=self.cudnn_benchmark,
            multiprocessors=self.multiprocessors,
        )  # fmt: skip
        self._bound(CONVOLUTION_BACKWARD_BOUND, found.bound)
        return Passes(found.held, found.passes)

    def _embedding_backward(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        grad, indices = args[0], args[1]
        scale = bool(args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False))
        if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor) or grad.dim() == 0:
            return ()
        return embedding_backward_scratch(
            indices.numel(),
            grad.shape[-1],
            grad_contiguous=grad.is_contiguous(),
            grad_element_size=grad.element_size(),
            indices_contiguous=indices.is_contiguous(),
            index_element_size=indices.element_size(),
            scale_grad_by_freq=scale,
        )
