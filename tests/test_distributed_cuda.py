"""The profiler under torch.distributed on two GPUs, with NCCL: DDP, FSDP2, a pipeline, the overhead.

Needs two CUDA GPUs (skipped otherwise). Run on a two-GPU machine with
``PYTHONPATH=. python3 -m pytest -m cuda -q tests/test_distributed_cuda.py``.
The processes started here run with ``NCCL_NVLS_ENABLE=0``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from .torchrun_helper import ROOT, run_command, run_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

EPOCHS, ITERATIONS = 2, 4
SCENARIOS = ("ddp", "ddp_view", "fsdp", "pipeline")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun_nccl")
    proc = run_worker(out, "nccl", ",".join(SCENARIOS), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        for name in SCENARIOS:
            assert "error" not in result[r][name], result[r][name]["error"]
    return result


def test_each_rank_profiles_its_own_gpu_and_matches_the_allocator(ranks):
    for r in (0, 1):
        for name in SCENARIOS:
            result = ranks[r][name]
            assert {rec["device"] for rec in result["records"]} == {f"cuda:{r}"}
        for name in ("ddp", "ddp_view"):
            # Read right after record_stats(): the record's figure is the allocator's.
            # (Not under FSDP2, whose temporary collective buffers NCCL's watchdog
            # thread frees whenever it reaps the finished work.)
            result = ranks[r][name]
            assert len(result["allocator_allocated"]) == EPOCHS * ITERATIONS
            assert [rec["allocated"] for rec in result["records"]] == result["allocator_allocated"]


def test_no_collective_in_record_stats(ranks):
    for r in (0, 1):
        calls = ranks[r]["collectives"]
        assert calls["record_stats"] == []
        assert calls["epoch_end"] == ["all_gather"] * (EPOCHS * len(SCENARIOS))


def test_ddp_figures_per_rank(ranks):
    for r in (0, 1):
        result = ranks[r]["ddp"]
        assert result["buckets_seen"] == result["buckets_logged"] > 0
        for rec, grads in zip(result["records"], result["grads_after_backward"]):
            assert rec["weights"] == result["weights_expected"]
            assert rec["gradients"] == (grads if rec["reported"] else None)
            assert grads == result["weights_expected"]
            assert rec["ddp_gradient_buckets"] == result["buckets_seen"]
        frame = pd.read_csv(result["csv"])
        assert set(frame["rank"]) == {r} and set(frame["device"]) == {f"cuda:{r}"}
        assert re.search(rf"_rank{r}_[^/]+\.csv$", result["csv"])
        view = ranks[r]["ddp_view"]
        assert {rec["ddp_gradient_buckets"] for rec in view["records"]} == {0}
        assert view["records"][-1]["gradients"] == view["buckets_seen"]


def test_cross_rank_table_on_rank_0(ranks):
    text0, text1 = ranks[0]["ddp"]["text"], ranks[1]["ddp"]["text"]
    assert text1 == ""
    assert text0.count("Memory across 2 ranks, Epoch") == EPOCHS
    table = text0[text0.rindex("Memory across 2 ranks") :]
    for r in (0, 1):
        last = ranks[r]["ddp"]["records"][-1]
        assert re.search(
            rf"^\s+{r}\s+\S+\s+cuda:{r}\s+{last['peak_cached']} B\s+{last['peak_allocated']} B\s",
            table,
            re.M,
        ), table
    highest = max((0, 1), key=lambda r: (ranks[r]["ddp"]["records"][-1]["peak_cached"], -r))
    assert f"Highest peak: rank {highest} " in table
    assert ranks[0]["ddp"]["summary"]["highest"] == highest


def test_fsdp2_weights_are_the_local_shards(ranks):
    for r in (0, 1):
        result = ranks[r]["fsdp"]
        assert result["weights_expected"] < result["full_weights"]
        for rec, grads in zip(result["records"], result["grads_after_backward"]):
            assert rec["weights"] == result["weights_expected"]
            assert rec["gradients"] == (grads if rec["reported"] else None)
            assert grads == result["weights_expected"]
            # sampled on reported iterations only
            assert rec["fsdp_gathered_parameters"] == (result["gathered_expected"] if rec["reported"] else None)
        assert result["records"][-1]["optimizer_state"] == result["optimizer_expected"]
    assert ranks[0]["fsdp"]["text"].count("Memory across 2 ranks, Epoch") == EPOCHS


def test_pipeline_stages_on_two_gpus(ranks):
    for r in (0, 1):
        result = ranks[r]["pipeline"]
        assert {rec["weights"] for rec in result["records"]} == {result["weights_expected"]}


def test_the_ddp_overhead_benchmark_runs_on_two_gpus(tmp_path):
    # Timing is the benchmark's job (docs/benchmarks.md): a ratio over a few rounds on a
    # shared machine is no test. What can fail here is structure: both halves ran, on
    # two ranks, every round timed. That the profiler adds no collective to an
    # iteration (what would make DDP's cost grow) is counted, not timed, by
    # test_no_collective_in_record_stats above, on NCCL.
    out = tmp_path / "overhead.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "distributed_overhead.py"),
        "--rounds", "3", "--iterations", "20", "--json", str(out),
    ]  # fmt: skip
    proc = run_command(cmd, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(proc.stdout)
    assert result["ddp"]["world_size"] == 2 and result["ddp"]["rounds"] == 3
    for key in ("single_gpu", "ddp"):
        ratios = result[key]["ratios"]
        assert len(ratios) == 3 and all(0 < r < 100 for r in ratios), result
