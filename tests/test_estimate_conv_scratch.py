"""cuDNN convolution workspaces and kernels' layout copies in a CUDA estimate: the rules against
convolutions measured on an H100 (torch 2.11, cuDNN 9), and an estimate on fake CPU tensors
standing in for CUDA taking them at their operator (CPU estimates take none)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import AllocatorReplay, block_size, simulate_reserved
from pytorch_mem_profiler.estimate.conv_workspace import (
    conv_backend,
    convolution_backward_scratch,
    convolution_scratch,
    memory_format,
)
from pytorch_mem_profiler.estimate.counter import StorageLifeCounter
from pytorch_mem_profiler.estimate.layout_copies import layout_copies
from pytorch_mem_profiler.estimate.scratch import CONVOLUTION_BACKWARD_BOUND, CONVOLUTION_BOUND, CHANNELS_INNERMOST_LAYOUT, KernelScratch, Passes
from pytorch_mem_profiler.estimate.step import StepPlan, run_step

SGD = functools.partial(torch.optim.SGD, lr=0.1)
CL = torch.channels_last
F32, BF16 = torch.float32, torch.bfloat16

#: Forward convolutions of zoo training steps on an H100 (``benchmarks/op_scratch.py --zoo``):
#: (input shape, weight shape, stride, dtype, scratch in bytes: the allocator's peak inside
#: ``aten.convolution`` above both ends). All contiguous (NCHW), padding ``kernel // 2``.
MEASURED_FORWARD = [
    ((8, 96, 256, 256), (32, 96, 3, 3), 1, F32, 268_546_560),  # UNet's decoder
    ((8, 32, 256, 256), (32, 32, 3, 3), 1, F32, 134_255_104),
    ((8, 64, 128, 128), (64, 64, 3, 3), 1, F32, 67_256_832),
    ((8, 32, 128, 128), (64, 32, 3, 3), 1, F32, 50_405_888),
    ((64, 3, 224, 224), (64, 3, 7, 7), 2, F32, 244_093_952),  # ResNet-50's stem
    ((64, 64, 56, 56), (64, 64, 3, 3), 1, F32, 102_908_416),
    ((128, 3, 224, 224), (64, 3, 7, 7), 2, BF16, 308_332_032),  # ResNet-18's stem under bf16: 3 channels padded to 8
    ((128, 64, 56, 56), (64, 64, 3, 3), 1, BF16, 102_834_688),
    ((64, 64, 224, 224), (64, 64, 3, 3), 1, BF16, 822_157_824),  # the VGG-style CNN's largest
    ((64, 128, 112, 112), (128, 128, 3, 3), 1, BF16, 411_337_216),
    ((64, 64, 112, 112), (128, 64, 3, 3), 1, BF16, 308_429_312),
    ((64, 512, 28, 28), (512, 512, 3, 3), 1, BF16, 107_479_552),
]  # fmt: skip

#: Measured where cuDNN's plan asks more than the transforms (split-K sums) or another plan
#: runs: (input, weight, stride, dtype, measured). The rule's figure must be within its bound.
MEASURED_FORWARD_OFF_RULE = [
    ((8, 256, 32, 32), (256, 256, 3, 3), 1, F32, 27_262_976),
    ((8, 512, 16, 16), (512, 512, 3, 3), 1, F32, 18_874_368),
    ((8, 384, 64, 64), (128, 384, 3, 3), 1, F32, 76_219_392),
    ((128, 512, 7, 7), (512, 512, 3, 3), 1, BF16, 25_952_768),
    ((128, 128, 28, 28), (128, 128, 3, 3), 1, BF16, 52_428_800),
    ((64, 256, 14, 14), (256, 256, 3, 3), 1, F32, 36_438_528),
]  # fmt: skip

#: Backward (``convolution_backward``; no bias, input gradient unless the first layer):
#: (grad_output, input, weight, output mask, dtype, measured scratch).
MEASURED_BACKWARD = [
    ((8, 32, 256, 256), (8, 96, 256, 256), (32, 96, 3, 3), (True, True, False), F32, 272_806_912),
    ((8, 64, 128, 128), (8, 192, 128, 128), (64, 192, 3, 3), (True, True, False), F32, 138_789_888),
    ((8, 128, 64, 64), (8, 128, 64, 64), (128, 128, 3, 3), (True, True, False), F32, 42_402_816),
    ((128, 64, 112, 112), (128, 3, 224, 224), (64, 3, 7, 7), (False, True, False), BF16, 314_572_800),
    ((64, 64, 224, 224), (64, 64, 224, 224), (64, 64, 3, 3), (True, True, False), BF16, 824_180_736),
    ((64, 64, 224, 224), (64, 3, 224, 224), (64, 3, 3, 3), (False, True, False), BF16, 464_680_448),
    ((64, 256, 56, 56), (64, 256, 56, 56), (256, 256, 3, 3), (True, True, False), BF16, 223_216_640),
    ((128, 256, 14, 14), (128, 256, 14, 14), (256, 256, 3, 3), (True, True, False), BF16, 33_948_672),
]  # fmt: skip


#: Calls of ``benchmarks/conv_workspace_rules.py`` on an H100 (torch 2.11, cuDNN 9.19), the three
#: farthest from the rule of each class (flags, layout, call, exact or not, dtype): (flags,
#: (dims, N, C_in, C_out, size, kernel, stride, groups, transposed), dtype, layout ("co"ntiguous or
#: "ch"annels_last), call ("fwd" or the backward's output mask), steady scratch in bytes).
SWEEP = [
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "ch", "111", 109_051_392),  # resnet_stem
    ("benchmark", (2, 128, 64, 64, 56, 3, 1, 1, False), "bflo", "ch", "111", 35_652_096),  # resnet_l1
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "ch", "111", 520_093_184),  # resnet_stem
    ("benchmark", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "ch", "111", 35_652_096),  # resnet_l1
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "ch", "111", 8_389_120),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "ch", "111", 8_389_120),  # unet_c32
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "ch", "111", 8_389_120),  # c512_s16
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "111", 8_389_120),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "floa", "ch", "111", 8_389_120),  # unet_c32
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "111", 8_389_120),  # c512_s16
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "ch", "fwd", 512),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "ch", "fwd", 512),  # unet_c32
    ("benchmark", (2, 128, 64, 64, 56, 3, 1, 1, False), "bflo", "ch", "fwd", 512),  # resnet_l1
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "ch", "fwd", 77_594_624),  # resnet_stem
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "fwd", 512),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "floa", "ch", "fwd", 512),  # unet_c32
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "ch", "fwd", 102_811_136),  # resnet_stem
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "ch", "fwd", 0),  # c512_s16
    ("benchmark", (2, 8, 256, 256, 32, 3, 1, 1, False), "bflo", "ch", "fwd", 0),  # c256_s32
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "fwd", 0),  # c512_s16
    ("benchmark", (2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "ch", "fwd", 0),  # c256_s32
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "co", "111", 314_572_288),  # resnet_stem
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "co", "111", 71_302_656),  # unet_c32
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "co", "111", 136_314_368),  # unet_dec
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "co", "111", 520_093_184),  # resnet_stem
    ("benchmark", (2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "co", "111", 27_261_952),  # c256_s32
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "co", "111", 25_163_776),  # c512_s16
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "co", "111", 8_912_384),  # c512_s16
    ("benchmark", (2, 8, 256, 256, 32, 3, 1, 1, False), "bflo", "co", "111", 9_568_256),  # c256_s32
    ("benchmark", (2, 8, 512, 256, 16, 2, 2, 1, True), "floa", "co", "111", 14_679_552),  # unet_up
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "co", "fwd", 9_961_472),  # c512_s16
    ("benchmark", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "co", "fwd", 18_874_368),  # c512_s16
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "co", "fwd", 488_636_416),  # resnet_stem
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "co", "fwd", 134_273_536),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "co", "fwd", 67_127_808),  # unet_c32
    ("benchmark", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "co", "fwd", 308_332_032),  # resnet_stem
    ("benchmark", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "fwd", 268_546_560),  # unet_dec
    ("benchmark", (2, 8, 32, 32, 256, 3, 1, 1, False), "floa", "co", "fwd", 134_255_104),  # unet_c32
    ("benchmark", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "co", "fwd", 205_668_864),  # resnet_l1
    ("default", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "ch", "111", 109_051_392),  # resnet_stem
    ("default", (2, 16, 24, 100, 56, 3, 2, 1, False), "bflo", "ch", "111", 8_045_568),  # odd_24_100_s2
    ("default", (2, 4, 33, 33, 128, 7, 1, 1, False), "bflo", "ch", "111", 14_679_552),  # odd_33_k7
    ("default", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "ch", "111", 520_093_184),  # resnet_stem
    ("default", (2, 32, 96, 96, 56, 7, 1, 96, False), "floa", "ch", "111", 318_766_592),  # dw_7x7
    ("default", (2, 8, 32, 3, 256, 1, 1, 1, False), "floa", "ch", "111", 73_399_808),  # unet_head
    ("default", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "ch", "111", 8_389_120),  # unet_dec
    ("default", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "ch", "111", 8_389_120),  # unet_c32
    ("default", (2, 8, 32, 3, 256, 1, 1, 1, False), "bflo", "ch", "111", 8_388_608),  # unet_head
    ("default", (2, 8, 32, 32, 256, 3, 1, 1, False), "floa", "ch", "111", 8_389_120),  # unet_c32
    ("default", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "111", 8_389_120),  # c512_s16
    ("default", (2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "ch", "111", 16_777_728),  # c256_s32
    ("default", (2, 128, 64, 128, 56, 1, 2, 1, False), "bflo", "ch", "fwd", 77_594_624),  # down_1x1s2
    ("default", (2, 32, 5, 17, 64, 3, 1, 1, False), "bflo", "ch", "fwd", 0),  # odd_5_17
    ("default", (2, 8, 32, 3, 256, 1, 1, 1, False), "bflo", "ch", "fwd", 0),  # unet_head
    ("default", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "fwd", 201_437_696),  # unet_dec
    ("default", (2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "ch", "fwd", 7_865_344),  # c256_s32
    ("default", (2, 8, 32, 3, 256, 1, 1, 1, False), "floa", "ch", "fwd", 0),  # unet_head
    ("default", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "ch", "fwd", 0),  # unet_dec
    ("default", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "ch", "fwd", 102_811_136),  # resnet_stem
    ("default", (2, 8, 3, 32, 256, 3, 1, 1, False), "bflo", "ch", "fwd", 8_393_728),  # unet_in3
    ("default", (2, 128, 512, 512, 7, 3, 1, 1, False), "floa", "ch", "fwd", 0),  # resnet_l4
    ("default", (2, 128, 32, 32, 112, 3, 1, 32, False), "floa", "ch", "fwd", 0),  # dw_3x3
    ("default", (2, 64, 144, 144, 56, 3, 2, 144, False), "floa", "ch", "fwd", 0),  # dw_3x3_s2
    ("default", (2, 8, 32, 3, 256, 1, 1, 1, False), "bflo", "co", "111", 2_560),  # unet_head
    ("default", (2, 2, 256, 256, 64, 1, 1, 1, False), "bflo", "co", "111", 523_776),  # pointwise
    ("default", (2, 128, 128, 128, 28, 3, 1, 1, False), "bflo", "co", "111", 59_343_360),  # resnet_l2
    ("default", (2, 128, 3, 64, 224, 7, 2, 1, False), "floa", "co", "111", 520_093_184),  # resnet_stem
    ("default", (2, 2, 256, 256, 64, 1, 1, 1, False), "floa", "co", "111", 523_264),  # pointwise
    ("default", (2, 32, 5, 17, 64, 3, 1, 1, False), "floa", "co", "111", 14_682_624),  # odd_5_17
    ("default", (2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "co", "111", 8_912_384),  # c512_s16
    ("default", (2, 8, 256, 256, 32, 3, 1, 1, False), "bflo", "co", "111", 9_568_256),  # c256_s32
    ("default", (2, 64, 144, 144, 56, 3, 2, 144, False), "bflo", "co", "111", 0),  # dw_3x3_s2
    ("default", (2, 8, 512, 256, 16, 2, 2, 1, True), "floa", "co", "111", 14_679_552),  # unet_up
    ("default", (2, 64, 144, 144, 56, 3, 2, 144, False), "floa", "co", "111", 0),  # dw_3x3_s2
    ("default", (2, 32, 96, 96, 56, 7, 1, 96, False), "floa", "co", "111", 0),  # dw_7x7
    ("default", (2, 128, 64, 128, 56, 1, 2, 1, False), "bflo", "co", "fwd", 512),  # down_1x1s2
    ("default", (2, 32, 5, 17, 64, 3, 1, 1, False), "bflo", "co", "fwd", 8_912_896),  # odd_5_17
    ("default", (2, 128, 512, 512, 7, 3, 1, 1, False), "bflo", "co", "fwd", 25_952_768),  # resnet_l4
    ("default", (2, 128, 64, 128, 56, 1, 2, 1, False), "floa", "co", "fwd", 0),  # down_1x1s2
    ("default", (2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "co", "fwd", 27_262_976),  # c256_s32
    ("default", (1, 32, 256, 256, 1024, 3, 1, 1, False), "floa", "co", "fwd", 72_090_112),  # conv1d_seq
    ("default", (2, 8, 96, 32, 256, 3, 1, 1, False), "bflo", "co", "fwd", 134_273_536),  # unet_dec
    ("default", (2, 8, 32, 32, 256, 3, 1, 1, False), "bflo", "co", "fwd", 67_127_808),  # unet_c32
    ("default", (2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "co", "fwd", 308_332_032),  # resnet_stem
    ("default", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "fwd", 268_546_560),  # unet_dec
    ("default", (2, 8, 32, 32, 256, 3, 1, 1, False), "floa", "co", "fwd", 134_255_104),  # unet_c32
    ("default", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "co", "fwd", 205_668_864),  # resnet_l1
    ("no_tf32", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "ch", "100", 366_100_992),  # resnet_l1
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "100", 268_546_560),  # unet_dec
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "111", 872_968_192),  # unet_dec
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "001", 8_389_120),  # unet_dec
    ("no_tf32", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "ch", "001", 34_603_520),  # resnet_l1
    ("no_tf32", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "001", 8_389_120),  # c512_s16
    ("no_tf32", (2, 32, 5, 17, 64, 3, 1, 1, False), "floa", "ch", "fwd", 0),  # odd_5_17
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "ch", "fwd", 268_546_560),  # unet_dec
    ("no_tf32", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "ch", "fwd", 205_668_864),  # resnet_l1
    ("no_tf32", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "fwd", 17_826_304),  # c512_s16
    ("no_tf32", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "co", "100", 161_480_704),  # resnet_l1
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "111", 604_421_632),  # unet_dec
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "011", 604_421_632),  # unet_dec
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "100", 0),  # unet_dec
    ("no_tf32", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "co", "100", 0),  # c512_s16
    ("no_tf32", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "co", "001", 0),  # c512_s16
    ("no_tf32", (2, 8, 96, 32, 256, 3, 1, 1, False), "floa", "co", "fwd", 0),  # unet_dec
    ("no_tf32", (2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "co", "fwd", 0),  # resnet_l1
    ("no_tf32", (2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "co", "fwd", 0),  # c512_s16
]  # fmt: skip

#: Under ``cudnn.benchmark`` the first call of a shape: the search's workspace (bytes).
BENCHMARK_FIRST_CALLS = [
    ((2, 8, 512, 512, 16, 3, 1, 1, False), "floa", "ch", "fwd", 2_344_616_448),
    ((2, 8, 256, 256, 32, 3, 1, 1, False), "floa", "co", "111", 2_222_980_096),
    ((2, 128, 64, 64, 56, 3, 1, 1, False), "floa", "ch", "111", 862_076_928),
    ((2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "co", "fwd", 719_775_232),
]  # fmt: skip


def _sweep_case(geometry, dtype, layout, call):
    dims, n, cin, cout, size, kernel, stride, groups, transposed = geometry
    padding = 0 if transposed and kernel == 2 else (kernel // 2 if not transposed else (kernel - stride) // 2)
    return {
        "dims": dims, "n": n, "cin": cin, "cout": cout, "size": size, "kernel": kernel, "stride": stride, "padding": padding,
        "groups": groups, "transposed": transposed, "dtype": {"floa": "float32", "bflo": "bfloat16"}[dtype],
        "layout": {"co": "contiguous", "ch": "channels_last", "ci": "channels_innermost"}[layout],
        "call": "forward" if call == "fwd" else "backward",
        "mask": None if call == "fwd" else [c == "1" for c in call],
    }  # fmt: skip


#: Sweep calls the rule gives to the byte, beyond the zoo's forwards: channels_last padding of
#: unaligned channels, the bias gradient's column reduction, both backward passes' arithmetic,
#: transposed, grouped and 1-D convolutions.
SWEEP_EXACT = [
    ((2, 128, 3, 64, 224, 7, 2, 1, False), "bflo", "ch", "fwd", 102_811_136),  # the stem, channels_last: x and w padded to 8
    ((2, 8, 3, 32, 256, 3, 1, 1, False), "bflo", "ch", "fwd", 8_393_728),
    ((2, 8, 3, 32, 256, 3, 1, 1, False), "floa", "ch", "fwd", 6_295_040),  # fp32: not padded
    ((2, 256, 3, 32, 32, 3, 1, 1, False), "floa", "ch", "fwd", 3_149_312),
    ((2, 128, 128, 128, 28, 3, 1, 1, False), "floa", "ch", "111", 102_760_960),  # the bias gradient's column sum
    ((2, 1, 64, 64, 512, 3, 1, 1, False), "bflo", "ch", "111", 33_554_944),
    ((2, 8, 256, 256, 32, 3, 1, 1, False), "bflo", "co", "111", 9_568_256),  # data pass less the weight's and bias's gradients
    ((2, 8, 512, 512, 16, 3, 1, 1, False), "bflo", "co", "111", 8_912_384),
    ((2, 16, 64, 32, 64, 4, 2, 1, True), "floa", "co", "fwd", 50_463_232),  # DCGAN's transposed 4x4
    ((2, 8, 512, 256, 16, 2, 2, 1, True), "bflo", "co", "fwd", 7_340_544),  # UNet's up-convolution
    ((2, 32, 256, 256, 28, 3, 1, 32, False), "bflo", "co", "fwd", 25_727_488),  # 32 groups
    ((1, 32, 256, 256, 1024, 3, 1, 1, False), "bflo", "co", "fwd", 33_948_160),  # conv1d
    ((2, 32, 96, 96, 56, 7, 1, 96, False), "bflo", "ch", "111", 19_268_096),  # depthwise 7x7 on cuDNN (channels_last)
    # 1-D over a channels-innermost input (embed(ids).transpose(1, 2)), measured on an H200 (cuDNN 9.19,
    # torch 2.11, conv_workspace_rules.py --shapes): the input's copy and the transforms forward; the
    # data pass alone holds the input's and the gradient's copies too; the bias's sum over such a
    # gradient takes a copy of it and the column reduction's partial sums, after the other passes
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "floa", "ci", "fwd", 415_236_608),
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "bflo", "ci", "fwd", 207_618_560),
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "floa", "ci", "100", 549_454_336),
    ((1, 64, 1024, 1024, 512, 5, 1, 1, False), "bflo", "ci", "100", 278_921_728),
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "floa", "ci", "001", 272_630_272),
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "bflo", "ci", "001", 205_521_408),
    ((1, 32, 256, 256, 1024, 3, 1, 1, False), "floa", "ci", "100", 135_004_672),
    ((1, 32, 256, 256, 1024, 3, 1, 1, False), "bflo", "ci", "111", 83_886_592),  # the bias's sum is the call's peak
    ((1, 32, 512, 512, 512, 7, 1, 512, False), "floa", "ci", "111", 100_663_808),  # depthwise: the bias's sum
    ((1, 32, 512, 512, 512, 7, 1, 512, False), "bflo", "ci", "110", 33_554_432),  # depthwise: the two copies
]  # fmt: skip

#: The other 1-D channels-innermost calls of the same H200 sweep: the filter pass asks 2 to 8 MB past
#: the transforms, as over an NCHW input; Wav2Vec2's positional convolution (kernel 128, 16 groups)
#: takes less than the rule forward and in its data pass, and 8.6 MB more in bf16 backward.
CHANNELS_INNERMOST_WITHIN = [
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "floa", "ci", "111", 557_838_336),
    ((1, 64, 1024, 1024, 512, 3, 1, 1, False), "bflo", "ci", "111", 283_113_472),
    ((1, 64, 1024, 1024, 512, 5, 1, 1, False), "bflo", "ci", "111", 278_919_680),
    ((1, 32, 256, 256, 1024, 3, 1, 1, False), "floa", "ci", "111", 144_702_464),
    ((1, 32, 256, 256, 1024, 3, 1, 1, False), "floa", "ci", "fwd", 105_644_544),
    ((1, 8, 768, 768, 199, 128, 1, 16, False), "bflo", "ci", "111", 28_216_320),
    ((1, 8, 768, 768, 199, 128, 1, 16, False), "floa", "ci", "fwd", 19_231_232),
    ((1, 8, 768, 768, 199, 128, 1, 16, False), "floa", "ci", "100", 9_805_824),
]  # fmt: skip


@pytest.mark.parametrize("geometry, dtype, layout, call, measured", SWEEP_EXACT)
def test_the_rule_gives_these_sweep_calls_to_the_byte(geometry, dtype, layout, call, measured):
    from pytorch_mem_profiler.estimate.conv_workspace import rule_for_sweep_case

    assert rule_for_sweep_case(_sweep_case(geometry, dtype, layout, call), {"benchmark": False})["scratch"] == measured


@pytest.mark.parametrize("geometry, dtype, layout, call, measured", CHANNELS_INNERMOST_WITHIN)
def test_1d_convolutions_over_channels_innermost_input_are_never_under_by_more_than_the_bound(geometry, dtype, layout, call, measured):
    from pytorch_mem_profiler.estimate.conv_workspace import rule_for_sweep_case

    rule = rule_for_sweep_case(_sweep_case(geometry, dtype, layout, call), {"benchmark": False})
    assert rule["scratch"] != measured and rule["scratch"] >= measured - rule["bound"], (rule, measured)


@pytest.mark.parametrize("flags, geometry, dtype, layout, call, measured", SWEEP)
def test_every_class_of_the_sweep_is_within_the_rules_bound(monkeypatch, flags, geometry, dtype, layout, call, measured):
    from pytorch_mem_profiler.estimate.conv_workspace import rule_for_sweep_case

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", flags != "no_tf32")
    rule = rule_for_sweep_case(_sweep_case(geometry, dtype, layout, call), {"benchmark": flags == "benchmark"})
    assert abs(rule["scratch"] - measured) <= rule["bound"], (rule, measured)


@pytest.mark.parametrize("geometry, dtype, layout, call, measured", BENCHMARK_FIRST_CALLS)
def test_the_benchmark_search_is_within_the_bound(geometry, dtype, layout, call, measured):
    from pytorch_mem_profiler.estimate.conv_workspace import rule_for_sweep_case

    rule = rule_for_sweep_case(_sweep_case(geometry, dtype, layout, call), {"benchmark": True})
    assert abs(rule["scratch"] - measured) <= rule["bound"]
    without = rule_for_sweep_case(_sweep_case(geometry, dtype, layout, call), {"benchmark": False})
    assert abs(without["scratch"] - measured) > without["bound"]  # the search is what the wider bound is for


def _meta(shape, dtype=F32, fmt=None):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.contiguous(memory_format=fmt) if fmt is not None else t


def _forward(x, w, stride, **kwargs):
    k = w.shape[-1]
    n = w.dim() - 2
    return convolution_scratch(
        x, w, stride=[stride] * n, padding=[k // 2] * n, dilation=[1] * n, transposed=False, groups=kwargs.pop("groups", 1),
        benchmark=False, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("x, w, stride, dtype, measured", MEASURED_FORWARD)
def test_the_transform_rule_gives_the_measured_forward_workspace_to_the_byte(x, w, stride, dtype, measured):
    found = _forward(_meta(x, dtype), _meta(w, dtype), stride)
    assert found.backend == "cudnn"
    assert sum(found.blocks) == measured


@pytest.mark.parametrize("x, w, stride, dtype, measured", MEASURED_FORWARD_OFF_RULE)
def test_where_cudnn_asks_more_the_measured_workspace_is_within_the_bound(x, w, stride, dtype, measured):
    found = _forward(_meta(x, dtype), _meta(w, dtype), stride)
    assert sum(found.blocks) != measured
    assert abs(sum(found.blocks) - measured) <= found.bound


@pytest.mark.parametrize("go, x, w, mask, dtype, measured", MEASURED_BACKWARD)
def test_the_backward_rule_is_within_its_bound_of_the_measured_scratch(go, x, w, mask, dtype, measured):
    k = w[-1]
    stride = x[-1] // go[-1]
    found = convolution_backward_scratch(
        _meta(go, dtype), _meta(x, dtype), _meta(w, dtype), stride=[stride] * 2, padding=[k // 2] * 2, dilation=[1, 1],
        transposed=False, groups=1, output_mask=mask, benchmark=False,
    )  # fmt: skip
    assert abs(sum(found.blocks) - measured) <= found.bound, (sum(found.blocks), measured, found.bound)


def test_the_backward_passes_are_each_above_the_gradients_made_after_them():
    go, x, w = _meta((8, 32, 256, 256)), _meta((8, 96, 256, 256)), _meta((32, 96, 3, 3))
    forward = _forward(x, w, 1)
    transforms = sum(forward.blocks)  # each pass transforms the same three tensors
    weight_grad = block_size(32 * 96 * 9 * 4)
    bias_grad = block_size(32 * 4)
    geometry = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    both = convolution_backward_scratch(go, x, w, output_mask=(True, True, True), **geometry)
    # the data pass runs before the weight's and bias's gradients exist, the filter pass before the bias's;
    # the filter pass asks past the 2 MiB-rounded block the data pass left (fp32), in bf16 it is handed it
    rounded = -(-transforms // (2 << 20)) * (2 << 20)
    assert both.passes == ((transforms - weight_grad - bias_grad,), (rounded + 115_712 - bias_grad,))
    half = convolution_backward_scratch(go.bfloat16(), x.bfloat16(), w.bfloat16(), output_mask=(True, True, False), **geometry)
    half_transforms = sum(_forward(x.bfloat16(), w.bfloat16(), 1).blocks)
    assert half.passes[1] == (-(-half_transforms // (2 << 20)) * (2 << 20),)
    assert both.held == ()
    only_input = convolution_backward_scratch(go, x, w, output_mask=(True, False, False), **geometry)
    assert only_input.passes == ((transforms,),)
    only_bias = convolution_backward_scratch(go, x, w, output_mask=(False, False, True), **geometry)
    assert only_bias.blocks == ()  # a sum over (0, 2, 3) of NCHW: not a column reduction


def test_channels_last_convolutions_take_no_transforms_and_their_bias_gradient_is_a_column_reduction():
    x, w = _meta((64, 64, 56, 56), BF16, CL), _meta((64, 64, 3, 3), BF16, CL)
    assert memory_format(x) == "channels_last"
    assert _forward(x, w, 1).blocks == ()
    go = _meta((64, 64, 56, 56), BF16, CL)
    found = convolution_backward_scratch(
        go, x, w, stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, groups=1,
        output_mask=(False, False, True), benchmark=False, multiprocessors=132,
    )  # fmt: skip
    from pytorch_mem_profiler.estimate.scratch import column_reduction_scratch

    # rows = N * H * W = 200,704 gradients of each of 64 channels, summed into float partials
    assert found.blocks == column_reduction_scratch(64 * 56 * 56, 64, multiprocessors=132) != ()


def test_aten_copies_what_is_not_in_the_layout_it_hands_cudnn():
    x, w = _meta((8, 64, 128, 128)), _meta((64, 64, 3, 3))
    plain = sum(_forward(x, w, 1).blocks)
    # a channel slice of a concatenation: copied to contiguous first, alive through the operator
    wide = _meta((8, 128, 128, 128))[:, :64]
    sliced = _forward(wide, w, 1)
    assert sliced.held == (8 * 64 * 128 * 128 * 4,) and sum(sliced.blocks) == plain + 8 * 64 * 128 * 128 * 4
    # a channels_last weight makes the layout channels_last: the contiguous input is copied, no transforms
    mixed = _forward(x, w.contiguous(memory_format=CL), 1)
    assert mixed.blocks == (8 * 64 * 128 * 128 * 4,)


def test_depthwise_convolutions_run_torchs_own_kernel_without_a_workspace_unless_channels_last():
    x, w = _meta((128, 72, 56, 56), BF16), _meta((72, 1, 3, 3), BF16)
    geometry = {"stride": [1, 1], "dilation": [1, 1], "transposed": False, "groups": 72}
    assert conv_backend(x, w, **geometry) == "depthwise"
    assert _forward(x, w, 1, groups=72).blocks == ()
    assert conv_backend(x.contiguous(memory_format=CL), w.contiguous(memory_format=CL), **geometry) == "cudnn"
    # fp16 at this shape is cuDNN's (ATen's workload table), and so is a grouped non-depthwise convolution
    assert conv_backend(x.half(), w.half(), **geometry) == "cudnn"
    assert conv_backend(_meta((8, 64, 32, 32)), _meta((64, 16, 3, 3)), **{**geometry, "groups": 4}) == "cudnn"


def test_a_transposed_convolution_is_the_data_pass_of_the_convolution_it_transposes():
    # UNet's up-convolution: (8, 512, 16, 16) -> 256 channels, 2x2 stride 2, measured 14,680,576
    x, w = _meta((8, 512, 16, 16)), _meta((512, 256, 2, 2))
    found = convolution_scratch(x, w, stride=[2, 2], padding=[0, 0], dilation=[1, 1], transposed=True, groups=1, benchmark=False)
    assert sum(found.blocks) == 14_680_576


def test_conv1d_is_a_2d_convolution_of_height_one():
    x, w = _meta((32, 256, 1024)), _meta((256, 256, 3))
    x2, w2 = _meta((32, 256, 1, 1024)), _meta((256, 256, 1, 3))
    one = convolution_scratch(x, w, stride=[1], padding=[1], dilation=[1], transposed=False, groups=1, benchmark=False)
    two = convolution_scratch(x2, w2, stride=[1, 1], padding=[0, 1], dilation=[1, 1], transposed=False, groups=1, benchmark=False)
    assert one.blocks == two.blocks != ()


def test_cudnn_benchmark_widens_the_bound_by_the_search():
    x, w = _meta((8, 64, 128, 128)), _meta((64, 64, 3, 3))
    plain = _forward(x, w, 1)
    searched = convolution_scratch(x, w, stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, groups=1, benchmark=True)
    assert searched.blocks == plain.blocks and searched.bound > plain.bound


def test_the_upsample_backward_copies_a_sliced_gradient():
    aten = torch.ops.aten
    grad = _meta((8, 96, 256, 256))[:, :64]
    args = (grad, [256, 256], [8, 64, 128, 128], False)
    assert layout_copies(aten.upsample_bilinear2d_backward.default, args, {}) == (134_217_728,)  # measured on UNet
    assert layout_copies(aten.upsample_bilinear2d_backward.default, (grad.contiguous(), *args[1:]), {}) == ()
    # a channels_last gradient with 4+ channels runs the NHWC kernel: no copy
    assert layout_copies(aten.upsample_bilinear2d_backward.default, (grad.contiguous(memory_format=CL), *args[1:]), {}) == ()
    assert KernelScratch()(aten.upsample_bilinear2d_backward.default, args, {}) == (134_217_728,)


def test_passes_are_taken_in_turn_by_the_counter():
    counter = StorageLifeCounter(torch.device("cpu"))
    counter.transient(Passes(held=(1024,), passes=((4096,), (8192, 512))))
    assert counter.peak == 1024 + 8192 + 512 and counter.now == 0
    order = sorted((life.born, life.nbytes) for life in counter.lives)
    # the held block first; the first pass is given back before the second is taken
    assert [n for _, n in order] == [1024, 4096, 8192, 512]
    first, second = counter.lives[1], counter.lives[2]
    assert first.died < second.born


# -- an estimate -------------------------------------------------------------------------
def _conv_step():
    """One 3x3 convolution, 16 -> 16 channels, no bias, on a (4, 16, 64, 64) batch; the loss sums the output."""
    return nn.Conv2d(16, 16, 3, padding=1, bias=False), torch.zeros(4, 16, 64, 64)


def test_a_cuda_estimate_takes_the_convolutions_workspace_at_its_operator():
    model, batch = _conv_step()
    estimate = estimate_memory(model, batch, optimizer=SGD, device="cuda", emulate=True, fit=False)
    cpu = estimate_memory(model, batch, optimizer=SGD, device="cpu", fit=False)
    weight = 16 * 16 * 9 * 4
    activation = 4 * 16 * 64 * 64 * 4  # the batch, the output: 1 MiB each
    # forward and backward (the filter pass; the batch wants no gradient) transform the same three tensors
    workspace = block_size(activation + activation + weight + 256)
    # the output's gradient is the scalar's, expanded (strides 0): ATen copies it for cuDNN first
    grad_copy = activation
    loss = ones = 512  # the scalar loss and its gradient, one block each
    assert estimate.kernel_scratch == workspace + grad_copy == 3_155_456
    assert estimate.peak_phase == "backward"
    assert estimate.peak == weight + activation + activation + loss + ones + weight + grad_copy + workspace
    assert sum(estimate.peak_breakdown.values()) == estimate.peak
    assert estimate.peak_breakdown["other"] >= workspace + grad_copy
    # the forward's peak: the weight, the batch, the output and the forward's workspace
    assert estimate.phases["forward"] == weight + activation + activation + workspace
    # the rule's bound is stated, per operator; the forward's workspace and the backward's are never
    # alive together: the peak may be off by the larger, not by both
    assert set(estimate.error_bounds) == {CONVOLUTION_BOUND, CONVOLUTION_BACKWARD_BOUND}
    assert estimate.transient_bounds == {CONVOLUTION_BOUND, CONVOLUTION_BACKWARD_BOUND}
    assert estimate.error_bound == max(estimate.error_bounds.values()) > 0
    assert estimate.error_bound < sum(estimate.error_bounds.values())
    # the CPU's estimate takes none
    assert cpu.kernel_scratch == 0 and not cpu.error_bounds


def test_the_allocator_replay_takes_and_gives_back_the_workspace_around_its_operator():
    model, batch = _conv_step()
    plan = StepPlan(model=model, example_inputs=batch, optimizer=SGD, device=torch.device("cuda"), run_device=torch.device("cpu"))
    step = run_step(plan, 4)
    events = list(step.events)
    taken = [i for i, (_, n) in enumerate(events) if n == 2_106_880]
    assert len(taken) == 4  # forward and backward, in each of the two steps
    for i in taken:
        key = events[i][0]
        assert events[i + 1] == (key, -2_106_880)  # given back before anything else happens
    # the workspace is a block of the large pool: its own 2 MiB-rounded segment, kept by the cache
    assert step.reserved >= 2_106_880 + (20 << 20)


def test_channels_last_models_take_no_transforms_in_the_estimate():
    model, batch = _conv_step()
    model = model.to(memory_format=CL)
    estimate = estimate_memory(model, batch.contiguous(memory_format=CL), optimizer=SGD, device="cuda", emulate=True, fit=False)
    # the batch keeps its layout at any batch size; only the expanded scalar gradient is copied (1 MiB)
    assert estimate.kernel_scratch == 4 * 16 * 64 * 64 * 4
    assert estimate.phases["forward"] == 16 * 16 * 9 * 4 + 2 * 4 * 16 * 64 * 64 * 4


def test_measured_convolutions_take_their_measured_scratch_and_no_bound(monkeypatch):
    from pytorch_mem_profiler.estimate import kernel_probe

    monkeypatch.setattr(kernel_probe, "MEASURED", {})
    aten = torch.ops.aten
    x, w = _meta((8, 64, 128, 128)), _meta((64, 64, 3, 3))
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    rules = KernelScratch(measured=True)
    # not measured yet: the rule (and its bound), the call kept for measuring
    assert rules(aten.convolution.default, args, {}) == _forward(x, w, 1).blocks
    key = kernel_probe.convolution_key(aten.convolution.default, args, {})
    assert rules.pending == {key} and CONVOLUTION_BOUND in rules.bounds
    # measured: that figure, one block, no bound added
    kernel_probe.MEASURED[key] = 12_345_600
    fresh = KernelScratch(measured=True)
    assert fresh(aten.convolution.default, args, {}) == (12_345_600,)
    assert fresh.bounds == {} and fresh.pending == set()
    # measured as not runnable here (too large): the rule, and not asked again
    kernel_probe.MEASURED[key] = None
    again = KernelScratch(measured=True)
    assert again(aten.convolution.default, args, {}) == _forward(x, w, 1).blocks and again.pending == set()
    # the key tells apart what the kernel's choice depends on: strides (layout), dtype, geometry, flags
    cl = kernel_probe.convolution_key(aten.convolution.default, (x.contiguous(memory_format=CL), *args[1:]), {})
    assert cl != key


def test_the_measured_path_is_off_where_the_step_runs_on_fake_cpu_tensors():
    from pytorch_mem_profiler.estimate.step import kernel_scratch

    model, batch = _conv_step()
    plan = StepPlan(model=model, example_inputs=batch, optimizer=SGD, device=torch.device("cuda"),
                    run_device=torch.device("cpu"), measure_kernels=True)  # fmt: skip
    assert run_step(plan, 4).kernel_scratch == 3_155_456  # the rule's, as without measuring
    assert kernel_scratch(torch.device("cpu"), measured=True) is None


#: Pointwise calls of the zoo's and the held-back models' training steps on an H100 (torch 2.11,
#: cuDNN 9.19, ``estimate_memory(..., measure_kernels=True)``): (call, input, C_out, dtype, output
#: mask, measured scratch). From 13x13 positions up NCHW pointwise convolutions run as GEMMs: the
#: forward takes none, the backward one fp32 partial weight gradient per image (or the transforms
#: where those are fewer bytes: the 1000-class head); at 7x7 they take the transforms, or by another
#: plan the partials (fp32, and bf16 in MNASNet: the bound covers them).
POINTWISE_MEASURED = [
    ("backward", (64, 512, 14, 14), 128, BF16, (True, True, False), 16_777_216),  # GoogLeNet: the partials
    ("backward", (128, 48, 56, 56), 104, F32, (True, True, False), 2_555_904),  # RegNet
    ("backward", (128, 16, 112, 112), 64, BF16, (True, True, False), 524_288),  # MobileNetV3
    ("backward", (128, 512, 13, 13), 1000, F32, (True, True, True), 139_215_872),  # SqueezeNet's head: the transforms
    ("backward", (64, 832, 7, 7), 256, BF16, (True, True, False), 6_824_448),  # 7x7: the transforms
    ("backward", (64, 192, 7, 7), 1152, F32, (True, True, False), 56_623_104),  # 7x7 fp32: the partials (in the bound)
    ("backward", (64, 192, 7, 7), 1152, BF16, (True, True, False), 56_623_104),  # MNASNet 7x7 bf16: the partials (in the bound)
    ("backward", (64, 1152, 7, 7), 320, BF16, (True, True, False), 94_371_840),  # MNASNet, contracting: the partials
    ("backward", (64, 320, 7, 7), 1280, BF16, (True, True, False), 104_857_600),  # MNASNet's last 1x1: the partials
    ("backward", (64, 1152, 7, 7), 192, BF16, (True, True, False), 8_929_280),  # MNASNet, the same sizes the other way: the transforms
    ("backward", (128, 464, 7, 7), 1024, BF16, (True, True, False), 18_665_984),  # ShuffleNetV2's last 1x1: the transforms
    ("forward", (64, 832, 7, 7), 384, BF16, None, 7_627_264),  # 7x7: the transforms
    ("forward", (64, 672, 14, 14), 112, F32, None, 512),  # a GEMM: none
]  # fmt: skip


def _pointwise(call, x_shape, c_out, dtype, mask, stride=1, fmt=None):
    x = _meta(x_shape, dtype, fmt)
    w = _meta((c_out, x_shape[1], 1, 1), dtype, fmt)
    if call == "forward":
        return _forward(x, w, stride)
    size = (x_shape[2] - 1) // stride + 1
    geometry = {"stride": [stride] * 2, "padding": [0, 0], "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    return convolution_backward_scratch(_meta((x_shape[0], c_out, size, size), dtype, fmt), x, w, output_mask=mask, **geometry)


@pytest.mark.parametrize("call, x, c_out, dtype, mask, measured", POINTWISE_MEASURED)
def test_pointwise_convolutions_take_what_their_plan_takes(call, x, c_out, dtype, mask, measured):
    from pytorch_mem_profiler.estimate.conv_workspace import POINTWISE_GEMM_POSITIONS

    found = _pointwise(call, x, c_out, dtype, mask)
    assert abs(sum(found.blocks) - measured) <= found.bound, (sum(found.blocks), measured, found.bound)
    partials = x[0] * x[1] * c_out * 4
    if x[2] * x[3] >= POINTWISE_GEMM_POSITIONS or measured != partials:  # the GEMMs, and the transforms at 7x7
        assert abs(sum(found.blocks) - measured) <= 8_400_000, (sum(found.blocks), measured)


def test_a_pointwise_backward_takes_one_fp32_weight_gradient_per_image():
    from pytorch_mem_profiler.estimate.conv_workspace import pointwise_filter_partials

    found = _pointwise("backward", (128, 48, 56, 56), 104, F32, (True, True, False))  # RegNet: 2,555,904 measured
    assert found.passes == ((pointwise_filter_partials((128, 48, 56, 56), (128, 104, 56, 56)),),)  # no data-pass block
    assert pointwise_filter_partials((128, 48, 56, 56), (128, 104, 56, 56)) == 128 * 48 * 104 * 4 == 2_555_904


def test_grouped_channels_last_and_transposed_pointwise_ones_keep_their_own_classes(monkeypatch):
    from pytorch_mem_profiler.estimate import conv_workspace

    geometry = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "benchmark": False}
    go, x = _meta((64, 128, 14, 14), BF16), _meta((64, 512, 14, 14), BF16)
    calls = {
        "plain": lambda: _pointwise("backward", (64, 512, 14, 14), 128, BF16, (True, True, False)),
        "grouped": lambda: convolution_backward_scratch(
            go, x, _meta((128, 128, 1, 1), BF16), transposed=False, groups=4, output_mask=(True, True, False), **geometry
        ),
        "channels_last": lambda: _pointwise("backward", (64, 512, 14, 14), 128, BF16, (True, True, False), fmt=torch.channels_last),
        "transposed": lambda: convolution_backward_scratch(
            x, go, _meta((128, 512, 1, 1), BF16), transposed=True, groups=1, output_mask=(True, True, False), **geometry
        ),
    }  # fmt: skip
    with_class = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(conv_workspace, "POINTWISE_GEMM_POSITIONS", math.inf)  # the GEMM class off
    without = {name: call() for name, call in calls.items()}
    assert with_class["plain"] != without["plain"]  # the class applies to the plain one ...
    for name in ("grouped", "channels_last", "transposed"):
        assert with_class[name] == without[name], name  # ... and to none of these


def test_a_strided_1x1_that_took_none_is_below_the_rule():
    # RegNet's fp32 (128, 32, 112, 112) -> 48, stride 2, measured 0 forward and backward: the rule's
    # transforms are above it, on the safe side
    for call, mask in (("forward", None), ("backward", (True, True, False))):
        assert sum(_pointwise(call, (128, 32, 112, 112), 48, F32, mask, stride=2).blocks) > 0


#: 2-D fp32 first layers (3 channels in, not a 7x7 stem), backward, measured on an H100 (torch 2.11):
#: none took a workspace. (x, output channels, stride, padding, output mask).
FIRST_LAYER_FP32_BACKWARD = [
    ((128, 3, 224, 224), 64, 2, 0, (False, True, True)),  # SqueezeNet 1.0's, in its step
    ((128, 3, 224, 224), 32, 2, 1, (False, True, False)),  # EfficientNet's and MobileNetV2's stems
    ((128, 3, 224, 224), 16, 2, 1, (False, True, False)),  # MobileNetV3's
    ((64, 3, 224, 224), 32, 2, 1, (False, True, False)),  # RegNet's
    ((8, 3, 256, 256), 32, 1, 1, (True, True, True)),  # a UNet's, every gradient asked for
    ((256, 3, 32, 32), 32, 1, 1, (True, True, True)),  # a CIFAR net's
]  # fmt: skip


@pytest.mark.parametrize("x_shape, c_out, stride, padding, mask", FIRST_LAYER_FP32_BACKWARD)
def test_an_fp32_first_layer_backward_takes_none_within_the_forward_bound(x_shape, c_out, stride, padding, mask):
    from pytorch_mem_profiler.estimate.conv_workspace import WORKSPACE_FLOOR, WORKSPACE_SHARE, transforms_bytes

    size = (x_shape[2] + 2 * padding - 3) // stride + 1
    y_shape = (x_shape[0], c_out, size, size)
    geometry = {"stride": [stride] * 2, "padding": [padding] * 2, "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    found = convolution_backward_scratch(_meta(y_shape), _meta(x_shape), _meta((c_out, 3, 3, 3)), output_mask=mask, **geometry)
    assert sum(found.blocks) == 0  # measured: 0 on every one
    transforms = transforms_bytes(x_shape, y_shape, (c_out, 3, 3, 3), torch.float32)
    assert found.bound == WORKSPACE_FLOOR + math.ceil(WORKSPACE_SHARE * transforms)  # the forward's, not T + floor
    assert found.bound < transforms  # what it was before: the transforms plus the floor


def test_an_fp32_layer_of_five_to_seven_channels_keeps_the_loose_bound():
    from pytorch_mem_profiler.estimate.conv_workspace import WORKSPACE_FLOOR, transforms_bytes

    x_shape, y_shape, w_shape = (64, 6, 64, 64), (64, 32, 64, 64), (32, 6, 3, 3)
    geometry = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    found = convolution_backward_scratch(_meta(y_shape), _meta(x_shape), _meta(w_shape), output_mask=(False, True, False), **geometry)
    assert sum(found.blocks) == 0
    assert found.bound == transforms_bytes(x_shape, y_shape, w_shape, torch.float32) + WORKSPACE_FLOOR  # not measured


def test_matrices_cublas_cannot_read_in_place_are_copied_whole():
    """ATen's ``prepare_matrix_for_cublas``: dense row- or column-major matrices, and slices whose
    leading dimension still covers the other size, are read in place; anything else (a ``sum()``
    loss's gradient expanded from one number, a slice strided both ways) is copied contiguous."""
    aten = torch.ops.aten
    with torch.device("meta"):
        x, w = torch.empty(64, 32), torch.empty(32, 16)
        expanded = torch.empty(()).expand(64, 32)
    assert layout_copies(aten.mm.default, (expanded, w), {}) == (64 * 32 * 4,)
    assert layout_copies(aten.mm.default, (expanded.t(), x), {}) == (64 * 32 * 4,)
    assert layout_copies(aten.mm.default, (x, w), {}) == ()
    assert layout_copies(aten.mm.default, (w.t(), x.t()), {}) == ()  # column-major
    assert layout_copies(aten.mm.default, (x[:, :16], w[:16]), {}) == ()  # leading dimension covers the columns
    assert layout_copies(aten.mm.default, (x[::2], w), {}) == ()  # rows strided, columns unit
    assert layout_copies(aten.mm.default, (x[::2, ::2], w[:16]), {}) == (block_size(32 * 16 * 4),)
    bias = torch.empty(16, device="meta")
    assert layout_copies(aten.addmm.default, (bias, expanded, w), {}) == (64 * 32 * 4,)
    assert layout_copies(aten.addmm.default, (bias.expand(64, 16), x, w), {}) == ()  # the bias is not a cuBLAS operand


def test_a_dilated_filter_pass_is_bounded_by_the_split_k_partials_measured():
    """DeepLabV3's ASPP on an H100 and an H200 (fp32, 2048 -> 256 3x3 at 32 x 32, batch 8, dilations 12,
    24, 36): each filter pass took 245,366,928 bytes, 13 fp32 partial weight gradients, where the rule of
    the undilated shape gives the transforms (94.4 MB). The figure stays the rule's; the bound covers it."""
    measured = 245_366_928
    with torch.device("meta"):
        go, x, w = torch.empty(8, 256, 32, 32), torch.empty(8, 2048, 32, 32), torch.empty(256, 2048, 3, 3)
    for dilation in (12, 24, 36):
        dilated = convolution_backward_scratch(go, x, w, stride=[1, 1], padding=[dilation] * 2, dilation=[dilation] * 2,
                                               transposed=False, groups=1, output_mask=[True, True, False])
        plain = convolution_backward_scratch(go, x, w, stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False,
                                             groups=1, output_mask=[True, True, False])
        assert dilated.passes == plain.passes  # the figure: the undilated shape's rule
        filter_pass = dilated.passes[1][0]  # above the bias gradient (none here)
        assert filter_pass < measured <= filter_pass + dilated.bound
        assert plain.bound < measured - filter_pass  # the undilated bound would not cover it


# -- the filter passes' split-K partial sums: the upper reserved figure ---------------------
#: Backward filter passes of the VGG-style CNN (the zoo's ``batchnorm_cnn``: bf16 autocast, batch 64,
#: 3x3, padding 1, no bias) on an H200 (torch 2.11, cuDNN 9; the allocator's history,
#: ``benchmarks/replay_against_real.py --only batchnorm_cnn --batch 64``): (input, weight, the bytes the
#: pass asked). Each asks for the transforms plus k fp32 partial weight gradients, k chosen by cuDNN's
#: heuristics: 13, 13, 13, 13, 7, none for 512 -> 512 and 122 for the first layer (3 channels padded to 8).
MEASURED_FILTER_PASSES = [
    ((64, 64, 224, 224), (64, 64, 3, 3), 824_075_264),
    ((64, 64, 112, 112), (128, 64, 3, 3), 312_263_680),
    ((64, 128, 112, 112), (128, 128, 3, 3), 419_005_440),
    ((64, 128, 56, 56), (256, 128, 3, 3), 170_066_944),
    ((64, 256, 56, 56), (256, 256, 3, 3), 223_216_640),
    ((64, 256, 28, 28), (512, 256, 3, 3), 83_362_816),
    ((64, 512, 28, 28), (512, 512, 3, 3), 107_479_552),
    ((64, 3, 224, 224), (64, 3, 3, 3), 464_680_448),
]  # fmt: skip


@pytest.mark.parametrize("x, w, measured", MEASURED_FILTER_PASSES)
def test_a_filter_pass_asks_within_its_headroom_above_the_rule(x, w, measured):
    go = (x[0], w[0], x[2], x[3])
    first = x[1] < 8
    found = convolution_backward_scratch(
        _meta(go, BF16), _meta(x, BF16), _meta(w, BF16), stride=[1, 1], padding=[1, 1], dilation=[1, 1],
        transposed=False, groups=1, output_mask=(not first, True, False), benchmark=False,
    )  # fmt: skip
    rule, headroom = found.passes[-1][0], found.headroom[-1]
    # the rule's block (the transforms rounded up to 2 MiB) is the figure; what the pass asks lies between
    # the rule less its bound and the rule plus its headroom, which is that bound
    assert headroom == found.bound > 0
    assert rule - found.bound <= measured <= rule + headroom, (rule, headroom, measured)
    if not first:  # the data pass asks for the transforms: no headroom
        assert found.headroom[0] == 0


def test_six_of_the_measured_filter_passes_ask_past_the_rules_block():
    # which is why the reserved needs the upper figure: a request past the block the data pass left takes a
    # segment of its own
    past = 0
    for x, w, measured in MEASURED_FILTER_PASSES:
        found = convolution_backward_scratch(
            _meta((x[0], w[0], x[2], x[3]), BF16), _meta(x, BF16), _meta(w, BF16), stride=[1, 1], padding=[1, 1],
            dilation=[1, 1], transposed=False, groups=1, output_mask=(x[1] >= 8, True, False), benchmark=False,
        )  # fmt: skip
        past += measured > found.passes[-1][0]
    assert past == 6  # all but 64 -> 64 at 224 x 224 (1.9 MB past the transforms) and 512 -> 512 (none)


def test_no_headroom_where_the_rule_is_the_call_or_another_class():
    geometry = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    x, w, go = (64, 64, 56, 56), (64, 64, 3, 3), (64, 64, 56, 56)
    # channels_last: no transforms, no partial sums of this kind
    cl = convolution_backward_scratch(_meta(go, BF16, CL), _meta(x, BF16, CL), _meta(w, BF16, CL), output_mask=(True, True, False), **geometry)
    assert not any(cl.headroom)
    # a small filter pass (transforms under 10 MiB) is not rounded up, nor given headroom
    small = convolution_backward_scratch(_meta((2, 16, 32, 32), BF16), _meta((2, 16, 32, 32), BF16), _meta((16, 16, 3, 3), BF16),
                                         output_mask=(True, True, False), **geometry)  # fmt: skip
    assert small.passes and not any(small.headroom)
    # forwards: none
    assert _forward(_meta(x, BF16), _meta(w, BF16), 1).headroom == ()
    # Passes keep the headroom with the pass it belongs to when empty passes are dropped
    kept = Passes((), ((0,), (100,), (200,)), (0, 7, 0))
    assert kept.passes == ((100,), (200,)) and kept.headroom == (7, 0)


def _bf16_convnet():
    """Three bf16-autocast 3x3 convolutions large enough for the rounded filter-pass rule (transforms >= 10 MiB)."""
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1, bias=False),
                          nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1, bias=False))  # fmt: skip
    return model, torch.zeros(16, 3, 96, 96)


