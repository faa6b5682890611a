"""Kernel scratch on CUDA: memory a kernel takes from the caching allocator inside an operator.

A fake tensor sees what an operator returns, never the buffers a CUDA kernel
takes from the caching allocator while it runs and gives back before the
operator returns. Most kernels take none; those that do were measured on an H200
and an H100 (``benchmarks/op_scratch.py``, ``benchmarks/conv_workspace_rules.py``:
the allocator's peak inside each operator, less the larger of what was allocated
before and after it), and have a rule here giving the bytes of the blocks they take:

- **reductions** (:func:`~.reductions.reduction_scratch`): ``aten.sum`` and ``aten.mean``
  over any dimensions of an fp32, bf16 or fp16 tensor of any strides, as ATen's
  ``TensorIterator`` lays the reduction out (:mod:`.reductions`); over the leading
  dimensions of a contiguous tensor (a bias's gradient is the sum of the output
  gradient over the batch and sequence) it is the column rule
  (:func:`column_reduction_scratch`). When each output has many rows to add up, the reduction is
  split across thread blocks that meet in a global buffer of float partial sums
  plus a small semaphore array. The rule follows how the reduction kernel sizes
  that split (rows by threads, thread blocks by the number of multiprocessors, 16
  blocks of 128 threads each), which reproduces every measured shape to the byte:
  0 up to 512 rows; ``8 * rows * cols + 512`` bytes for 256 columns and more from
  1024 rows; ``2 * rows * cols + 512`` for 64 columns from 2048 rows; at most
  ``multiprocessors`` MiB + 512 (132 on an H100 or H200) while each thread adds at
  most 256 rows (more rows than that take more).
- **embedding backward** (:func:`embedding_backward_scratch`):
  ``aten.embedding_dense_backward`` above 3072 indices (or with
  ``scale_grad_by_freq``) runs ATen's sort-and-segment kernel
  (``embedding_dense_backward_cuda``, ``embedding_backward_cuda_kernel``), whose
  buffers follow from the shapes alone: the sorted indices and their positions
  (``N`` indices each), CUB's radix sort (its alternate key and value buffers and
  per-tile histograms) with an ``arange`` beside it, both given back before the
  gradient is made; then the segment offsets, CUB's unique-by-key (a copy of the
  keys), ``min(N, num_weights)`` partial counts and their offsets (CUB's scan),
  ``N // 10 + min(N, num_weights)`` partial-segment offsets and float partial sums
  of that many rows. Taken in that order (:class:`KernelSteps`), some before the
  operator's output, given back in ATen's order; plus a contiguous copy of the
  gradient (and of the indices) where the operator is handed a non-contiguous one.
  Exact on every shape measured on an H200 (the peak inside the operator; the
  allocator's history of NeuMF's and a GRU's steps for the order).

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
  4 MiB (``BATCH_NORM_WORKSPACE_BOUND``), not estimated;
- **cuDNN's attention backward** (:func:`cudnn_attention_backward_scratch`):
  ``aten._scaled_dot_product_cudnn_attention_backward`` takes one block, the query's
  gradient accumulated in float32 and a float per query row, plus 256 bytes:
  ``4 * B * H * S_q * D + 4 * B * H * S_q + 256``. Exact on all 144 calls measured on an
  H100 (torch 2.11; bf16; batch 8 to 160, 4 and 12 heads, 128 to 1,024 positions, head
  dims 64 and 128, with and without dropout and a causal mask: the allocator's history
  inside the operator); its forward takes none beyond what it returns. Flash attention's
  backward (``aten._scaled_dot_product_flash_attention_backward``) makes the same two
  buffers (FlashAttention-2's ``dq_accum`` and ``softmax_d``, positions rounded up to 128
  and the head dim to 32): the emulation runs it where the H100 runs cuDNN's (unmasked
  half precision), and it runs for real where cuDNN's cannot; not measured apart. With grouped-query attention (fewer key and value heads than query heads)
  both also take the key's and value's gradients at every query head, in the inputs' dtype, before
  summing them down to their own heads (:func:`grouped_query_gradients`): inside cuDNN's one block
  (Qwen2's 14 query and 2 key heads, bf16, (16, 14, 512, 64) on an H100, torch 2.11: 59,179,520
  bytes, the rule's 29,819,392 plus twice 14,680,064), as FlashAttention-2's ``dk_expanded`` and
  ``dv_expanded`` beside flash's.

- **the efficient attention kernel's forward** (:func:`efficient_attention_forward_scratch`):
  above a head dim of 128 (the kernel built for any head dim, which keeps its output in global
  memory rather than registers) in half precision, the output accumulated in float32, taken after
  the outputs and given back; none up to 128 or in float32 (an H200's allocator history, torch 2.11:
  5,242,880 and 8,388,608 bytes at head dims 320 and 512, bf16, (8, 4, 128, d));
- **the efficient attention kernel's backward** (:func:`efficient_attention_backward_scratch`):
  after the three gradients, in float32 a block of the query gradient's size and two floats per
  query row, in half precision one float per row, then the query gradient's split-keys accumulator in
  float32 (positions and head dim rounded up to the kernel's blocks; above a head dim of 128, in half
  precision, also the key's and value's gradients staged per split of the keys), all given back (in
  float32 the product and one sum before the workspace is taken: :func:`efficient_attention_backward_steps`);
  exact on the 269 calls of ``benchmarks/attention_backward_rules.py`` (an H200, torch 2.11). Before the
  gradients, a contiguous copy of the output's gradient where it is not laid out as the kernel's
  output (:func:`efficient_attention_grad_out_copy`: ``nn.MultiheadAttention`` hands it back
  positions first), given back last.

Not covered: other kernels' scratch (cuDNN's attention workspaces other than the backward's, sorts,
``index_put`` with accumulation), float64 and integer reductions, tensors split for 32-bit indexing (over 2**31 elements), the
small scan-by-key buffers of an embedding's ``scale_grad_by_freq``, and the fused
accumulation later torch versions take for some embedding shapes (which drops the
partial sums).

Example::

    >>> column_reduction_scratch(2048, 2048)          # a bias gradient: (2048, 2048) summed over dim 0
    (33554432, 512)
    >>> sum(column_reduction_scratch(512, 3072)), sum(column_reduction_scratch(65536, 3072)) == (132 << 20) + 512
    (0, True)
    >>> embedding_backward_scratch(3072, 768), sum(embedding_backward_scratch(4096, 768, num_weights=50257))
    ((), 14040576)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .allocator import block_size
from .conv_workspace import ConvScratch, convolution_backward_scratch, convolution_scratch, memory_format
from .kernel_probe import convolution_key, measured_or_pending
from .layout_copies import COPYING_OPERATORS
from .reductions import (
    DEFAULT_MULTIPROCESSORS,
    DEFAULT_THREADS_PER_MULTIPROCESSOR,
    PARTIAL_BYTES,
    REDUCED_DTYPES,
    WIDE_ACCUMULATORS,
    copy_strides,
    reduction_cast_copy,
    reduction_scratch,
)

__all__ = [
    "CUDNN_ATTENTION_BACKWARD_PAD",
    "DEFAULT_MULTIPROCESSORS",
    "DEFAULT_THREADS_PER_MULTIPROCESSOR",
    "column_reduction_scratch",
    "cudnn_attention_backward_scratch",
    "efficient_attention_backward_scratch",
    "efficient_attention_backward_steps",
    "efficient_attention_forward_scratch",
    "efficient_attention_grad_out_copy",
    "embedding_backward_scratch",
    "flash_attention_backward_scratch",
    "grouped_query_gradients",
    "KernelScratch",
    "safe_softmax_scratch",
    "KernelSteps",
    "Passes",
]

#: How the report names the convolutions' bounds (cuDNN's workspace, by the plan its heuristics pick).
CONVOLUTION_BOUND = "aten.convolution (cuDNN workspace)"
CONVOLUTION_BACKWARD_BOUND = "aten.convolution_backward (cuDNN workspace)"
#: What the report adds to a convolution's bound over a 1-D channels-innermost input
#: (:func:`~.conv_workspace.channels_innermost_1d`): kept apart, since it does not give way under a limit.
CHANNELS_INNERMOST_LAYOUT = " in a 1-D channels-last layout"
BATCH_NORM_BOUND = "batch norm, channels_last (cuDNN workspace)"
#: The bound for cuDNN's NHWC batch norm workspace: four times the 1.06 MB measured.
BATCH_NORM_WORKSPACE_BOUND = 4 << 20


#: Indices up to this many take the embedding backward's direct kernel, which needs no scratch.
_EMBEDDING_DIRECT_LIMIT = 3072
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
    allocator's 512-byte blocks (:func:`~.reductions.reduction_scratch` of that layout).
    """
    if rows <= 1 or cols <= 1:
        return ()  # nothing to add up, or a reduction along the innermost dimension
    return reduction_scratch((rows, cols), (cols, 1), (0,), 4, multiprocessors=multiprocessors,
                             threads_per_multiprocessor=threads_per_multiprocessor)  # fmt: skip


