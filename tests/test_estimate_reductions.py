"""CUDA's sum and mean over any dimensions and strides (``estimate.reductions``): the reduction
kernel's partial sums and semaphores, against what an H200's allocator history showed, the column
rule where both apply, and in a CUDA estimate's step."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import block_size
from pytorch_mem_profiler.estimate.reductions import reduction_layout, reduction_scratch
from pytorch_mem_profiler.estimate.scratch import KernelScratch

from .helpers import measured_peak
from .test_estimate_scratch import MEASURED_SUMS

MiB = 1 << 20

#: Reductions an H200's allocator history showed inside the operator (torch 2.11, 2026-11-29): the
#: requested bytes of the partial sums and of the semaphores, in that order. Falcon-Mamba's backward
#: (fp32, batch 8, 128 tokens, 512 channels, state 16): the gradient of ``A[None, :, None, :]`` (a sum
#: over batch and positions of a contiguous (8, 512, 128, 16) tensor) and of ``dt_proj``'s bias over a
#: transposed gradient; a loss's ``sum()`` of (8, 128, 256) floats.
HISTORY = [
    ((8, 512, 128, 16), (1048576, 2048, 16, 1), (0, 2), 4, (67_108_864, 256)),
    ((8, 512, 128), (65536, 1, 512), (0, 2), 4, (4_194_304, 16)),
    ((8, 128, 256), (32768, 256, 1), None, 4, (128, 4)),
]


@pytest.mark.parametrize("rows, cols, measured", MEASURED_SUMS)
def test_a_leading_reduction_of_a_contiguous_tensor_gives_the_measured_bytes(rows, cols, measured):
    assert sum(reduction_scratch((rows, cols), (cols, 1), (0,), 4)) == measured


@pytest.mark.parametrize("shape, strides, dims, itemsize, requested", HISTORY)
def test_the_rule_gives_the_blocks_the_h200s_history_showed(shape, strides, dims, itemsize, requested):
    assert reduction_scratch(shape, strides, dims, itemsize) == tuple(block_size(n) for n in requested)


def test_leading_dimensions_of_a_contiguous_tensor_merge_into_the_measured_two_dimensional_case():
    # contiguous tensors of 3 and 4 dimensions summed over leading ones are one run of rows by one of
    # columns (the 2-D case of MEASURED_SUMS): the layout merges them, so the blocks are the 2-D ones
    sizes = (2, 7, 16, 100, 256, 768, 4096)
    checked = 0
    for shape in itertools.chain(itertools.product(sizes, (8, 64), (3, 1024)), itertools.product((4, 32), (16, 128), (2, 8), (64, 512))):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        for lead in range(1, len(shape)):
            rows = cols = 1
            for size in shape[:lead]:
                rows *= size
            for size in shape[lead:]:
                cols *= size
            flat = reduction_scratch((rows, cols), (cols, 1), (0,), 4)
            assert reduction_scratch(shape, strides, tuple(range(lead)), 4) == flat, (shape, lead)
            assert reduction_layout(shape, strides, tuple(range(lead))) == [(rows, cols, True), (cols, 1, False)]
            checked += 1
    assert checked > 60


def test_the_layout_puts_reduced_dimensions_first_and_merges_what_memory_runs_on():
    # a 3-D bias gradient: batch and positions are one stretch of rows
    assert reduction_layout((8, 256, 2048), (524288, 2048, 1), (0, 1)) == [(2048, 2048, True), (2048, 1, False)]
    # channels_last (N, C, H, W) summed over (0, 2, 3): N, H, W one run, the channels innermost
    assert reduction_layout((16, 64, 28, 28), (50176, 1, 1792, 64), (0, 2, 3)) == [(12544, 64, True), (64, 1, False)]
    # a sum over the innermost dimension reduces the fastest one; sizes of 1 drop out
    assert reduction_layout((64, 1, 768), (768, 768, 1), (2,)) == [(768, 1, True), (64, 768, False)]


def test_a_transposed_or_sliced_input_vectorizes_only_where_its_strides_allow():
    # the (8, 512, 128) sum over (0, 2) with the channels innermost: 4 outputs a lane, 32 x 4 threads a
    # block, 256 inputs a thread, split over 16 blocks per output
    assert reduction_scratch((8, 512, 128), (65536, 1, 512), (0, 2), 4) == (4 * MiB, 512)
    # starting at an odd element, one output a lane: 32 x 16 threads, 64 inputs each, no split
    assert reduction_scratch((8, 512, 128), (65536, 1, 512), (0, 2), 4, storage_offset=1) == ()


def test_the_operator_rules_take_any_dims_strides_and_full_sums():
    aten = torch.ops.aten
    rules = KernelScratch(132)
    with torch.device("meta"):
        scan = torch.empty(8, 512, 128, 16)
        transposed = torch.empty(8, 128, 512).transpose(1, 2)
        loss = torch.empty(8, 128, 256)
        doubles = torch.empty(2048, 2048, dtype=torch.float64)
    assert rules(aten.sum.dim_IntList, (scan, [0, 2], True), {}) == (64 * MiB, 512)
    assert rules(aten.mean.dim, (transposed, [0, 2]), {}) == (4 * MiB, 512)
    assert rules(aten.sum.default, (loss,), {}) == rules(aten.mean.default, (loss,), {}) == (512, 512)
    # float64's partial sums are 8 bytes each: twice float32's buffer (the semaphores the same)
    single = rules(aten.sum.dim_IntList, (doubles.to(torch.float32), [0]), {})
    assert single and rules(aten.sum.dim_IntList, (doubles, [0]), {}) == (2 * single[0], single[1])
    # to another dtype: the input copied to it first, then the copy's partial sums (an H200's: 64 MiB, 128 MiB, 512)
    assert rules(aten.sum.dim_IntList, (scan, [0, 2]), {"dtype": torch.float64}) == (64 * MiB, 128 * MiB, 512)


def test_a_sum_to_another_dtype_takes_a_copy_of_its_input_in_that_dtype_first():
    # ATen's make_reduction: self.to(the result's dtype), but half precision summed to float32
    aten = torch.ops.aten
    rules = KernelScratch(132)
    with torch.device("meta"):
        activation = torch.empty(64, 1024, 512)
        mask = torch.empty(64, 1024, 512, dtype=torch.bool)  # amax's backward: restore_reduced_dims(out) == self
        counts = torch.empty(4096, 512, dtype=torch.int32)
        halves = torch.empty(8, 512, 128, 16, dtype=torch.bfloat16)
    assert rules(aten.sum.dim_IntList, (mask, [-1], True), {}) == (mask.numel() * 8,)  # int64: 256 MiB, one block a row
    # a column sum of int32 counts: the int64 copy and int64 partial sums (an H200's: 16 MiB, 32 MiB, 512)
    assert rules(aten.sum.dim_IntList, (counts, [0]), {}) == (16 * MiB, 32 * MiB, 512)
    # half precision summed to float32: read as it is, its partial sums the plain sum's (an H200's: 64 MiB, 512)
    assert rules(aten.sum.dim_IntList, (halves, [0, 2]), {"dtype": torch.float32}) == rules(aten.sum.dim_IntList, (halves, [0, 2]), {})
    assert rules(aten.sum.dim_IntList, (halves, [0, 2]), {}) == (64 * MiB, 512)
    assert rules(aten.sum.dim_IntList, (halves, [0, 2]), {"dtype": torch.bfloat16}) == rules(aten.sum.dim_IntList, (halves, [0, 2]), {})
    # summed to bfloat16 from float32: the copy, then the partial sums of the copy's layout
    partial = rules(aten.sum.dim_IntList, (activation.to(torch.bfloat16), [0, 1]), {})
    assert partial and rules(aten.sum.dim_IntList, (activation, [0, 1]), {"dtype": torch.bfloat16}) == (activation.numel() * 2, *partial)
    # a transposed input's copy keeps its strides (dense): its partial sums are the transposed layout's
    transposed = activation.transpose(1, 2)
    copy = rules(aten.sum.dim_IntList, (transposed, [0, 1]), {"dtype": torch.bfloat16})
    assert copy == (activation.numel() * 2, *rules(aten.sum.dim_IntList, (transposed.to(torch.bfloat16), [0, 1]), {}))


class AmaxPooled(nn.Module):
    """Max-over-time pooling of a 1-D convolution, as text CNNs pool: ``amax``'s backward sums the
    boolean mask of the maxima (``restore_reduced_dims(out) == self``) to int64."""

    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).amax(-1))


def test_the_max_pools_backward_counts_the_mask_copy_on_cuda_only():
    x = torch.randn(8, 64, 256)
    cuda = estimate_memory(AmaxPooled, x, device="cuda", fit=False, emulate=True)
    sums = [key for key, source in cuda.step_events.sources.items() if source.startswith("aten.sum.dim_IntList")]
    sizes = {n for key, n in cuda.step_events.events if key in sums and n > 0}
    assert 8 * 64 * 256 * 8 in sizes  # the int64 copy of the mask, beside the sum's output
    assert estimate_memory(AmaxPooled, x, device="cpu", fit=False).peak == measured_peak(AmaxPooled, lambda: x.clone(), torch.optim.Adam)


class BroadcastScale(nn.Module):
    """A parameter broadcast over batch and positions, as a selective scan's ``A[None, :, None, :]``:
    its gradient is a sum over a middle dimension."""

    def __init__(self, channels: int = 256, state: int = 16) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(channels, state))
        self.proj = nn.Linear(channels, channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, positions, channels)
        h = self.proj(x).transpose(1, 2)  # (batch, channels, positions)
        return torch.exp(self.a[None, :, None, :] * h[..., None])


def test_a_cuda_estimate_takes_the_partial_sums_of_a_broadcast_parameters_gradient():
    batch, positions, channels, state = 8, 128, 256, 16
    estimate = estimate_memory(BroadcastScale(channels, state), torch.zeros(batch, positions, channels), device="cuda", fit=False)
    events = estimate.step_events
    sums = [nbytes for key, nbytes in events.events
            if nbytes > 0 and events.sources.get(key, "").startswith("aten.sum.dim_IntList; backward; other")]  # fmt: skip
    expected = reduction_scratch((batch, channels, positions, state), (channels * positions * state, positions * state, state, 1), (0, 2), 4)
    assert expected and expected[0] >= MiB
    assert sums == list(expected) * 2  # each of the estimate's two steps
    cpu = estimate_memory(BroadcastScale(channels, state), torch.zeros(batch, positions, channels), device="cpu", fit=False)
    assert cpu.kernel_scratch == 0  # the CPU's kernels take none the counter does not see