def test_the_upper_reserved_figure_is_the_replay_with_the_filter_passes_at_their_bound(monkeypatch):
    from pytorch_mem_profiler.estimate import conv_workspace

    model, batch = _bf16_convnet()
    kwargs = {"optimizer": SGD, "device": "cuda", "emulate": True, "fit": False, "autocast": torch.bfloat16}
    est = estimate_memory(model, batch, **kwargs)
    assert est.reserved_bound > 0
    # independently: the same estimate with every split-K filter pass asking its figure plus its bound
    original = conv_workspace.cudnn_pass_workspace

    def at_bound(kind, *args, **kw):
        workspace, bound, sums = original(kind, *args, **kw)
        return conv_workspace.PassWorkspace(workspace + bound if sums else workspace, bound, False)

    monkeypatch.setattr(conv_workspace, "cudnn_pass_workspace", at_bound)
    upper = estimate_memory(model, batch, **kwargs)
    assert upper.reserved_bound == 0
    assert est.reserved + est.reserved_bound == upper.reserved
    assert "(up to " in est.format()


def test_no_upper_reserved_figure_without_such_passes():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    est = estimate_memory(model, torch.zeros(64, 256), optimizer=SGD, device="cuda", emulate=True, fit=False)
    assert est.reserved is not None and est.reserved_bound == 0
    assert "(up to " not in est.format()
    fp32 = estimate_memory(*_bf16_convnet(), optimizer=SGD, device="cuda", emulate=True, fit=False)
    # fp32 filter passes ask past the rounded block too (by FP32_FILTER_EXCESS at least): bounded the same way
    assert fp32.reserved_bound > 0