#: CUB's temporary storage (``cub::detail::AliasTemporaries``): each part aligned to 256 bytes, and
#: 255 bytes of slack for aligning the whole.
_CUB_ALIGN = 256
#: Items per tile of CUB's one-sweep radix sort of 8-byte keys, and its bits per pass.
_SORT_TILE = 4608
_SORT_BITS = 8
#: Items per tile of CUB's scan and unique-by-key of 8-byte values (their tile states: 16 bytes a tile,
#: after 32 tiles of padding). Fitted, with the sort's tile, to the buffers the allocator's history shows
#: on an H200 (torch 2.11, CUDA 13) for 12,416 and 329,065 indices and 10,000 to 138,493 segments.
_SCAN_TILE = 1024
_UNIQUE_TILE = 4096
#: Rows each partial sum of ATen's embedding backward adds up (``NROWS_PER_THREAD``).
_ROWS_PER_PARTIAL = 10


def _align(n: int, to: int = _CUB_ALIGN) -> int:
    return -(-n // to) * to


def radix_sort_pairs_storage(n: int, key_size: int = 8, value_size: int = 8) -> int:
    """Bytes of CUB's temporary storage to sort ``n`` key-value pairs (one-sweep, every key bit).

    Alternate key and value buffers, the histograms of every pass (8-byte counts),
    a look-back of 256 4-byte counters per tile, the pass counters, and the slack.

    Example::

        >>> radix_sort_pairs_storage(329_065), block_size(radix_sort_pairs_storage(12_416))
        (5356031, 218624)
    """
    passes = -(-8 * key_size // _SORT_BITS)
    digits = 1 << _SORT_BITS
    tiles = -(-n // _SORT_TILE)
    parts = (passes * digits * 8, tiles * digits * 4, n * key_size, n * value_size, passes * 4)
    return sum(_align(part) for part in parts) + _CUB_ALIGN - 1


def _tile_state_storage(n: int, tile: int) -> int:
    """CUB's temporary storage for a single-pass scan's tile states (16 bytes a tile for 8-byte values)."""
    return _align((-(-n // tile) + 32) * 16) + 2 * _CUB_ALIGN - 1


class KernelSteps(tuple):
    """Blocks an operator takes and gives back in a set order, some before its outputs are made.

    ``steps``: ``("take", bytes)`` (the block gets the next number, from 0),
    ``("give", number)`` and one ``("outputs",)`` where the operator's outputs
    are made. As a tuple it is the blocks alive together at the largest moment
    of the kernel's own blocks.

    Example::

        >>> steps = KernelSteps([("take", 4096), ("take", 512), ("give", 1), ("outputs",), ("take", 1024), ("give", 2), ("give", 0)])
        >>> steps, len(steps.before)
        ((4096, 1024), 3)
    """

    steps: tuple[tuple, ...]
    before: tuple[tuple, ...]
    after: tuple[tuple, ...]

    def __new__(cls, steps: Sequence[tuple]) -> KernelSteps:
        steps = tuple(tuple(step) for step in steps)
        sizes: list[int] = []
        alive: dict[int, int] = {}
        largest: tuple[int, ...] = ()
        for step in steps:
            if step[0] == "take":
                alive[len(sizes)] = int(step[1])
                sizes.append(int(step[1]))
                if sum(alive.values()) > sum(largest):
                    largest = tuple(alive.values())
            elif step[0] == "give":
                alive.pop(step[1])
        made = super().__new__(cls, largest)
        made.steps = steps
        cut = next((i for i, step in enumerate(steps) if step[0] == "outputs"), len(steps))
        made.before, made.after = steps[:cut], steps[cut + 1 :]
        return made


def embedding_backward_scratch(
    num_indices: int,
    dim: int,
    *,
    num_weights: int | None = None,
    grad_contiguous: bool = True,
    grad_element_size: int = 4,
    indices_contiguous: bool = True,
    index_element_size: int = 8,
    scale_grad_by_freq: bool = False,
) -> KernelSteps:
    """The blocks a CUDA ``embedding_dense_backward`` takes for itself, in ATen's order.

    ``num_indices`` indices (``N``) into ``num_weights`` rows (``None``: at least
    ``N``) of width ``dim`` (``D``). A non-contiguous index tensor and gradient are
    copied first. Up to 3072 indices (without ``scale_grad_by_freq``) a direct
    kernel needs nothing more. Above, ATen sorts the indices and sums each
    distinct index's rows in partials of 10 rows: with ``M = min(N, num_weights)``
    segments at most and ``P = N // 10 + M`` partials at most, it takes (each
    ``N``, ``M`` or ``P`` long, index-sized): the sorted indices, their positions,
    an ``arange`` and CUB's sort storage (both given back before the gradient is
    made); then the segment offsets, a scalar, CUB's unique-by-key (a key copy and
    its storage), ``M`` partial counts, ``M`` offsets with CUB's scan storage, a
    scalar, ``P`` partial offsets and ``P x D`` float partial sums, given back in
    the reverse order of their making at the end.
    """
    if num_indices <= 0 or dim <= 0:
        return KernelSteps(())
    steps: list[tuple] = []
    taken = 0

    def take(nbytes: int) -> int:
        nonlocal taken
        steps.append(("take", block_size(nbytes)))
        taken += 1
        return taken - 1

    def give(*numbers: int) -> None:
        steps.extend(("give", number) for number in numbers)

    n, k = num_indices, index_element_size
    copies = []
    if not indices_contiguous:
        copies.append(take(n * k))
    if not grad_contiguous:
        copies.append(take(n * dim * grad_element_size))
    if n <= _EMBEDDING_DIRECT_LIMIT and not scale_grad_by_freq:
        steps.append(("outputs",))
        give(*reversed(copies))
        return KernelSteps(steps)
    sorted_indices, positions = take(n * k), take(n * k)
    arange = take(n * k)
    give(take(radix_sort_pairs_storage(n, k, k)))
    give(arange)
    counts = [take(n * k)] if scale_grad_by_freq else []
    steps.append(("outputs",))  # the gradient, zeros of (num_weights, dim)
    segments = min(n, num_weights) if num_weights is not None else n
    partials = n // _ROWS_PER_PARTIAL + segments
    segment_offsets, segment_count = take(n * k), take(8)
    keys = take(n * k)  # CUB's unique-by-key writes the distinct keys into a copy it gives back on return
    give(take(_tile_state_storage(n, _UNIQUE_TILE)), keys)
    per_segment, per_segment_offsets = take(segments * k), take(segments * k)
    give(take(_tile_state_storage(segments, _SCAN_TILE)))
    partial_count = take(8)
    partial_offsets = take(partials * k)
    partial_sums = take(partials * dim * 4 * (2 if grad_element_size == 8 else 1))
    give(partial_sums, partial_offsets, partial_count, per_segment_offsets, per_segment)
    give(segment_count, segment_offsets)
    give(*counts, positions, sorted_indices, *reversed(copies))
    return KernelSteps(steps)


#: cuDNN's attention backward takes this many bytes past the query gradient's float32 copy and the
#: per-row floats (all 144 measured calls).
CUDNN_ATTENTION_BACKWARD_PAD = 256


def cudnn_attention_backward_scratch(query_shape: Sequence[int], grouped: Sequence[int] = ()) -> tuple[int, ...]:
    """The block cuDNN's attention backward takes (``aten._scaled_dot_product_cudnn_attention_backward``)
    for a query of ``(batch, heads, positions, head_dim)``: the query's gradient accumulated in float32
    and one float per query row, plus :data:`CUDNN_ATTENTION_BACKWARD_PAD`; with grouped-query
    attention the key's and value's gradients at every query head (``grouped``, from
    :func:`grouped_query_gradients`) in the same block.

    Example::

        >>> cudnn_attention_backward_scratch((160, 12, 128, 64))  # measured on an H100: 63,897,856
        (63897856,)
        >>> cudnn_attention_backward_scratch((16, 14, 512, 64), (14680064, 14680064))  # Qwen2: a block of 59,179,520
        (59179264,)
    """
    *leading, positions, head_dim = query_shape
    rows = math.prod(leading) * positions
    return (4 * rows * head_dim + 4 * rows + CUDNN_ATTENTION_BACKWARD_PAD + sum(grouped),)


def ctc_loss_scratch(batch: int) -> KernelSteps:
    """The blocks CUDA's ``_ctc_loss`` takes for ``batch`` sequences (``ctc_loss_gpu_template``): the
    targets' offsets copied to the device and the lengths made there (``batch`` int64 each), before its
    outputs (``log_alpha``, the losses), given back at its return.

    Example::

        >>> tuple(ctc_loss_scratch(16))
        (128, 128, 128)
    """
    small = 8 * batch
    return KernelSteps([("take", small), ("take", small), ("take", small), ("outputs",), ("give", 0), ("give", 1), ("give", 2)])


def ctc_loss_backward_scratch(
    log_probs_shape: Sequence[int], log_alpha_shape: Sequence[int], element_size: int, *, zero_infinity: bool
) -> KernelSteps:
    """The blocks CUDA's ``_ctc_loss_backward`` takes (``ctc_loss_backward_gpu_template``) for log
    probabilities of ``(frames, batch, classes)`` and ``log_alpha`` of ``(batch, frames, 2 L + 1)``:
    the lengths and the targets' offsets on the device, ``log_beta`` (``log_alpha``'s size), then the
    gradient; for a large problem (ATen's own test of the sizes) the blanks' term, a ``logsumexp``
    over ``log_alpha + log_beta`` at the blank positions (``(batch, frames, L + 1)``: the sum, and
    ``logsumexp``'s maxima, their ``abs() == inf`` test, the shifted copy and the result); with
    ``zero_infinity`` the gradient is made again by ``where`` (the first one given back after it).
    The operator's output is the last gradient.

    Example::

        >>> steps = ctc_loss_backward_scratch((400, 16, 32), (16, 400, 121), 4, zero_infinity=False)
        >>> sum(steps)  # log_beta, the sum and the shifted copy, maxima, result, the small blocks
        6272384
    """
    frames, batch, classes = log_probs_shape
    width = log_alpha_shape[2] // 2 + 1  # the blank positions: L + 1
    small = 8 * batch
    log_beta = math.prod(log_alpha_shape) * element_size
    steps: list[tuple] = [("take", small), ("take", small), ("take", small), ("take", log_beta)]
    taken = 4
    if zero_infinity:
        steps.append(("take", math.prod(log_probs_shape) * element_size))  # the first gradient
        first = taken
        taken += 1
    else:
        steps.append(("outputs",))
    if 2 * frames + (24 * batch) // 10 + (2 * classes) // 10 > 450:
        blanks = batch * frames * width * element_size
        rows = batch * frames * element_size
        steps += [("take", blanks), ("take", rows), ("take", rows), ("take", batch * frames)]  # sum, maxima, abs, == inf
        steps += [("give", taken + 2), ("give", taken + 3), ("take", blanks), ("take", rows)]  # the shifted copy, result
        steps += [("give", taken + 4), ("give", taken + 1), ("give", taken), ("give", taken + 5)]
        taken += 6
    if zero_infinity:
        steps += [("take", batch), ("take", element_size), ("outputs",), ("give", taken), ("give", taken + 1), ("give", first)]
    steps += [("give", 3), ("give", 0), ("give", 1), ("give", 2)]
    return KernelSteps(steps)


def flash_attention_backward_scratch(query_shape: Sequence[int], grouped: Sequence[int] = ()) -> tuple[int, ...]:
    """The buffers flash attention's backward makes for a query of ``(batch, heads, positions,
    head_dim)``: the query's gradient accumulated in float32 and a float per row, positions rounded
    up to 128 and the head dim to 32 (FlashAttention-2's ``dq_accum`` and ``softmax_d``), as one
    block of :func:`cudnn_attention_backward_scratch`'s layout; with grouped-query attention
    ``dk_expanded`` and ``dv_expanded`` after it (``grouped``).

    Example::

        >>> flash_attention_backward_scratch((8, 12, 1024, 64)) == cudnn_attention_backward_scratch((8, 12, 1024, 64))
        True
        >>> flash_attention_backward_scratch((8, 12, 1000, 80)) == cudnn_attention_backward_scratch((8, 12, 1024, 96))
        True
    """
    *leading, positions, head_dim = query_shape
    rounded = cudnn_attention_backward_scratch((*leading, -(-positions // 128) * 128, -(-head_dim // 32) * 32))
    return rounded + tuple(grouped)


def efficient_attention_backward_scratch(query_shape: Sequence[int], itemsize: int, keys: int | None = None) -> tuple[int, ...]:
    """The blocks the efficient attention kernel's backward
    (``aten._scaled_dot_product_efficient_attention_backward``) takes after the three gradients and
    gives back before it returns, for a query of ``(batch, heads, positions, head_dim)`` of
    ``itemsize`` bytes an element and ``keys`` key positions (default: the query's): in float32 a
    block of the query's gradient's size and two floats per query row, in half precision one float
    per query row (its ``delta``); then the kernel's workspace, in float32:

    - up to a head dim of 128, the query gradient's split-keys accumulator: positions rounded up to
      the kernel's query block and the head dim to its bucket (64 up to 64, else 128), with 16 bytes
      per query block; the query block is 128 positions for half precision at a bucket of 128, else 64;
    - above 128 (the kernel built for any head dim), the accumulator in tiles of 128 positions by 64
      columns, 16 bytes each beside; in half precision also the key's and the value's gradients
      staged per split of the keys, each split 64 keys by the head dim rounded up to 128, the
      splits ``ceil(keys / 64)``, one where ``batch * heads`` is 256 or more over at most 128 keys,
      and at most ``200 // (batch * heads)`` (ATen's heuristic, which bounds what that staging takes).

    Measured to the byte on all 269 calls of ``benchmarks/attention_backward_rules.py`` (an H200,
    torch 2.11: float32 and bf16; batch 8 to 112, 4 to 16 heads, 128 to 1,024 positions, head dims
    32 to 512; query, key and value packed in one tensor or apart; masked, causal or neither).

    Example::

        >>> efficient_attention_backward_scratch((112, 12, 512, 64), 4)   # measured: the same four blocks
        (176160768, 2752512, 2752512, 176332800)
        >>> efficient_attention_backward_scratch((8, 12, 500, 80), 2)     # bf16: delta, then the accumulator
        (192000, 25171968)
        >>> efficient_attention_backward_scratch((8, 4, 512, 512), 2)     # bf16, head dim 512: six key splits
        (65536, 83902464)
    """
    *leading, positions, head_dim = query_shape
    keys = positions if keys is None else keys
    pairs = math.prod(leading)
    rows = 4 * pairs * positions
    if head_dim <= 128:
        bucket = 64 if head_dim <= 64 else 128
        block = 128 if itemsize < 4 and bucket == 128 else 64
        workspace = pairs * -(-positions // block) * (16 + 4 * block * bucket)
    else:
        per_pair = -(-positions // 128) * -(-head_dim // 64) * (16 + 4 * 128 * 64)
        if itemsize < 4:
            splits = -(-keys // 64)
            if pairs >= 256 and keys <= 128:
                splits = 1
            splits = max(1, min(splits, 200 // pairs))
            per_pair += 2 * 4 * splits * 64 * (-(-head_dim // 128) * 128)
        workspace = pairs * (-(-per_pair // 16) * 16)
    if itemsize >= 4:
        return (pairs * positions * head_dim * itemsize, rows, rows, workspace)
    return (rows, workspace)


#: The largest head dim the efficient attention kernels that keep their output in registers take
#: (ATen's ``rf`` kernels); above it the ``gmem`` kernel, built for any head dim, runs.
EFFICIENT_ATTENTION_REGISTER_HEAD_DIM = 128


def efficient_attention_forward_scratch(
    batch: int, positions: int, heads: int, head_dim: int, value_head_dim: int, itemsize: int
) -> tuple[int, ...]:
    """The block the efficient attention kernel's forward takes beside its outputs and gives back:
    where the query's or the value's head dim is above 128, the kernel built for any head dim runs,
    which accumulates the output in global memory, in float32 (``output_accum``, ``(batch,
    positions, heads, value_head_dim)``); in float32 it accumulates in the output itself, and up to
    128 in registers, so nothing.

    Measured to the byte on an H200 (torch 2.11, the allocator's history of a step of
    ``WideHeads`` in ``tests/test_estimate_attention_backward_cuda.py``): 5,242,880 bytes at head
    dim 320 and 8,388,608 at 512 for (8, 4, 128, d) in bf16, none in float32.

    Example::

        >>> efficient_attention_forward_scratch(8, 128, 4, 512, 512, 2), efficient_attention_forward_scratch(8, 128, 4, 512, 512, 4)
        ((8388608,), ())
        >>> efficient_attention_forward_scratch(8, 128, 4, 128, 128, 2)
        ()
    """
    if itemsize >= 4 or max(head_dim, value_head_dim) <= EFFICIENT_ATTENTION_REGISTER_HEAD_DIM:
        return ()
    return (4 * batch * positions * heads * value_head_dim,)


def _efficient_attention_forward(heads_second: bool) -> Callable[[tuple, dict], tuple[int, ...]]:
    # aten._scaled_dot_product_efficient_attention(query, key, value, ...): (batch, heads, positions, head dim);
    # aten._efficient_attention_forward(query, key, value, ...): (batch, positions, heads, head dim)
    def scratch(args: tuple, kwargs: dict) -> tuple[int, ...]:
        query = args[0] if args else kwargs.get("query")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        if not isinstance(query, torch.Tensor) or not isinstance(value, torch.Tensor) or query.dim() != 4 or value.dim() != 4:
            return ()
        batch, second, third, head_dim = query.shape
        heads, positions = (second, third) if heads_second else (third, second)
        return efficient_attention_forward_scratch(batch, positions, heads, head_dim, value.shape[-1], query.element_size())

    return scratch


def grouped_query_gradients(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, ...]:
    """The bytes of the key's and value's gradients at every query head, which an attention backward
    makes before summing each group of heads down (``()`` where key and value have the query's heads).

    Example::

        >>> with torch.device("meta"):
        ...     q, kv = torch.empty(16, 14, 512, 64, dtype=torch.bfloat16), torch.empty(16, 2, 512, 64, dtype=torch.bfloat16)
        >>> grouped_query_gradients(q, kv, kv), grouped_query_gradients(q, q, q)
        ((14680064, 14680064), ())
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.size(1) == key.size(1) == value.size(1):
        return ()
    batch, heads = query.size(0), query.size(1)
    return tuple(batch * heads * t.size(2) * t.size(3) * t.element_size() for t in (key, value))


def _ctc_loss(args: tuple, kwargs: dict) -> tuple[int, ...]:
    log_probs = args[0] if args else kwargs.get("log_probs")
    if not isinstance(log_probs, torch.Tensor):
        return ()
    return ctc_loss_scratch(log_probs.shape[1] if log_probs.dim() == 3 else 1)


def _ctc_loss_backward(args: tuple, kwargs: dict) -> tuple[int, ...]:
    # (grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity)
    names = ("grad", "log_probs", "targets", "input_lengths", "target_lengths", "neg_log_likelihood", "log_alpha", "blank",
             "zero_infinity")  # fmt: skip
    bound = {**dict(zip(names, args)), **kwargs}
    log_probs, log_alpha = bound.get("log_probs"), bound.get("log_alpha")
    if not isinstance(log_probs, torch.Tensor) or not isinstance(log_alpha, torch.Tensor) or log_probs.dim() != 3:
        return ()
    return ctc_loss_backward_scratch(tuple(log_probs.shape), tuple(log_alpha.shape), log_probs.element_size(),
                                     zero_infinity=bool(bound.get("zero_infinity", False)))  # fmt: skip


def _efficient_attention_backward(args: tuple, kwargs: dict) -> tuple[int, ...]:
    # (grad_out, query, key, value, ...)
    grad_out = args[0] if args else kwargs.get("grad_out")
    query = args[1] if len(args) > 1 else kwargs.get("query")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return ()
    key = args[2] if len(args) > 2 else kwargs.get("key")
    keys = key.shape[-2] if isinstance(key, torch.Tensor) and key.dim() == 4 else None
    return efficient_attention_backward_steps(query.shape, query.element_size(), keys, efficient_attention_grad_out_copy(grad_out))


def efficient_attention_backward_steps(
    query_shape: Sequence[int], itemsize: int, keys: int | None = None, copy: int = 0
) -> tuple[int, ...]:
    """The efficient attention backward's blocks (:func:`efficient_attention_backward_scratch`) in the
    order the call takes and gives them back (:class:`KernelSteps`), with ``copy`` bytes of the output's
    gradient copied before the gradients (:func:`efficient_attention_grad_out_copy`).

    In float32 the call makes the product of the output and its gradient and its two row sums
    (``delta``) in one statement, and gives the product and one sum back before it takes the workspace:
    an H200's allocator history of Gemma 4's head dim 512 held the workspace's 8,392,704 bytes apart from
    the product's 8,388,608. In half precision its one row sum and the workspace are held together.

    Example::

        >>> steps = efficient_attention_backward_steps((8, 4, 128, 512), 4)
        >>> sum(steps) == 8388608 + 2 * 16384   # the product and both sums; the workspace alone is smaller
        True
    """
    after = efficient_attention_backward_scratch(query_shape, itemsize, keys)
    if not copy and len(after) < 4:
        return after
    # the copy first, before the gradients; the rest after them; the copy given back last
    steps: list[tuple] = [("take", copy), ("outputs",)] if copy else [("outputs",)]
    first = 1 if copy else 0
    if len(after) == 4:
        product, rows, kept, workspace = (first + i for i in range(4))
        steps += [("take", after[0]), ("take", after[1]), ("take", after[2]), ("give", product), ("give", rows)]
        steps += [("take", after[3]), ("give", workspace), ("give", kept)]
    else:
        steps += [("take", nbytes) for nbytes in after]
        steps += [("give", number) for number in range(first + len(after) - 1, first - 1, -1)]
    if copy:
        steps.append(("give", 0))
    return KernelSteps(steps)


def efficient_attention_grad_out_copy(grad_out: Any) -> int:
    """The bytes of the contiguous copy ATen's ``_efficient_attention_backward`` makes of the output's
    gradient before anything else (``grad_out_.contiguous()`` of its ``(batch, positions, heads,
    head_dim)`` view), 0 where that view is contiguous already: the gradient as a model hands it
    back laid out as the kernel's output (transformers' ``transpose(1, 2).reshape``), where
    ``nn.MultiheadAttention``'s ``permute(2, 0, 1, 3).contiguous()`` hands back positions first.

    Example::

        >>> with torch.device("meta"):
        ...     as_output = torch.empty(8, 512, 12, 64).transpose(1, 2)           # (8, 12, 512, 64)
        ...     positions_first = torch.empty(512, 8, 12, 64).permute(1, 2, 0, 3)
        >>> efficient_attention_grad_out_copy(as_output), efficient_attention_grad_out_copy(positions_first)
        (0, 12582912)
    """
    if not isinstance(grad_out, torch.Tensor) or grad_out.dim() != 4 or grad_out.transpose(1, 2).is_contiguous():
        return 0
    return grad_out.numel() * grad_out.element_size()


def safe_softmax_scratch(shape: Sequence[int], dim: int, itemsize: int) -> tuple[int, ...]:
    """The blocks ``_safe_softmax`` takes on CUDA beside its output, given back before it returns: a
    ``bool`` of the input's size (its ``-inf`` entries), one of its rows (rows all ``-inf``), and a
    0-dim tensor of the output's dtype (the zero written into those rows).

    The H200's allocator history of math attention (Qwen2, fp32 scores of (17, 14, 512, 512), torch
    2.11): 62,390,272, 121,856 and 4 bytes after the 249,561,088-byte output, then freed. That is
    the composite torch 2.11 and 2.13 run (``isneginf``, ``all``, a zero, ``where`` written into the
    output's own storage; ``torch.profiler`` on 2.13 lists those). An older composite compared with
    a 0-dim ``-inf`` and made ``where``'s result a new tensor, a second output-sized block this rule
    does not take.

    Example::

        >>> safe_softmax_scratch((17, 14, 512, 512), -1, 4)
        (62390272, 121856, 512)
    """
    numel = math.prod(shape)
    rows = numel // shape[dim] if shape and shape[dim] else 0
    return tuple(block_size(n) for n in (numel, rows, itemsize) if n > 0)


def _safe_softmax(args: tuple, kwargs: dict) -> tuple[int, ...]:
    tensor = args[0] if args else kwargs.get("self")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return ()
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    return safe_softmax_scratch(tuple(tensor.shape), dim, (dtype or tensor.dtype).itemsize)


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
    #: bytes each kept pass may ask beyond its blocks (its first block's headroom; see
    #: ``ConvScratch.headroom``): the allocator replay's upper figure takes them
    headroom: tuple[int, ...]
    #: whether each kept pass's blocks are a workspace the library does without when the allocator
    #: refuses it (``ConvScratch.fallback``): the allocator replay under a limit skips them then
    fallback: tuple[bool, ...]

    def __new__(
        cls, held: Sequence[int] = (), passes: Sequence[Sequence[int]] = (), headroom: Sequence[int] = (),
        fallback: Sequence[bool] = (),
    ) -> Passes:  # fmt: skip
        held = tuple(n for n in held if n > 0)
        room = list(headroom) + [0] * (len(passes) - len(headroom))
        gives_way = list(fallback) + [False] * (len(passes) - len(fallback))
        kept = [(tuple(n for n in one if n > 0), extra, way) for one, extra, way in zip(passes, room, gives_way)]
        kept = [entry for entry in kept if entry[0]]
        largest = max((one for one, _, _ in kept), key=sum, default=())
        made = super().__new__(cls, held + largest)
        made.held, made.passes = held, tuple(one for one, _, _ in kept)
        made.headroom, made.fallback = tuple(extra for _, extra, _ in kept), tuple(way for _, _, way in kept)
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
        #: the operations of ``bounds`` whose bound is of cuDNN's workspaces, which give way under a
        #: memory limit (``ConvScratch.fallback``): a batch search leaves no room for them
        self.fallback_bounds: set[str] = set()
        #: take convolutions' scratch from :data:`.kernel_probe.MEASURED` where measured; calls not
        #: measured yet are kept in ``pending`` (and take the rule) for the caller to measure
        self.measured = measured
        self.pending: set[tuple] = set()
        aten = torch.ops.aten
        self._rules: dict[Any, Callable[[tuple, dict], tuple[int, ...]]] = {
            aten.sum.dim_IntList: self._reduction,
            aten.mean.dim: self._reduction,
            aten.sum.default: self._reduction,
            aten.mean.default: self._reduction,
            aten.embedding_dense_backward.default: self._embedding_backward,
            aten.convolution.default: self._convolution,
            aten.convolution_backward.default: self._convolution_backward,
            aten._scaled_dot_product_cudnn_attention_backward.default: self._attention_backward(cudnn_attention_backward_scratch),
            **({aten._safe_softmax.default: _safe_softmax} if hasattr(aten, "_safe_softmax") else {}),  # torch 2.5 and later
            aten._scaled_dot_product_flash_attention_backward.default: self._attention_backward(flash_attention_backward_scratch),
            aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward,
            aten._scaled_dot_product_efficient_attention.default: _efficient_attention_forward(heads_second=True),
            **({aten._efficient_attention_forward.default: _efficient_attention_forward(heads_second=False)}
               if hasattr(aten, "_efficient_attention_forward") else {}),  # fmt: skip
            aten._ctc_loss.default: _ctc_loss,
            aten._ctc_loss.Tensor: _ctc_loss,
            aten._ctc_loss_backward.default: _ctc_loss_backward,
            aten._ctc_loss_backward.Tensor: _ctc_loss_backward,
            # the CPU's flash kernel stands in for CUDA's where the emulation runs grouped-query attention
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: self._attention_backward(flash_attention_backward_scratch),
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
        # sum / mean (self, dim=None, keepdim=False, *, dtype=None) and their full forms (self, *, dtype=None)
        tensor = args[0] if args else kwargs.get("self")
        if not isinstance(tensor, torch.Tensor):
            return ()
        # summed to another dtype: a copy of the input in it first (a boolean mask's sum: int64's)
        reduced, copy = reduction_cast_copy(tensor, kwargs.get("dtype"))  # dtype is keyword-only in every form
        if reduced not in REDUCED_DTYPES and reduced not in WIDE_ACCUMULATORS:
            return (copy,) if copy else ()  # the partial sums of other dtypes: not measured
        # float32 partial sums for half precision (read as it is, summed to float32 too), 8 bytes for the wide
        accumulator = max(PARTIAL_BYTES, reduced.itemsize)
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if copy:  # the copy is laid out as the input where that is dense, else contiguously
            strides, offset = copy_strides(tensor), 0
        else:
            strides, offset = tuple(tensor.stride()), tensor.storage_offset()
        partial = reduction_scratch(tuple(tensor.shape), strides, dims, reduced.itemsize, storage_offset=offset,
                                    multiprocessors=self.multiprocessors, threads_per_multiprocessor=self.threads_per_multiprocessor,
                                    accumulator=accumulator)  # fmt: skip
        return (copy, *partial) if copy else partial

    @staticmethod
    def _attention_backward(rule: Callable[..., tuple[int, ...]]) -> Callable[[tuple, dict], tuple[int, ...]]:
        def scratch(args: tuple, kwargs: dict) -> tuple[int, ...]:
            # (grad_out, query, key, value, ...)
            query, key, value = (args[i] if len(args) > i else kwargs.get(name) for i, name in ((1, "query"), (2, "key"), (3, "value")))
            if not isinstance(query, torch.Tensor) or query.dim() != 4:
                return ()
            grouped = grouped_query_gradients(query, key, value) if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) else ()
            return rule(query.shape, grouped)

        return scratch

    def _batch_norm_bound(self, rule: Callable[[tuple, dict], tuple[int, ...]] | None) -> Callable[[tuple, dict], tuple[int, ...]]:
        """cuDNN's NHWC batch norm takes a workspace (1.06 MB forward, 0.70 MB backward measured for
        fp32 (8, 64, 128, 128)), its size otherwise unmeasured: a bound, no estimate."""

        def bounded(args: tuple, kwargs: dict) -> tuple[int, ...]:
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            if any(t.dim() == 4 and memory_format(t) == "channels_last" for t in tensors):
                self._bound(BATCH_NORM_BOUND, BATCH_NORM_WORKSPACE_BOUND)
            return rule(args, kwargs) if rule is not None else ()

        return bounded

    def _convolution_bound(self, operation: str, found: ConvScratch) -> None:
        """A convolution call's bound: cuDNN's workspaces', which give way under a limit, but over a
        1-D channels-innermost input (``ConvScratch.channels_innermost``), named apart."""
        innermost = found.channels_innermost
        name = operation + (CHANNELS_INNERMOST_LAYOUT if innermost else "")
        self._bound(name, found.bound, fallback=found.backend == "cudnn" and not innermost)

    def _bound(self, operation: str, nbytes: int, *, fallback: bool = False) -> None:
        if nbytes > 0:
            self.bounds[operation] = max(self.bounds.get(operation, 0), nbytes)
            if fallback:
                self.fallback_bounds.add(operation)

    def _measured(self, func: Any, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """The call's measured scratch, as one block; ``None`` where there is none (then pending)."""
        if not self.measured:
            return None
        value = measured_or_pending(convolution_key(func, args, kwargs), self.pending)
        return None if value is None else Passes((), ((value,),))

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
        self._convolution_bound(CONVOLUTION_BOUND, found)
        return Passes(found.held, found.passes, fallback=found.fallback)

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
        # a cuDNN call's bound is its workspaces' (and a few KiB of the bias gradient's reduction)
        self._convolution_bound(CONVOLUTION_BACKWARD_BOUND, found)
        return Passes(found.held, found.passes, found.headroom, found.fallback)

    def _embedding_backward(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        grad, indices = args[0], args[1]
        scale = bool(args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False))
        if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor) or grad.dim() == 0:
            return ()
        num_weights = args[2] if len(args) > 2 else kwargs.get("num_weights")
        return embedding_backward_scratch(
            indices.numel(),
            grad.shape[-1],
            num_weights=int(num_weights) if num_weights is not None else None,
            grad_contiguous=grad.is_contiguous(),
            grad_element_size=grad.element_size(),
            indices_contiguous=indices.is_contiguous(),
            index_element_size=indices.element_size(),
            scale_grad_by_freq=scale,
        )
