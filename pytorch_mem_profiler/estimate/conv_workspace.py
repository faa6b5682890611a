"""cuDNN's convolution workspaces on CUDA: the blocks a convolution takes inside its operator, and the bound.

On CUDA, ``aten.convolution`` and ``aten.convolution_backward`` run cuDNN (or, for
depthwise convolutions that are not ``channels_last``, a kernel of torch's own,
which takes none). Inside the operator, and given back before it returns, they
take from the caching allocator:

- **layout copies** (exact): ATen hands cuDNN its tensors in one memory format,
  ``channels_last`` when the input or the weight is in it, else contiguous
  (``cudnn_conv_suggest_memory_format``), and copies each input, weight or output
  gradient that is not (a channel slice of a concatenation, a ``channels_last``
  weight with a contiguous input, the expanded gradient of a ``sum``);
- **cuDNN's workspace** for each pass (forward; backward data, then backward
  filter): what the execution plan picked by cuDNN's heuristics asks for
  (``plan.getWorkspaceSize()`` in ``Conv_v8.cpp``, allocated from the caching
  allocator for the call). On Hopper with cuDNN 9, the plans for contiguous (NCHW)
  tensors are NHWC kernels wrapped in layout transforms whose workspace holds the
  transformed tensors: the pass's input, output and filter in NHWC, channels
  padded to a multiple of 8 in 16-bit precision, one block of
  ``sum(align256(part)) + 256`` bytes (:func:`transforms_bytes`; a 1x1 filter is
  not transformed). ``channels_last`` plans pad only tensors whose channels are
  not a multiple of 8. Which plan the heuristics pick is cuDNN's own, and not
  documented: :func:`cudnn_pass_workspace` sorts the calls into the classes the
  measurements show, gives each its figure, and states the spread measured around
  it as the pass's error bound;
- the **bias gradient**: ``grad_output.sum`` over all but the channels, after the
  passes: a column reduction (:func:`~.scratch.column_reduction_scratch`) where
  the gradient is ``channels_last``, a few KiB where it is NCHW (bounded).

Measured on an H100 (torch 2.11, cuDNN 9.19; ``benchmarks/conv_workspace_rules.py``,
306 calls: 29 shapes of conv1d, conv2d, conv3d and transposed convolutions, kernels
1 to 7, strides 1 and 2, grouped and depthwise, 1 to 512 channels, fp32 and bf16,
NCHW and ``channels_last``, forward and backward; the default flags, ``benchmark``
and no TF32) and in the zoo's training steps (UNet, ResNet-18/50, a VGG-style CNN,
MobileNet). The sweep's 41 NCHW forwards of kernels 2 to 7 are the transforms to the
byte in 30, within 8.9 MB in the rest; in the zoo's steps the largest forwards are
exact (268,546,560 for UNet's fp32 (8, 96, 256, 256) -> 32; 822,157,824 for the
VGG's bf16 (64, 64, 224, 224) -> 64; 308,332,032 for ResNet-18's bf16 stem, whose 3
channels are padded to 8), the others within 8.4 MB or the output (which one plan
writes in NCHW itself). Backward filter passes ask a little more than the
transforms (split-K partial sums) and, where the data pass or the forward left a
free block of the transforms rounded up to 2 MiB, are handed that block whole (the
allocator splits off no rest under 1 MiB): measured as exactly that in 9 of the 24
large ones, up to 32 MB above it in the rest. All 306 calls of the sweep are within
the rule's bound. 1-D convolutions over channels-innermost input (:func:`channels_innermost_1d`)
were measured on an H200 (cuDNN 9.19, 77 calls of five shapes in fp32, bf16 and fp16): their
passes hold the input's and the gradient's copy-sized shares beside the NCHW workspace, and their
bias gradient's sum takes a copy of the gradient and a column reduction; 38 of the calls are
exact and the rest within the bound or over it.

In backward, the data pass runs before the weight gradient exists and the filter
pass before the bias gradient does, so the operator's scratch above its outputs
is ``copies + max(ws_data - grad_weight - grad_bias, ws_filter - grad_bias,
bias reduction)``. :func:`convolution_scratch` and
:func:`convolution_backward_scratch` give the copies (held through the operator)
and each pass's blocks (taken in turn) with the bound; :class:`~.scratch.KernelScratch`
hands the blocks to the counter and the allocator's replay, the bound to
``MemoryEstimate.error_bounds``. Where the estimate runs on fake CUDA tensors with
the GPU at hand, ``measure_kernels=True`` measures each call instead
(:mod:`.kernel_probe`).

Under a memory limit cuDNN's workspace gives way: ``run_single_conv`` in
``Conv_v8.cpp`` catches the allocator's ``OutOfMemoryError`` for a plan's
workspace and runs the next plan the heuristics list, down to the fallback
list's, which take little or none. A step whose workspaces do not fit still
runs (its ``memory_stats()["num_ooms"]`` counts the refusals: 41 for UNet at
batch 21 under 4.75 GiB on an H200, where batch 20 met none). The passes'
blocks say so (:attr:`ConvScratch.fallback`): the allocator replay under a
limit does without a block it cannot place, and the batch search leaves no
room for their bound (see ``MemoryEstimate.batch_search``). The layout copies
and the bias gradient's reduction are ATen's and give way to nothing, and a
1-D convolution over channels-innermost input (:func:`channels_innermost_1d`),
which the device runs channels_last, keeps its workspaces and its bound.

``torch.backends.cudnn.benchmark=True``: the steady workspace is the heuristics'
(measured the same), but the first call of each shape times every candidate plan
in one workspace as large as the largest candidate's that fits the free memory
(2.34 GB measured for a 3x3 fp32 convolution whose steady workspace is 18 MB): the
bound adds :data:`BENCHMARK_SEARCH_BOUND` and twice the transforms. Not covered:
``deterministic`` plans, dilated convolutions (the rule of their undilated
shape; the filter pass's bound covers :data:`DILATED_FILTER_PARTIALS` fp32 partial
weight gradients, which DeepLabV3's were measured to take), 64-bit-indexed
convolutions, MIOpen, other GPUs and cuDNN versions (the classes were measured
on Hopper with cuDNN 9.19: run the benchmark on yours).

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     x, w = torch.empty(8, 96, 256, 256), torch.empty(32, 96, 3, 3)
    >>> found = convolution_scratch(x, w, stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, groups=1)
    >>> found.blocks, found.backend                          # UNet's decoder convolution, fp32: 268,546,560 measured
    ((268546560,), 'cudnn')
    >>> with torch.device("meta"):
    ...     x, w = torch.empty(128, 3, 224, 224, dtype=torch.bfloat16), torch.empty(64, 3, 7, 7, dtype=torch.bfloat16)
    >>> convolution_scratch(x, w, stride=[2, 2], padding=[3, 3], dilation=[1, 1], transposed=False, groups=1).blocks
    (308332032,)
    >>> x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    >>> convolution_scratch(x_cl, w_cl, stride=[2, 2], padding=[3, 3], dilation=[1, 1], transposed=False, groups=1).blocks
    (102811136,)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from .allocator import MIN_LARGE_ALLOC, ROUND_LARGE, block_size

__all__ = [
    "TRANSFORM_HEADER",
    "BENCHMARK_SEARCH_BOUND",
    "DILATED_FILTER_PARTIALS",
    "ConvScratch",
    "memory_format",
    "channels_innermost_1d",
    "conv_backend",
    "nhwc_bytes",
    "transforms_bytes",
    "cudnn_pass_workspace",
    "PassWorkspace",
    "pointwise_filter_partials",
    "convolution_scratch",
    "convolution_backward_scratch",
    "rule_for_sweep_case",
]

#: Bytes the transforms' workspace carries past the transformed tensors (each aligned to 256 bytes).
TRANSFORM_HEADER = 256
#: Channels are padded to a multiple of this for cuDNN's tensor-core kernels in 16-bit precision.
HALF_CHANNEL_MULTIPLE = 8
#: The spread of cuDNN's own workspace around the rule (split-K partial sums, another plan): a pass's
#: bound is :data:`WORKSPACE_FLOOR` plus this share of its transforms. Measured on an H100 (cuDNN
#: 9.19, 216 calls of ``benchmarks/conv_workspace_rules.py``): backward passes up to 32 MB (6.5%)
#: above the transforms for ResNet's fp32 stem, 14.4 MB above 19 MB for fp32 (8, 256, 32, 32) -> 256;
#: forwards up to 8.4 MB; channels_last ones up to 8.4 MB (16-bit) above the rule.
WORKSPACE_SHARE = 0.1
WORKSPACE_FLOOR = 16 << 20
#: An fp32 NCHW filter pass asks past the transforms rounded up to 2 MiB by at least this (8 of 9
#: measured: 115,712 bytes for three 64 -> 64 3x3 shapes, up to 12.6 MB), so it takes a segment of
#: its own after the data pass's; in 16-bit it fits that block (6 of 11 exactly).
FP32_FILTER_EXCESS = 115_712
#: A 2-D forward of fewer than 8 input channels takes the transforms only with a kernel this large
#: (ResNet's 7x7 stem; 3x3 first layers, 3-D and 1-D ones took none).
STEM_KERNEL_AREA = 49
#: Up to this many input channels (images, audio) such a forward took no workspace in every call
#: measured; from there to 8 one did (5 channels, bf16).
FIRST_LAYER_CHANNELS = 4
#: A pointwise (1x1, stride 1, unpadded) 2-D NCHW convolution of at least this many output positions
#: per image runs as GEMMs on NCHW, without the transforms: its forward and data passes take none, its
#: filter pass one fp32 partial weight gradient per image (:func:`pointwise_filter_partials`) or,
#: where those are larger, the transforms. Measured on an H100 (cuDNN 9.19) in the training steps of
#: EfficientNet-B0, MobileNetV2, RegNet, MobileNetV3, SqueezeNet and GoogLeNet: of 89 backward calls
#: of 13x13 to 112x112 positions, 78 took the partials (to 0.1%), 87 the smaller of the two within
#: 2.3 MiB and all within 8.4 MB of it; the 89 forwards there took none. At 7x7 the forwards took the
#: transforms, and 13 of 19 backward calls (the other 6, fp32, more: up to 3.4 times them, the
#: partials); in bf16 MNASNet's expanding and contracting 1x1s took the partials in 6 of 10 calls,
#: up to 12 times the transforms, where GoogLeNet's and ShuffleNetV2's took the transforms, so at 7x7
#: the filter pass's bound covers the partials. Between 7x7 and 13x13 nothing was measured: the
#: threshold lies there.
POINTWISE_GEMM_POSITIONS = 100
#: fp32 without TF32 (``torch.backends.cudnn.allow_tf32 = False``): the filter pass takes this many
#: times the transforms (2.25 to 4.2 measured), forward and data passes none on NCHW; bound: twice them.
NO_TF32_FILTER_SHARE = 2.5
#: A depthwise convolution on cuDNN (``channels_last``) in fp32: the backward measured 4.1 times its
#: tensors (7x7, 96 channels): the bound is this many times the transforms.
FP32_DEPTHWISE_SHARE = 5
#: A dilated NCHW convolution's filter pass took this many fp32 partial weight gradients where the rule
#: of its undilated shape gives the transforms: DeepLabV3's ASPP on an H100 and an H200 (cuDNN 9.19,
#: fp32, 2048 -> 256 3x3 at 32 x 32, batch 8, dilations 12, 24 and 36: 245,366,928 bytes each, 13 times
#: the weight's 18,874,368, against the transforms' 94.4 MB). One shape measured, so not the estimate:
#: the bound, which the largest batch leaves free.
DILATED_FILTER_PARTIALS = 13
#: The bias gradient's sum over all but the channels of an NCHW gradient: a few KiB measured.
NCHW_BIAS_REDUCTION_BOUND = 64 << 10
#: Under ``cudnn.benchmark`` the first call of a shape times every candidate plan in one workspace
#: as large as the largest candidate's that fits the free memory: measured up to 2.34 GB for a fp32
#: 3x3 (8, 512, 16, 16) convolution whose steady workspace is 18 MB. The bound adds this and twice
#: the transforms.
BENCHMARK_SEARCH_BOUND = 5 << 29

_HALF = (torch.float16, torch.bfloat16)


class PassWorkspace(NamedTuple):
    """One cuDNN pass's workspace by the rule (:func:`cudnn_pass_workspace`)."""

    nbytes: int
    bound: int
    #: a filter pass that sums split-K partial weight gradients beside the transforms
    sums_partials: bool