# -- cuDNN's workspaces give way under a limit -------------------------------------------
def test_only_cudnns_workspaces_give_way():
    geometry = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "transposed": False, "groups": 1, "benchmark": False}
    x, w = (8, 64, 56, 56), (64, 64, 3, 3)
    nchw = convolution_backward_scratch(_meta(x, BF16), _meta(x, BF16), _meta(w, BF16), output_mask=(True, True, False), **geometry)
    assert len(nchw.passes) == 2 and nchw.fallback == (True, True)  # the data and filter passes: cuDNN's workspaces
    # channels_last with a bias: the bias gradient's column reduction is ATen's own, after cuDNN's passes
    cl = convolution_backward_scratch(_meta(x, BF16, CL), _meta(x, BF16, CL), _meta(w, BF16, CL), output_mask=(True, True, True),
                                      **geometry)  # fmt: skip
    assert cl.fallback[-1] is False and len(cl.fallback) == len(cl.passes)
    assert all(cl.fallback[:-1])
    forward = _forward(_meta(x, BF16), _meta(w, BF16), 1)
    assert forward.passes and forward.fallback == (True,) * len(forward.passes)
    # torch's own depthwise kernel: no cuDNN, nothing gives way
    depthwise = convolution_backward_scratch(_meta(x, BF16), _meta(x, BF16), _meta((64, 1, 3, 3), BF16),
                                             output_mask=(True, True, True), **{**geometry, "groups": 64})  # fmt: skip
    assert depthwise.backend == "depthwise" and not any(depthwise.fallback)
    # Passes keep each flag with its pass when empty passes are dropped
    kept = Passes((), ((0,), (100,), (200,)), (), (True, False, True))
    assert kept.passes == ((100,), (200,)) and kept.fallback == (False, True)


