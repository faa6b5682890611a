"""On a GPU: autograd's engine sums a tensor's gradient pieces in place there (no mode watches the
step), and a CUDA estimate's backward makes the allocations the device's does: their number and
bytes from the allocator's cumulative counters, against the estimate's allocator events."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .test_estimate_accumulation import Branches

pytestmark = pytest.mark.cuda

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
DIM, BATCH = 1024, 256


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _real_second_backward(build, x: torch.Tensor) -> tuple[int, int]:
    """(allocations, bytes) the allocator made during the second step's backward."""
    gc.collect()
    torch.cuda.empty_cache()
    model = build().cuda()
    opt = SGD(model.parameters())
    batch = x.cuda()
    counts = (0, 0)
    for step in (1, 2):
        loss = _loss(model(batch))
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        if step == 2:
            counts = (
                after["allocation.all.allocated"] - before["allocation.all.allocated"],
                after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"],
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    return counts


def _estimated_second_backward(build, x: torch.Tensor) -> tuple[int, int]:
    est = estimate_memory(build, x, optimizer=SGD, loss_fn=_loss, device="cuda", fit=False)
    events = est.step_events
    made = [n for i, (_, n) in enumerate(events.events) if n > 0 and events.phase_at(i) == (2, "backward")]
    return len(made), sum(made)


@pytest.mark.parametrize(
    "build",
    [
        functools.partial(Branches, width=3, dim=DIM),  # two sums of pieces only the engine holds
        functools.partial(Branches, width=2, residual=True, dim=DIM),  # one shared piece: a new tensor
    ],
    ids=["branches", "residual"],
)
def test_the_estimate_s_backward_allocates_what_the_device_s_does(build):
    x = torch.randn(BATCH, DIM)
    real = _real_second_backward(build, x)
    estimated = _estimated_second_backward(build, x)
    assert estimated == real