@dataclass(frozen=True)
class ConvScratch:
    """What one convolution operator takes inside it (bytes), and the bytes that may be off by.

    ``held``: the layout copies, alive through the operator; ``passes``: the blocks of
    each pass (cuDNN's forward, backward-data and backward-filter workspaces, the bias
    gradient's reduction), each given back before the next, less the gradients made
    after it (so that each pass's figure is its height above the operator's outputs).
    """

    held: tuple[int, ...] = ()
    passes: tuple[tuple[int, ...], ...] = ()
    bound: int = 0
    #: ``"cudnn"``, ``"depthwise"`` (torch's own kernel), ``"empty"``, or ``"other"`` (not CUDA's)
    backend: str = "other"
    #: bytes each of ``passes`` may ask beyond its figure (empty: none), for the allocator replay's
    #: upper figure (``MemoryEstimate.reserved_bound``): a backward filter pass that sums split-K
    #: partial weight gradients beside the transforms asks for as many as cuDNN's heuristics choose
    #: for the call (measured on an H200 in bf16 from none to 13 fp32 weight gradients for 3x3
    #: convolutions, 61 and 122 for stems), and a request past the block the data pass left takes a
    #: segment of its own: its bound
    headroom: tuple[int, ...] = ()
    #: whether each of ``passes`` is cuDNN's workspace, which cuDNN does without when the allocator
    #: refuses it (it runs the next plan; empty: none is); not over a 1-D channels-innermost input
    #: (:func:`channels_innermost_1d`)
    fallback: tuple[bool, ...] = ()
    #: a 1-D convolution over channels-innermost input (:func:`channels_innermost_1d`): its workspaces
    #: and its bound do not give way
    channels_innermost: bool = False

    @property
    def blocks(self) -> tuple[int, ...]:
        """The blocks alive at the operator's peak: the copies and the largest pass."""
        largest = max(self.passes, key=sum, default=())
        return tuple(b for b in (*self.held, *largest) if b > 0)


