"""On a GPU: estimate_memory against the caching allocator, and the largest batch against a small card."""

from __future__ import annotations

import functools
import gc
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from optimizations import FeedForwardStack  # noqa: E402

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _warm_up_workspaces() -> None:
    """A matmul forward and backward, so that both threads' cuBLAS workspaces exist before measuring."""
    a = torch.randn(64, 64, device=CUDA, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize()


def step_peak(build, make_input, optimizer, autocast=None) -> int:
    """Bytes allocated at the peak of two training steps above what was allocated before the model."""
    _warm_up_workspaces()
    _fresh()
    base = torch.cuda.memory_allocated()
    model = build().to(CUDA)
    opt = optimizer(model.parameters())
    x = make_input()
    for _ in range(2):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            out = model(x)
        loss = out.float().sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, x
    _fresh()
    return peak


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def test_the_estimate_runs_on_the_gpus_own_device_type():
    estimate = estimate_memory(mlp(), torch.zeros(32, 256), device="cuda", fit=False)
    assert not estimate.emulated
    _fresh()
    before = torch.cuda.memory_allocated()
    estimate_memory(lambda: nn.Linear(4096, 4096), torch.zeros(8, 4096), device="cuda", fit=False)
    assert torch.cuda.max_memory_allocated() == before  # fake tensors: not one byte on the device


def test_an_mlp_estimate_equals_the_allocators_peak_to_the_byte():
    estimate = estimate_memory(mlp(), torch.zeros(64, 256), optimizer=SGD, device="cuda", fit=False)
    assert estimate.peak == step_peak(mlp, lambda: torch.randn(64, 256, device=CUDA), SGD)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_transformer_block_stack_estimate_is_within_three_percent(autocast):
    build = lambda: FeedForwardStack(512, 4)  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(8, 256, 512), device="cuda", autocast=autocast, fit=False)
    measured = step_peak(build, lambda: torch.randn(8, 256, 512, device=CUDA), torch.optim.Adam, autocast)
    assert abs(estimate.peak - measured) <= 0.03 * measured, (estimate.peak, measured)


def test_the_predicted_largest_batch_fits_a_small_card_and_ten_percent_more_does_not():
    build = lambda: FeedForwardStack(512, 4)  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(4, 256, 512), device="cuda")
    limit = 1 << 30  # a 1 GiB card, as far as the allocator is concerned
    predicted = estimate.max_batch_size(limit, margin=0, outside=0)
    assert predicted > 4
    total = torch.cuda.get_device_properties(CUDA).total_memory

    def run(batch: int) -> int | None:
        torch.cuda.set_per_process_memory_fraction(limit / total)
        try:
            step_peak(build, lambda: torch.randn(batch, 256, 512, device=CUDA), torch.optim.Adam)
            return torch.cuda.max_memory_reserved()
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
            _fresh()

    assert run(predicted) is not None
    larger = run(math.ceil(predicted * 1.1))
    assert larger is None or larger >= 0.95 * limit