def test_the_counter_marks_the_workspaces_and_the_replay_under_a_limit_does_without_them():
    model, batch = _conv_step()
    plan = StepPlan(model=model, example_inputs=batch, optimizer=SGD, device=torch.device("cuda"), run_device=torch.device("cpu"))
    step = run_step(plan, 4)
    events, fallback = step.step_events.events, step.step_events.fallback
    sizes = {key: n for key, n in events if n > 0}
    # the forward's and the backward's workspaces of both steps; not the copied gradient (ATen's)
    assert sorted(sizes[key] for key in fallback) == [2_106_880] * 4
    assert all(step.step_events.sources[key].startswith("aten.convolution") for key in fallback)
    copies = [key for key, source in step.step_events.sources.items() if source.startswith("aten.convolution_backward")]
    assert set(copies) - fallback  # the expanded gradient's copy stays

    def smallest_limit(keys):
        mib = 1 << 20
        limits = [n * 2 * mib for n in range(1, 64) if simulate_reserved(events, limit=n * 2 * mib, fallback=keys) is not None]
        return min(limits)

    without, given_way = smallest_limit(frozenset()), smallest_limit(fallback)
    assert given_way < without  # the workspaces' segment is not needed when they give way
    replay = AllocatorReplay(limit=given_way, fallback=fallback).run(events)
    assert replay.oom is None and replay.fallbacks > 0
    # a step's own tensors never give way: under the limit less what the tensors need, it runs out
    assert simulate_reserved(events, limit=given_way - (2 << 20), fallback=fallback) is None