# -- layouts -----------------------------------------------------------------------
def _channels_last_strides(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """ATen's ``is_channels_last_strides_2d``/``_3d``: strides ordered channels innermost, NCHW where ambiguous."""
    order = (1, 3, 2, 0) if len(sizes) == 4 else (1, 4, 3, 2, 0)
    if strides[1] == 0:
        return False
    least = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < least:
            return False
        if d == 0 and least == strides[1]:
            return False  # N111-like: contiguous is the default reading
        least = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def memory_format(tensor: torch.Tensor) -> str:
    """``"channels_last"`` where ``tensor`` (4-D or 5-D) suggests it, as ``suggest_memory_format`` does, else ``"contiguous"``.

    Example::

        >>> memory_format(torch.empty(2, 3, 4, 4, device="meta").contiguous(memory_format=torch.channels_last))
        'channels_last'
        >>> memory_format(torch.empty(2, 3, 4, 4, device="meta")), memory_format(torch.empty(2, 3, 4, device="meta"))
        ('contiguous', 'contiguous')
    """
    if tensor.dim() in (4, 5) and _channels_last_strides(tensor.shape, tensor.stride()):
        return "channels_last"
    return "contiguous"


def channels_innermost_1d(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a 1-D convolution's input or gradient with its channels innermost (a
    transposed ``(N, L, C)`` tensor, as ``embed(ids).transpose(1, 2)`` gives), which ATen hands
    cuDNN as a channels_last ``(N, C, 1, L)``.

    Measured on an H200 (cuDNN 9.19, ``benchmarks/conv_workspace_rules.py --shapes``, five shapes in
    fp32 and bf16): each pass takes a copy-sized share for the input and the gradient besides the
    NCHW rule's workspace, the data pass too where no weight gradient is asked
    (:func:`convolution_backward_scratch`), and the bias gradient's sum over such a gradient takes
    a copy of it and the column reduction's partial sums. Under a memory limit these workspaces were
    seen not to give way (the weight-normed text CNN's largest batch, H200): their bound stays left
    free in a batch search (:attr:`ConvScratch.channels_innermost`).

    Example::

        >>> tokens = torch.empty(2, 16, 8, device="meta")  # (batch, length, channels)
        >>> channels_innermost_1d(tokens.transpose(1, 2)), channels_innermost_1d(torch.empty(2, 8, 16, device="meta"))
        (True, False)
    """
    if tensor.dim() != 3:
        return False
    _, channels, length = tensor.shape
    return channels > 1 and length > 1 and tensor.stride(1) == 1 and tensor.stride(2) >= channels


def _in_format(tensor: torch.Tensor, channels_last: bool) -> bool:
    if not channels_last or tensor.dim() not in (4, 5):
        return tensor.is_contiguous()
    fmt = torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
    return tensor.is_contiguous(memory_format=fmt)


def _bytes(shape: Sequence[int], element: int) -> int:
    return math.prod(shape) * element


def nhwc_bytes(shape: Sequence[int], element: int, *, pad_channels: int = 1, channel_dim: int = 1) -> int:
    """Bytes of ``shape`` with dimension ``channel_dim`` padded to a multiple of ``pad_channels``.

    Example::

        >>> nhwc_bytes((128, 3, 224, 224), 2, pad_channels=8) == 128 * 8 * 224 * 224 * 2
        True
    """
    dims = list(shape)
    dims[channel_dim] = -(-dims[channel_dim] // pad_channels) * pad_channels
    return math.prod(dims) * element


# -- which kernel runs ---------------------------------------------------------------
def _cudnn_depthwise_workload(input_shape: Sequence[int], weight_shape: Sequence[int], stride: int) -> bool:
    """ATen's ``check_cudnn_depthwise_workload_with_filter`` (cuDNN 8.2+), for fp16 contiguous depthwise."""
    if input_shape[2] == 1 and stride == 1:
        return True  # a 1-D convolution
    if weight_shape[2] != weight_shape[3] or weight_shape[3] not in (1, 3, 5) or input_shape[3] < 7:
        return False
    if stride == 1:
        return True
    if stride != 2:
        return False
    filt, width, channels, batch = weight_shape[3], input_shape[3], input_shape[1], input_shape[0]
    if batch == 1:
        return (filt == 1 and width <= 28) or filt in (3, 5)
    if filt == 1 and batch <= 16 and channels >= 128 and width <= 7:
        return True
    return filt in (3, 5) and (channels >= 512 or (channels >= 256 and width >= 28))


def conv_backend(
    input: torch.Tensor, weight: torch.Tensor, *, stride: Sequence[int], dilation: Sequence[int], transposed: bool, groups: int
) -> str:
    """The kernel CUDA's ``aten.convolution`` runs for these arguments, as ATen's ``_select_conv_backend`` picks it.

    ``"empty"`` (no batch or channels), ``"depthwise"`` (torch's own kernel: groups equal
    to the input's channels, contiguous, not fp16 where cuDNN's depthwise kernels
    win), else ``"cudnn"``. A 1-D convolution is a 2-D one of height 1.
    """
    shape, wshape = list(input.shape), list(weight.shape)
    if input.dim() == 3:  # viewed as 2-D (N, C, 1, L)
        shape, wshape = [shape[0], shape[1], 1, shape[2]], [wshape[0], wshape[1], 1, wshape[2]]
        stride = [1, *stride]
    if shape[0] == 0 or shape[1] == 0:
        return "empty"
    depthwise = not transposed and len(shape) in (4, 5) and shape[1] == groups and groups > 1 and wshape[0] % shape[1] == 0
    if not depthwise:
        return "cudnn"
    channels_last = memory_format(input) == "channels_last" or memory_format(weight) == "channels_last"
    if channels_last:
        return "cudnn"
    half = input.dtype == torch.float16 and weight.dtype == torch.float16
    square = len(stride) >= 2 and (stride[0] == stride[1] or shape[2] == 1)
    dilated = any(d != 1 for d in dilation)
    if half and len(shape) == 4 and not dilated and square and shape[1] >= 32 and _cudnn_depthwise_workload(shape, wshape, stride[-1]):
        return "cudnn"
    return "depthwise"


# -- cuDNN's workspace ---------------------------------------------------------------
def transforms_bytes(
    x_shape: Sequence[int], y_shape: Sequence[int], w_shape: Sequence[int], dtype: torch.dtype, *, only_unaligned: bool = False
) -> int:
    """One block holding a pass's tensors in NHWC: channels padded to 8 in 16-bit precision, each
    part aligned to 256 bytes, plus :data:`TRANSFORM_HEADER`; a 1x1 filter needs no transform.
    ``only_unaligned``: only the tensors whose channels are not a multiple of 8 (and the filter
    with them), what a ``channels_last`` convolution pads; 0 when all are.

    Example::

        >>> transforms_bytes((128, 3, 224, 224), (128, 64, 112, 112), (64, 3, 7, 7), torch.bfloat16)  # ResNet's stem
        308332032
        >>> transforms_bytes((128, 3, 224, 224), (128, 64, 112, 112), (64, 3, 7, 7), torch.bfloat16, only_unaligned=True)
        102811136
    """
    element = torch.empty((), dtype=dtype).element_size()
    pad = HALF_CHANNEL_MULTIPLE if dtype in _HALF else 1
    x_odd, y_odd = x_shape[1] % HALF_CHANNEL_MULTIPLE != 0, y_shape[1] % HALF_CHANNEL_MULTIPLE != 0
    parts = []
    if x_odd or not only_unaligned:
        parts.append(nhwc_bytes(x_shape, element, pad_channels=pad))
    if y_odd or not only_unaligned:
        parts.append(nhwc_bytes(y_shape, element, pad_channels=pad))
    if any(k != 1 for k in w_shape[2:]) and (x_odd or y_odd or not only_unaligned):
        parts.append(nhwc_bytes(w_shape, element, pad_channels=pad))
    if not parts:
        return 0
    if only_unaligned and pad == 1:  # fp32 channels_last: the unpadded copies, one block, nothing more (measured)
        return block_size(sum(parts))
    return block_size(sum(-(-p // 256) * 256 for p in parts) + TRANSFORM_HEADER)


def pointwise_filter_partials(x_shape: Sequence[int], y_shape: Sequence[int]) -> int:
    """Bytes of the fp32 partial weight gradients, one per image, that a pointwise NCHW filter pass
    sums: ``N * C_in * C_out * 4`` (see :data:`POINTWISE_GEMM_POSITIONS`).

    Example::

        >>> pointwise_filter_partials((64, 512, 14, 14), (64, 128, 14, 14)) == 16 << 20   # GoogLeNet, 16 MiB measured
        True
    """
    return x_shape[0] * x_shape[1] * y_shape[1] * 4


def cudnn_pass_workspace(
    kind: str,
    x_shape: Sequence[int],
    y_shape: Sequence[int],
    w_shape: Sequence[int],
    *,
    dtype: torch.dtype,
    channels_last: bool,
    stride: Sequence[int] = (1, 1),
    padding: Sequence[int] = (0, 0),
    depthwise: bool = False,
    allow_tf32: bool = True,
    benchmark: bool = False,
    transposed: bool = False,
) -> PassWorkspace:
    """``(bytes, bound, sums_partials)`` of cuDNN's workspace for one pass (``kind``: ``"forward"``,
    ``"data"``, ``"filter"``) of the convolution ``x -> y`` with filter ``w`` (see the module);
    ``sums_partials``: a filter pass that adds split-K partial weight gradients to the transforms, as
    many as cuDNN's heuristics choose for the call (:attr:`ConvScratch.headroom`).

    ``x_shape``/``y_shape``/``w_shape`` are the convolution's (N, C, spatial...) input,
    output and (C_out, C_in / groups, kernel...) filter, whichever pass runs (a 1-D
    convolution as 2-D of height 1). ``T`` is :func:`transforms_bytes`, ``spread`` is
    :data:`WORKSPACE_FLOOR` plus :data:`WORKSPACE_SHARE` of ``T``. The classes, from what
    was measured on an H100 (cuDNN 9.19):

    - NCHW, forward: ``T`` (exact for most 3x3 and 7x7 convolutions of 8 channels or more,
      fp32 and bf16), bound ``spread`` (in fp32 at least the floor plus the output: one plan
      writes the output in NCHW); a first layer of up to 4 channels none (all 7 measured),
      bound ``spread``, unless a 2-D 7x7 stem (``T``); a pointwise (1x1, stride 1, unpadded)
      one outside the GEMM class below none and one of 5 to 7 channels none, bound ``T + floor``; a
      strided 1x1 ``T``, bound ``T + floor`` (measured with and without the transforms);
    - NCHW, pointwise, 2-D, not transposed, 8 channels or more in and out, with at least
      :data:`POINTWISE_GEMM_POSITIONS` output positions: GEMMs on NCHW, the forward and data passes
      none, the filter pass the smaller of :func:`pointwise_filter_partials` and ``T``; bound the
      floor (8.4 MB the farthest measured); with fewer positions (7x7), forward and backward ``T``
      (the filter pass's bound covers the partials plus the floor, in fp32 at least ``2 T`` plus
      the floor: some plans took the partials, in fp32 and in bf16);
    - NCHW, backward passes: ``T``, the filter pass ``T`` rounded up to 2 MiB where it is 10 MiB or
      more (a little more than ``T``, handed the whole block ``T`` left; in fp32
      :data:`FP32_FILTER_EXCESS` past it), bound ``spread``; a 2-D fp32 first layer (not a stem) none,
      bound ``spread`` for up to 4 channels (all 7 measured took none) and ``T + floor`` for 5 to 7;
      pointwise ones (other than the GEMM class above), other fp32 ones under 8 input channels and any
      under 8 output channels ``T``, bound ``T + floor``; some strided 1x1 ones (RegNet's, fp32,
      28x28 outputs and larger) took none: the rule is above them, on the safe side (a bound states
      what a call may take beyond the rule);
    - ``channels_last``: the tensors whose channels are not a multiple of 8 padded (exact
      for the stem and 3-channel first layers), else none; bound ``spread``; in fp32 and for
      strided 1x1 ones ``T + floor`` (fp32 plans re-lay inputs: 96 channels measured), five
      times ``T`` for depthwise fp32 backward;
    - fp32 without TF32: forward none on NCHW (``T`` on ``channels_last``), data none, filter
      :data:`NO_TF32_FILTER_SHARE` times ``T``; bound twice ``T`` plus the floor.

    Example::

        >>> cudnn_pass_workspace("forward", (8, 96, 256, 256), (8, 32, 256, 256), (32, 96, 3, 3), dtype=torch.float32,
        ...                      channels_last=False, stride=(1, 1), padding=(1, 1))[0]
        268546560
        >>> cudnn_pass_workspace("forward", (8, 96, 256, 256), (8, 32, 256, 256), (32, 96, 3, 3), dtype=torch.bfloat16,
        ...                      channels_last=True)[0]
        0
        >>> cudnn_pass_workspace("filter", (64, 64, 224, 224), (64, 64, 224, 224), (64, 64, 3, 3), dtype=torch.bfloat16,
        ...                      channels_last=False, padding=(1, 1)).sums_partials   # the VGG's: 13 partials on an H200
        True
    """
    transforms = transforms_bytes(x_shape, y_shape, w_shape, dtype)
    spread = WORKSPACE_FLOOR + math.ceil(WORKSPACE_SHARE * transforms)
    loose = transforms + WORKSPACE_FLOOR
    kernel = list(w_shape[2:])
    pointwise = all(k == 1 for k in kernel) and all(v == 1 for v in stride) and all(v == 0 for v in padding)
    small_in, small_out = x_shape[1] < HALF_CHANNEL_MULTIPLE, y_shape[1] < HALF_CHANNEL_MULTIPLE
    fp32 = dtype == torch.float32
    stem = len(kernel) == 2 and math.prod(kernel) >= STEM_KERNEL_AREA and not small_out
    positions = math.prod(y_shape[2:])
    # a pointwise NCHW convolution, not grouped, as the GEMM classes were measured (2-D, default flags)
    gemm = (pointwise and len(kernel) == 2 and w_shape[1] == x_shape[1] and not transposed and not channels_last
            and not (small_in or small_out) and allow_tf32 and not benchmark)  # fmt: skip
    if gemm and positions >= POINTWISE_GEMM_POSITIONS:
        # the filter pass takes the partials, or the transforms where those are smaller (a 1000-class
        # head at 13x13; 512 channels at 14x14 in bf16): the smaller of the two, within 8.4 MB measured
        partials = pointwise_filter_partials(x_shape, y_shape)
        estimate = min(partials, transforms) if kind == "filter" else 0
        return PassWorkspace(estimate, WORKSPACE_FLOOR, False)
    if gemm and positions > 1 and kind == "forward":
        return PassWorkspace(transforms, loose, False)  # 7x7: the transforms, as for the backward passes
    if fp32 and not allow_tf32:
        if kind == "filter":
            estimate = math.ceil(NO_TF32_FILTER_SHARE * transforms)
        else:
            estimate = transforms if (channels_last and kind == "forward") else 0
        bound = 2 * transforms + WORKSPACE_FLOOR
    elif channels_last:
        estimate = transforms_bytes(x_shape, y_shape, w_shape, dtype, only_unaligned=True)
        bound = spread
        if fp32 or (all(k == 1 for k in kernel) and not pointwise):  # a strided 1x1 (bf16) re-lays x and y
            bound = FP32_DEPTHWISE_SHARE * transforms + WORKSPACE_FLOOR if fp32 and depthwise and kind != "forward" else loose
    elif kind == "forward":
        if small_in and not stem and x_shape[1] <= FIRST_LAYER_CHANNELS:
            estimate, bound = 0, spread  # RGB, grey, audio: none in all 7 calls measured
        elif pointwise or (small_in and not stem):
            estimate, bound = 0, loose
        elif all(k == 1 for k in kernel):  # strided 1x1: measured with and without the transforms
            estimate, bound = transforms, loose
        elif fp32:  # some fp32 plans write the output in NCHW themselves (UNet's 192 -> 64 3x3): not transformed
            estimate, bound = transforms, max(spread, WORKSPACE_FLOOR + nhwc_bytes(y_shape, 4))
        else:
            estimate, bound = transforms, spread
    elif fp32 and small_in and not stem and len(kernel) == 2:
        # none in all 7 measured of up to 4 channels (3x3 first layers of SqueezeNet, EfficientNet,
        # MobileNet, RegNet, a UNet's and a CIFAR net's, to 128 x 224 x 224): the forward's bound;
        # 5 to 7 channels are not measured
        estimate, bound = 0, spread if x_shape[1] <= FIRST_LAYER_CHANNELS else loose
    elif pointwise or small_out or (small_in and fp32):
        estimate, bound = transforms, loose
    else:
        estimate, bound = transforms, spread
    sums_partials = kind == "filter" and bool(estimate) and transforms >= MIN_LARGE_ALLOC and not channels_last and allow_tf32
    if sums_partials:
        # the filter pass asks a little more than the transforms (split-K partial sums), and where the data
        # pass's or the forward's workspace left a free block the allocator hands it that block whole (the
        # rest is under its 1 MiB split threshold): measured as the transforms rounded up to 2 MiB
        estimate = -(-transforms // ROUND_LARGE) * ROUND_LARGE
        if fp32:  # in fp32 more, past the block (8 of 9 measured): the smallest excess seen, a segment of its own
            estimate += FP32_FILTER_EXCESS
    if gemm and kind == "filter":
        # 7x7: some plans take the per-image partials instead of the transforms, in fp32 (6 of 9, up to
        # 3.4 times them) and in bf16 (MNASNet's 1152 <- 192, 320 <- 1152 and 1280 <- 320 at batch 64, 6
        # of 10 calls, where GoogLeNet's and ShuffleNetV2's of like sizes took the transforms): no size
        # tells which, so the bound covers the partials
        partials = pointwise_filter_partials(x_shape, y_shape)
        bound = max(bound, partials + WORKSPACE_FLOOR - estimate, 2 * transforms + WORKSPACE_FLOOR if fp32 else 0)
    if benchmark:
        bound += BENCHMARK_SEARCH_BOUND + 2 * transforms
    return PassWorkspace(estimate, bound, sums_partials)


# -- operators -------------------------------------------------------------------------
def _output_shape(input_shape: Sequence[int], weight_shape: Sequence[int], stride, padding, dilation, transposed,
                  output_padding, groups) -> list[int]:  # fmt: skip
    spatial = []
    for i, size in enumerate(input_shape[2:]):
        k = dilation[i] * (weight_shape[2 + i] - 1) + 1
        if transposed:
            spatial.append((size - 1) * stride[i] - 2 * padding[i] + k + output_padding[i])
        else:
            spatial.append((size + 2 * padding[i] - k) // stride[i] + 1)
    channels = weight_shape[1] * groups if transposed else weight_shape[0]
    return [input_shape[0], channels, *spatial]


def _expand(values: Sequence[int] | int, n: int) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    return values * n if len(values) == 1 else values


def _flags(benchmark: bool | None) -> bool:
    return bool(torch.backends.cudnn.benchmark) if benchmark is None else benchmark


def _as_2d(shape: Sequence[int]) -> list[int]:
    return [shape[0], shape[1], 1, shape[2]] if len(shape) == 3 else list(shape)


def _passes(
    input: torch.Tensor, weight: torch.Tensor, out_shape: Sequence[int], *, stride, padding, transposed: bool,
    channels_last: bool, benchmark: bool, groups: int = 1,
) -> tuple[dict[str, tuple[int, int]], bool]:  # fmt: skip
    """The workspace ``(bytes, bound)`` of each cuDNN pass this convolution's forward and backward may run,
    and whether its filter pass sums split-K partials (:attr:`ConvScratch.headroom`).

    A transposed convolution is the data gradient of the convolution from its output
    to its input: its forward is that convolution's backward-data pass, its input
    gradient that convolution's forward.
    """
    in_shape, w_shape, out_shape = _as_2d(input.shape), _as_2d(weight.shape), _as_2d(out_shape)
    if input.dim() == 3:
        stride, padding = [1, *stride], [0, *padding]
    if transposed:  # the convolution it is the gradient of: x = our output, y = our input
        x_shape, y_shape = out_shape, in_shape
    else:
        x_shape, y_shape = in_shape, out_shape
    common = {"dtype": input.dtype, "channels_last": channels_last, "benchmark": benchmark, "stride": stride,
              "padding": padding, "allow_tf32": bool(torch.backends.cudnn.allow_tf32),
              "depthwise": groups > 1 and groups == in_shape[1] and not transposed, "transposed": transposed}  # fmt: skip
    found = {kind: cudnn_pass_workspace(kind, x_shape, y_shape, w_shape, **common) for kind in ("forward", "data", "filter")}
    if transposed:
        found["forward"], found["data"] = found["data"], found["forward"]
    passes = {kind: (one.nbytes, one.bound) for kind, one in found.items()}
    return passes, found["filter"].sums_partials


def _copies(tensors: Sequence[torch.Tensor], channels_last: bool) -> list[int]:
    return [block_size(t.numel() * t.element_size()) for t in tensors if t.numel() and not _in_format(t, channels_last)]


def convolution_scratch(
    input: torch.Tensor,
    weight: torch.Tensor,
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    output_padding: Sequence[int] | None = None,
    benchmark: bool | None = None,
) -> ConvScratch:
    """What CUDA's ``aten.convolution`` takes inside it for these arguments (see the module).

    ``benchmark``: ``torch.backends.cudnn.benchmark`` (``None``: as set now).
    """
    n = weight.dim() - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    output_padding = _expand(output_padding or 0, n)
    backend = conv_backend(input, weight, stride=stride, dilation=dilation, transposed=transposed, groups=groups)
    if backend == "empty":
        return ConvScratch(backend=backend)
    if backend == "depthwise":
        return ConvScratch(held=tuple(_copies([input, weight], False)), backend=backend, channels_innermost=channels_innermost_1d(input))
    channels_last = memory_format(input) == "channels_last" or memory_format(weight) == "channels_last"
    out_shape = _output_shape(input.shape, weight.shape, stride, padding, dilation, transposed, output_padding, groups)
    passes, _ = _passes(input, weight, out_shape, stride=stride, padding=padding, transposed=transposed,
                        channels_last=channels_last, benchmark=_flags(benchmark), groups=groups)  # fmt: skip
    workspace, bound = passes["forward"]
    kept = _nonzero([(workspace,)])
    # over a channels-innermost 1-D input: the input's copy and the NCHW transforms, to the byte (H200)
    innermost = channels_innermost_1d(input)
    return ConvScratch(tuple(_copies([input, weight], channels_last)), kept, bound, backend,
                       fallback=(not innermost,) * len(kept), channels_innermost=innermost)  # fmt: skip


def _nonzero_each(passes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return [tuple(b for b in one if b > 0) for one in passes]


def _nonzero(passes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    kept = _nonzero_each(passes)
    return tuple(one for one in kept if one)


def convolution_backward_scratch(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    output_mask: Sequence[bool],
    output_padding: Sequence[int] | None = None,
    benchmark: bool | None = None,
    multiprocessors: int | None = None,
) -> ConvScratch:
    """What CUDA's ``aten.convolution_backward`` takes inside it, above the gradients it returns (see the module).

    ``output_mask``: which of the input's, the weight's and the bias's gradients are made.
    """
    from .scratch import DEFAULT_MULTIPROCESSORS, column_reduction_scratch

    n = weight.dim() - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    want_input, want_weight, want_bias = (bool(m) for m in output_mask)
    backend = conv_backend(input, weight, stride=stride, dilation=dilation, transposed=transposed, groups=groups)
    if backend == "empty":
        return ConvScratch(backend=backend)
    channels_last = backend == "cudnn" and (memory_format(input) == "channels_last" or memory_format(weight) == "channels_last")
    element = grad_output.element_size()
    grad_weight = block_size(weight.numel() * weight.element_size()) if want_weight else 0
    channels = grad_output.shape[1] if grad_output.dim() > 1 else 0
    grad_bias = block_size(channels * element) if want_bias else 0
    reduction: tuple[int, ...] = ()
    processors = multiprocessors or DEFAULT_MULTIPROCESSORS
    if want_bias and grad_output.dim() >= 3 and memory_format(grad_output) == "channels_last":
        rows = grad_output.numel() // max(channels, 1)
        reduction = column_reduction_scratch(rows, channels, multiprocessors=processors)
    elif want_bias and channels_innermost_1d(grad_output):
        # a copy of the gradient, then the column reduction of its (N * L, C) rows: to the byte in
        # fp32 and bf16 for three of five shapes on an H200, 12-25 KB over for Wav2Vec2's positional one
        rows = grad_output.numel() // channels
        reduction = (block_size(grad_output.numel() * element),
                     *column_reduction_scratch(rows, channels, multiprocessors=processors))  # fmt: skip
    # an NCHW gradient's sum over (0, 2, 3) takes a few KiB of partial sums (not sized here)
    bias_bound = NCHW_BIAS_REDUCTION_BOUND if want_bias and not reduction else 0
    innermost = channels_innermost_1d(input)
    # Over a channels-innermost 1-D input the device runs channels_last, and every pass that makes the
    # input's or the weight's gradient takes the input's and the gradient's copy-sized shares in it
    # (given back before the bias's sum, which then takes its own): the data pass alone too
    # (H200: 549,454,336 bytes for the text CNN's fp32 (64, 1024, 512) k3, the transforms and two copies).
    in_passes = _copies([grad_output, input], False) if innermost and (want_input or want_weight) else []
    if backend == "depthwise":
        if innermost:
            return ConvScratch((), _nonzero([tuple(in_passes), reduction]), bias_bound, backend, channels_innermost=True)
        copies = _copies([t for t, wanted in ((grad_output, True), (input, want_weight), (weight, want_input)) if wanted], False)
        return ConvScratch(tuple(copies), _nonzero([reduction]), bias_bound, backend)
    if innermost:
        copies = _copies([weight], channels_last) if want_input else []
    else:
        needed = [grad_output] + ([input] if want_weight else []) + ([weight] if want_input else [])
        copies = _copies(needed, channels_last) if (want_input or want_weight) else []
    passes, sums_partials = _passes(input, weight, grad_output.shape, stride=stride, padding=padding,
                                    transposed=transposed, channels_last=channels_last, benchmark=_flags(benchmark),
                                    groups=groups)  # fmt: skip
    # each pass's workspace is taken before the gradients after it exist: above the returned gradients,
    # the data pass counts less the weight's and the bias's gradients, the filter pass less the bias's
    taken, room, bound = [], [], bias_bound
    if want_input:
        workspace, b = passes["data"]  # for a transposed one: the forward of the convolution it transposes
        taken.append((*in_passes, workspace - grad_weight - grad_bias))
        room.append(0)
        bound = max(bound, b)
    if want_weight:
        workspace, b = passes["filter"]
        taken.append((*in_passes, workspace - grad_bias))
        if any(d != 1 for d in dilation) and not channels_last:
            # a dilated filter pass may take split-K partial weight gradients instead (not sized by shape)
            b = max(b, DILATED_FILTER_PARTIALS * weight.numel() * 4 + WORKSPACE_FLOOR - workspace)
        # how many partial sums it adds to the transforms is cuDNN's choice per call: up to its bound
        room.append(b if sums_partials and workspace > grad_bias else 0)
        bound = max(bound, b)
    # the data and filter passes are cuDNN's workspaces (giving way, but over a channels-innermost
    # 1-D input); the reduction is ATen's
    cudnn_passes = 0 if innermost else len(taken)
    taken.append(reduction)
    room.append(0)
    kept = [(one, extra, i < cudnn_passes) for i, (one, extra) in enumerate(zip(_nonzero_each(taken), room)) if one]
    return ConvScratch(tuple(copies), tuple(one for one, _, _ in kept), bound, backend, tuple(extra for _, extra, _ in kept),
                       tuple(workspace for _, _, workspace in kept), innermost)  # fmt: skip


# -- the benchmark's cases ---------------------------------------------------------------
def rule_for_sweep_case(case: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The rule's figures for one case of ``benchmarks/conv_workspace_rules.py``: ``scratch``, ``bound``, ``backend``."""
    dtype = getattr(torch, case["dtype"])
    dims, k, s, p, g = case["dims"], case["kernel"], case["stride"], case["padding"], case["groups"]
    spatial = [case["size"]] * dims
    if case["transposed"]:
        weight_shape = [case["cin"], case["cout"] // g, *([k] * dims)]
    else:
        weight_shape = [case["cout"], case["cin"] // g, *([k] * dims)]
    layout = case["layout"]
    with torch.device("meta"):
        if layout == "noncontig":
            x = torch.empty([case["n"], 2 * case["cin"], *spatial], dtype=dtype)[:, : case["cin"]]
        elif layout == "channels_innermost" and dims == 1:  # a transposed (N, L, C) tensor
            x = torch.empty([case["n"], *spatial, case["cin"]], dtype=dtype).transpose(1, 2)
        else:
            x = torch.empty([case["n"], case["cin"], *spatial], dtype=dtype)
        w = torch.empty(weight_shape, dtype=dtype)
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    if layout == "channels_last" and dims >= 2:
        x = x.contiguous(memory_format=fmt)
    if layout in ("channels_last", "weight_channels_last") and dims >= 2:
        w = w.contiguous(memory_format=fmt)
    geometry = {"stride": [s] * dims, "padding": [p] * dims, "dilation": [1] * dims, "transposed": case["transposed"],
                "groups": g, "benchmark": bool(flags.get("benchmark"))}  # fmt: skip
    if case["call"] == "forward":
        found = convolution_scratch(x, w, **geometry)
    else:
        out_shape = _output_shape(x.shape, w.shape, [s] * dims, [p] * dims, [1] * dims, case["transposed"], [0] * dims, g)
        go = torch.empty(out_shape, dtype=dtype, device="meta")
        if layout == "channels_innermost" and dims == 1:
            go = go.transpose(1, 2).contiguous().transpose(1, 2)
        if layout in ("channels_last", "weight_channels_last") and dims >= 2:
            go = go.contiguous(memory_format=fmt)
        found = convolution_backward_scratch(go, x, w, output_mask=case["mask"], **geometry)
    return {"scratch": sum(found.blocks), "held": list(found.held), "passes": [list(p) for p in found.passes],
            "bound": found.bound, "backend": found.backend}

