"""On a CUDA GPU: a branch backward never reaches is freed with the profiler watching, as without it
(``tests/test_unreached_branches.py`` says why it was not). The truth: the allocator's own count of
bytes allocated after each iteration, with and without the profiler, and the estimate's peak."""

from __future__ import annotations

import io

import pytest
import torch

from pytorch_mem_profiler import MemoryProfiler

from .test_unreached_branches import WithUnusedHead

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def _after_each(settings: dict | None, iterations: int = 4) -> list[int]:
    torch.manual_seed(0)
    model, x = WithUnusedHead(dim=256).to(DEV), torch.randn(32, 64, 256, device=DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    profiler = MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt, **settings) if settings is not None else None
    allocated = []
    try:
        for _ in range(iterations):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if profiler is not None:
                profiler.record_stats()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated(DEV))
    finally:
        if profiler is not None:
            profiler.close()
        del model, x, opt
    return allocated


@pytest.mark.parametrize("settings", [{"overhead": None}, {"by_layer": True, "overhead": None}])
def test_the_allocator_holds_what_it_holds_without_the_profiler(settings):
    unwatched = _after_each(None)
    watched = _after_each(settings)
    assert len(set(unwatched)) == 1
    assert watched == unwatched