def test_the_search_leaves_the_convolutions_bound_unreserved():
    model, batch = _conv_step()
    est = estimate_memory(model, batch, optimizer=SGD, device="cuda", emulate=True)
    assert est.fallback_bounds == {CONVOLUTION_BOUND, CONVOLUTION_BACKWARD_BOUND} and est.search_bound == 0 < est.error_bound
    limit = 400 << 20
    search = est.batch_search(limit, margin=0, outside=0)
    assert search.bound == 0
    # the answer fits the replay, where cuDNN's workspaces give way, and the next batch tried above it does not
    above = min(batch for batch, fits in search.tried if not fits and batch > search.largest)
    assert est.batch_fits(search.largest, limit, outside=0) and not est.batch_fits(above, limit, outside=0)
    assert est.reserved_at(search.largest, limit - est._layout(limit), process="fresh") is not None


class _TokenConv(nn.Module):
    """A Conv1d over token embeddings, transposed (channels innermost) or made contiguous first."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        self.embed, self.conv, self.contiguous = nn.Embedding(512, 64), nn.Conv1d(64, 64, 3, padding=1), contiguous

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2)
        return self.conv(x.contiguous() if self.contiguous else x).amax(-1)


def test_a_1d_convolution_over_channels_innermost_input_does_not_give_way():
    # a Conv1d over embed(ids).transpose(1, 2) runs channels_last on the device; under a limit its
    # workspaces were seen not to give way (the text CNN's largest batch, H200): they and their bound
    # are kept, under its own name
    ids = torch.zeros(16, 256, dtype=torch.long)
    kwargs = {"optimizer": SGD, "device": "cuda", "emulate": True, "autocast": torch.bfloat16}
    transposed = estimate_memory(_TokenConv(contiguous=False), ids, **kwargs)
    assert set(transposed.error_bounds) == {CONVOLUTION_BOUND + CHANNELS_INNERMOST_LAYOUT, CONVOLUTION_BACKWARD_BOUND + CHANNELS_INNERMOST_LAYOUT}
    assert not transposed.fallback_bounds and transposed.search_bound == transposed.error_bound > 0
    assert not transposed.step_events.fallback
    contiguous = estimate_memory(_TokenConv(contiguous=True), ids, **kwargs)
    assert contiguous.fallback_bounds == {CONVOLUTION_BOUND, CONVOLUTION_BACKWARD_BOUND} and contiguous.search_bound == 0
    assert contiguous.step_events.fallback
