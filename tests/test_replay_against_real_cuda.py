"""The allocator replay's rules against the real CUDA caching allocator, on the GPU.

``benchmarks/replay_against_real.py`` records two real training steps and replays the run's own
requests through :class:`~pytorch_mem_profiler.estimate.allocator.AllocatorReplay` from the run's
segments before the model, with the real segments' addresses: where the rules are the allocator's,
every segment is made (and, under a limit, given back) at the same request, and an out-of-memory
falls on the same one.

    PYTHONPATH=. python3 -m pytest tests/test_replay_against_real_cuda.py -m cuda -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name, batch", [("neumf", 16_384), ("batchnorm_cnn", 8)])
def test_the_replay_makes_and_gives_back_segments_where_the_allocator_does(name, batch):
    import replay_against_real as rar

    from benchmarks.zoo import ZOO

    entry = ZOO[name]
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.mem_get_info(device)[1]
    free = rar.real_run(entry, batch, device, limit_fraction=None, max_entries=1_000_000)
    assert free["oom"] is None
    peak = free["end"]["reserved_bytes.all.peak"]
    runs = [free]
    # under a limit a little below what the run reserved freely: it gives back cached segments
    # (and may run out); the replay must do the same at the same requests
    runs.append(rar.real_run(entry, batch, device, limit_fraction=(peak - (24 << 20)) / total, max_entries=1_000_000))
    for run in runs:
        counts = (run["end"]["allocation.all.allocated"] - run["start"]["allocation.all.allocated"],
                  run["end"]["allocation.all.freed"] - run["start"]["allocation.all.freed"])  # fmt: skip
        trace = rar.parse_real(run["snapshot"], run["base"], device=device.index or 0, counts=counts)
        assert not trace.truncated
        # the trace's own accounting ends where the allocator's statistics do
        assert trace.reserved[-1] == run["end"]["reserved_bytes.all.current"]
        check = rar.rule_check(trace, run["limit"])
        assert check["exact"], (name, run["limit"], check)
        assert check["real_oom"] == (run["oom"] is not None)
    limited = runs[1]
    retries = limited["end"]["num_alloc_retries"] - limited["start"]["num_alloc_retries"]
    assert retries >= 1 or limited["oom"] is not None, "the limit did not make the allocator give back segments"
