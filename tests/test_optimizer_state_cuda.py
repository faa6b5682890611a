"""Optimizer state on a CUDA GPU: never a false zero, exact against the state tensors and the allocator."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def cuda_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Unique storages of the optimizer's state on the GPU (Adam's step counters stay on the CPU)."""
    storages = {}
    for per_param in opt.state.values():
        for value in per_param.values():
            if torch.is_tensor(value) and value.is_cuda:
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def _step(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    model(torch.randn(32, 256, device=DEV)).pow(2).mean().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_profiler_made_mid_training_on_cuda_reads_none_then_the_exact_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(DEV)
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        _step(model, opt)
    expected = cuda_state_bytes(opt)
    params = sum(p.nbytes for p in model.parameters())
    assert expected == 2 * params  # exp_avg and exp_avg_sq; the step counters are CPU tensors
    with MemoryProfiler(model, stream=io.StringIO(), strict=True) as profiler:
        _step(model, None)
        before = profiler.record_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = profiler.record_stats()
        profiler.epoch_end()
        _step(model, None)  # an epoch that starts without a step
        next_epoch = profiler.record_stats()
    assert before.optimizer_state is None
    assert after.optimizer_state == next_epoch.optimizer_state == expected
    # The allocator agrees: weights and state are what is left once gradients are gone.
    torch.cuda.synchronize()
    assert after.allocated >= params + expected


def test_a_given_optimizer_on_cuda_counts_from_the_first_record():
    torch.manual_seed(0)
    model = nn.Linear(256, 256).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    with MemoryProfiler(model, optimizer=opt, stream=io.StringIO(), strict=True) as profiler:
        record = profiler.record_stats()
    assert record.optimizer_state == cuda_state_bytes(opt) == sum(p.nbytes for p in model.parameters())


def test_cuda_refused_when_the_driver_is_not_available_even_with_a_gpu(monkeypatch):
    """The CUDA wheel without a usable GPU: refused at construction, never profiled as zeros."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' was asked for, but CUDA is not available"):
        MemoryProfiler(nn.Linear(2, 2), device="cuda")
