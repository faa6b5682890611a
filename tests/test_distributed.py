"""The profiler under torch.distributed, on the CPU with gloo.

One real two-process ``torchrun`` (``tests/distributed_worker.py``) trains DDP,
DDP with ``gradient_as_bucket_view``, FSDP2 and a two-stage pipeline; the
tests read what each rank wrote. In-process tests cover the pure parts and a
one-rank process group.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.data_parallel import FsdpGatherTracker, ddp_gradient_bucket_bytes
from pytorch_mem_profiler.distributed import (
    CATEGORIES,
    CrossRankSummary,
    RankInfo,
    RankSummary,
    decode_summary,
    encode_summary,
    parse_print_ranks,
    rank_info,
)
from pytorch_mem_profiler.outputs.rank_table import format_cross_rank
from pytorch_mem_profiler.measure.devices import rank_device
from pytorch_mem_profiler.torch_versions import FSDP2_ON_CPU
from .torchrun_helper import run_worker

pytestmark = pytest.mark.distributed

EPOCHS, ITERATIONS, PRINT_PERIOD = 2, 4, 2
SCENARIOS = ("ddp", "ddp_view", "fsdp", "pipeline")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun")
    proc = run_worker(out, "gloo", ",".join(SCENARIOS), timeout_s=120)
    ranks = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())
    return proc, out, ranks


@pytest.fixture(scope="module")
def ranks(launched):
    proc, _, ranks = launched
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(ranks) == [0, 1], proc.stderr[-4000:]
    return ranks


def scenario(ranks, name, r):
    result = ranks[r][name]
    assert "error" not in result, result.get("error")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


# -- the real two-process run ----------------------------------------------------------
def test_torchrun_exits_cleanly_with_every_scenario(launched, ranks):
    proc = launched[0]
    assert proc.returncode == 0
    for r in (0, 1):
        for name in SCENARIOS:
            result = scenario(ranks, name, r)
            assert len(result["records"]) == EPOCHS * ITERATIONS
            assert {rec["rank"] for rec in result["records"]} == {r}


def ran(ranks, r) -> list[str]:
    """The scenarios rank ``r`` ran (FSDP2 on the CPU is skipped before torch 2.6)."""
    return [name for name in SCENARIOS if "skipped" not in ranks[r][name]]


def test_no_collective_in_record_stats_and_one_all_gather_per_epoch_end(ranks):
    for r in (0, 1):
        calls = ranks[r]["collectives"]
        assert calls["record_stats"] == []
        assert calls["epoch_end"] == ["all_gather"] * (EPOCHS * len(ran(ranks, r)))


def test_each_rank_writes_its_own_csv_named_by_rank_and_host(launched, ranks):
    out = launched[1]
    host = re.escape(re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64])
    assert ran(ranks, 0) == ran(ranks, 1)
    for name in ran(ranks, 0):
        files = sorted(p.name for p in (out / name).glob("*.csv"))
        assert len(files) == 2, files
        for r, file in enumerate(files):
            assert re.fullmatch(rf"memory_stats_\d{{8}}-\d{{6}}(-\d+)?_rank{r}_{host}\.csv", file), file
            assert Path(scenario(ranks, name, r)["csv"]).name == file
            frame = pd.read_csv(out / name / file)
            assert len(frame) == EPOCHS * ITERATIONS // PRINT_PERIOD
            assert set(frame["rank"]) == {r}
            expected = scenario(ranks, name, r)["weights_expected"]
            assert set(frame["total_weight_usage"]) == {expected}  # units="B": bytes


def test_ddp_weights_gradients_and_buckets_match_the_real_tensors(ranks):
    for r in (0, 1):
        result = scenario(ranks, "ddp", r)
        assert result["buckets_seen_count"] > 1  # several buckets, as bucket_cap_mb asked
        assert result["buckets_seen"] == result["buckets_logged"] > 0
        for rec, grads in zip(result["records"], result["grads_after_backward"]):
            assert rec["weights"] == result["weights_expected"]
            # Gradients are measured on reported iterations; the others leave them None.
            assert rec["gradients"] == (grads if rec["reported"] else None)
            assert grads == result["weights_expected"]
            # The buckets DDP really reduced in, seen by a comm hook.
            assert rec["ddp_gradient_buckets"] == result["buckets_seen"]
        frame = pd.read_csv(result["csv"])
        assert set(frame["ddp_gradient_buckets"]) == {result["buckets_seen"]}
    assert f"DDP gradient buckets{'.' * 3}" in scenario(ranks, "ddp", 0)["text"]


def test_ddp_gradient_as_bucket_view_counts_the_buckets_as_gradients(ranks):
    for r in (0, 1):
        result = scenario(ranks, "ddp_view", r)
        for rec in result["records"]:
            assert rec["ddp_gradient_buckets"] == 0
            assert rec["gradients"] == (result["buckets_seen"] if rec["reported"] else None)


def test_cross_rank_table_on_rank_0_only_with_every_ranks_peaks(ranks):
    text0 = scenario(ranks, "ddp", 0)["text"]
    assert scenario(ranks, "ddp", 1)["text"] == ""  # print_ranks=0: rank 1 is silent
    for epoch in range(1, EPOCHS + 1):
        assert text0.count(f"Memory across 2 ranks, Epoch {epoch}\n") == 1
    peaks = {r: scenario(ranks, "ddp", r)["records"][-1]["peak_allocated"] for r in (0, 1)}
    table = text0[text0.rindex("Memory across 2 ranks") :]
    for r in (0, 1):
        assert re.search(rf"^\s+{r}\s.*\s{peaks[r]} B\s+{peaks[r]} B\s", table, re.M), table
    assert f" max {max(peaks.values())} B" in " ".join(table.split())
    assert f" min {min(peaks.values())} B" in " ".join(table.split())
    # Rank 1 trains on four times the batch: it peaks highest, through its feature maps.
    assert peaks[1] > peaks[0]
    assert "Highest peak: rank 1" in table
    assert "largest category: feature maps" in table
    # Every rank holds the same gathered summary, made of each rank's own records.
    for r in (0, 1):
        summary = scenario(ranks, "ddp", r)["summary"]
        assert summary["epoch"] == EPOCHS and summary["highest"] == 1
        assert [s["peak_allocated"] for s in summary["ranks"]] == [peaks[0], peaks[1]]
        assert [s["rank"] for s in summary["ranks"]] == [0, 1]


def test_print_ranks_all_prefixes_every_line_and_one_table(ranks):
    for r in (0, 1):
        text = scenario(ranks, "ddp_view", r)["text"]
        reports = [line for line in text.splitlines() if "Memory Usage for Iteration" in line]
        assert len(reports) == EPOCHS * ITERATIONS // PRINT_PERIOD
        assert all(line.startswith(f"[rank {r}] ") for line in reports)
        assert f"[rank {r}] Epoch 2 finished" in text
        assert text.count("Memory across 2 ranks") == (EPOCHS if r == 0 else 0)


def test_fsdp2_weights_and_gradients_are_the_local_shards(ranks):
    for r in (0, 1):
        result = scenario(ranks, "fsdp", r)
        assert result["weights_expected"] < result["full_weights"]
        for rec, grads in zip(result["records"], result["grads_after_backward"]):
            assert rec["weights"] == result["weights_expected"]
            assert rec["gradients"] == (grads if rec["reported"] else None)
            assert grads == result["weights_expected"]
            assert rec["ddp_gradient_buckets"] is None
        assert result["records"][-1]["optimizer_state"] == result["optimizer_expected"]


def test_fsdp2_gathered_parameters_are_the_root_and_one_block(ranks):
    for r in (0, 1):
        result = scenario(ranks, "fsdp", r)
        gathered = {rec["fsdp_gathered_parameters"] for rec in result["records"] if rec["reported"]}
        assert gathered == {result["gathered_expected"]}
        # each sample looks at every unit: the iterations that are not reported skip it
        assert {rec["fsdp_gathered_parameters"] for rec in result["records"] if not rec["reported"]} == {None}
        assert "FSDP gathered parameters" in result["text"] or r == 1


def test_pipeline_stages_report_their_own_parameters(ranks):
    weights = {r: scenario(ranks, "pipeline", r)["weights_expected"] for r in (0, 1)}
    assert weights[0] != weights[1]
    for r in (0, 1):
        result = scenario(ranks, "pipeline", r)
        for rec, grads in zip(result["records"], result["grads_after_backward"]):
            assert rec["weights"] == weights[r]
            assert rec["gradients"] == (grads if rec["reported"] else None)
            assert grads == weights[r]
        assert len(result["summary"]["ranks"]) == 2


# -- in one process ---------------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank, torn down after the test."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_single_process_keeps_plain_names_and_no_rank(csv_dir, stream):
    model = torch.nn.Linear(8, 4)
    assert rank_info() is None
    with MemoryProfiler(model, 1, True, csv_dir=csv_dir, stream=stream, strict=True) as profiler:
        model(torch.randn(2, 8)).sum().backward()
        rec = profiler.record_stats()
        profiler.epoch_end()
    assert rec.rank is None and rec.ddp_gradient_buckets is None
    assert rec.fsdp_gathered_parameters is None
    assert re.fullmatch(r"memory_stats_\d{8}-\d{6}(-\d+)?\.csv", profiler.csv_path.name)
    assert profiler.cross_rank_summary is None
    assert "DDP" not in stream.getvalue() and "Memory across" not in stream.getvalue()


def test_one_rank_group_ddp_profile(one_rank_group, csv_dir, stream):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    frozen = torch.nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model.append(frozen)
    ddp = DDP(model)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert ddp_gradient_bucket_bytes(ddp) == trainable
    assert ddp_gradient_bucket_bytes(model) is None  # the inner module holds no DDP
    with MemoryProfiler(ddp, 1, True, csv_dir=csv_dir, stream=stream, strict=True) as profiler:
        ddp(torch.randn(4, 16)).sum().backward()
        rec = profiler.record_stats()
        profiler.epoch_end()
    assert rec.rank == 0 and rec.ddp_gradient_buckets == trainable
    assert profiler.csv_path.name.endswith(f"{profiler.file_tag}.csv")
    assert profiler.file_tag.startswith("_rank0_")
    summary = profiler.cross_rank_summary
    assert summary is not None and summary.epoch == 1 and len(summary.ranks) == 1
    assert summary.ranks[0].peak_allocated == rec.peak_allocated
    assert summary.ranks[0].device == "cpu"
    assert "Memory across 1 rank, Epoch 1" in stream.getvalue()


def test_one_rank_group_print_ranks_elsewhere_prints_nothing(one_rank_group, stream):
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"print_ranks=\[1\] names rank\(s\) \[1\] beyond the world size"):
        profiler = MemoryProfiler(model, 1, stream=stream, print_ranks=[1], strict=True)
    with profiler:
        model(torch.randn(2, 4)).sum().backward()
        profiler.record_stats()
        profiler.epoch_end()
    assert stream.getvalue() == ""
    assert profiler.cross_rank_summary is not None  # gathered all the same


def test_epoch_end_after_the_group_is_gone_does_not_fail(stream):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model = torch.nn.Linear(4, 4)
    profiler = MemoryProfiler(model, 1, stream=stream, strict=True)
    model(torch.randn(2, 4)).sum().backward()
    profiler.record_stats()  # an iteration: an epoch_end() with none would count no epoch
    dist.destroy_process_group()
    profiler.epoch_end()
    profiler.close()
    assert profiler.cross_rank_summary is None
    assert "Epoch 1 finished" in stream.getvalue()


def test_print_ranks_is_checked_at_construction():
    model = torch.nn.Linear(2, 2)
    for bad in ("some", -1, True, [0, "1"], 1.5, "0,x"):
        with pytest.raises(ValueError, match="print_ranks"):
            MemoryProfiler(model, print_ranks=bad)


def test_parse_print_ranks():
    assert parse_print_ranks(0) == frozenset({0})
    assert parse_print_ranks([0, 3]) == frozenset({0, 3})
    assert parse_print_ranks(" 1, 2 ") == frozenset({1, 2})
    assert parse_print_ranks("ALL") is None
    assert parse_print_ranks([]) == frozenset()


def test_rank_device_prefers_the_models_device_then_an_accelerator_backend():
    info = RankInfo(rank=1, world_size=2, local_rank=1, host="h", backends={"cpu": "gloo"})
    assert rank_device(torch.nn.Linear(2, 2), info) == torch.device("cpu")
    nccl = RankInfo(rank=1, world_size=2, local_rank=1, host="h", backends={"cuda": "nccl"})
    if torch.cuda.is_available():
        expected = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else torch.cuda.current_device())
    else:
        expected = torch.device("cpu")  # no CUDA here: the model's device
    assert rank_device(torch.nn.Linear(2, 2), nccl) == expected


def test_summary_survives_the_wire_format():
    summary = RankSummary(
        rank=5,
        host="x" * 300,  # longer than the label: cut, never spilling into other fields
        device="cuda:3",
        peak_cached=None,
        peak_allocated=2**40 + 7,
        categories={"weights": 3, "FSDP gathered parameters": 2**33},
    )
    values = encode_summary(summary)
    back = decode_summary(values)
    assert back is not None
    assert back.rank == 5 and back.peak_cached is None and back.peak_allocated == 2**40 + 7
    assert dict(back.categories) == {"weights": 3, "FSDP gathered parameters": 2**33}
    assert back.device == "cuda:3" and back.host == "x" * (128 - len("cuda:3\n"))
    assert decode_summary([0] * len(values)) is None  # a rank that had nothing to say
    assert len({label for label, _ in CATEGORIES}) == len(CATEGORIES)


def test_cross_rank_table_figures():
    ranks = (
        RankSummary(0, "a", "cuda:0", 4_000_000, 3_000_000, {"weights": 1_000_000}),
        RankSummary(1, "a", "cuda:1", 10_000_000, 1_000_000, {"feature maps": 6_000_000, "weights": 1_000_000}),
        RankSummary(2, "b", "cuda:0", None, None, {}),
    )
    summary = CrossRankSummary(epoch=3, ranks=ranks)
    assert summary.stat("peak_cached") == (4_000_000, 10_000_000, 7_000_000.0)
    assert summary.stat("peak_allocated") == (1_000_000, 3_000_000, 2_000_000.0)
    # The highest peak is the cached one: rank 1, though rank 0 allocated more.
    assert summary.highest.rank == 1
    text = format_cross_rank(summary, "MB")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "Memory across 3 ranks, Epoch 3" in lines
    assert "1 a cuda:1 10 MB 1 MB feature maps 6 MB" in lines
    assert "2 b cuda:0 n/a n/a n/a" in lines
    assert "min 4 MB 1 MB" in lines and "max 10 MB 3 MB" in lines and "mean 7 MB 2 MB" in lines
    assert (
        "Highest peak: rank 1 (a, cuda:1), 10 MB cached, 1 MB allocated; "
        "largest category: feature maps, 6 MB"
    ) in lines


def test_fsdp_tracker_needs_fsdp_units():
    assert FsdpGatherTracker.attach(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None




def _sample_hooks(model: torch.nn.Module) -> int:
    """How many of the tracker's pre-hooks the model's modules carry."""
    return sum(
        type(hook).__name__ == "_SampleHook"
        for module in model.modules()
        for hook in module._forward_pre_hooks.values()
    )


def fsdp_sampling_with_a_fault(device: torch.device, monkeypatch, stream) -> None:
    """FSDP2 on one rank (a process group of one is up): the gathered parameters on reported
    iterations, ``None`` on the others; a fault in the sampling takes its hooks off the units as
    that iteration ends, and training is measured on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    mesh = init_device_mesh(device.type, (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fail = {"on": False}
    sample = FsdpGatherTracker._sample

    def faulty_sample(self):
        if fail["on"]:
            raise RuntimeError("injected fault in the gathered-parameter sampling")
        return sample(self)

    monkeypatch.setattr(FsdpGatherTracker, "_sample", faulty_sample)
    records, hooks_seen = [], []
    with MemoryProfiler(model, 2, stream=stream) as profiler:
        for i in range(6):
            fail["on"] = i == 3  # a reported iteration (the 4th)
            model(torch.randn(4, 8, device=device)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(profiler.record_stats())
            hooks_seen.append(_sample_hooks(model))
    assert [r.reported for r in records] == [False, True] * 3
    # One rank: a unit's gathered parameters are whole; the root holds none, and a unit
    # reshards after its forward, so the most alive at once is the largest unit.
    largest = max(sum(p.numel() * p.element_size() for p in model[i].parameters()) for i in (0, 2))
    assert [r.fsdp_gathered_parameters for r in records] == [None, largest] + [None] * 4
    assert hooks_seen[:3] == [3] * 3  # the three units'
    assert hooks_seen[3:] == [0] * 3  # off by the faulted iteration's record_stats(), not left to return at once
    assert all(r.weights == records[0].weights for r in records)  # training measured on


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 on the CPU needs torch >= 2.6")
def test_fsdp_tracking_switched_off_by_a_fault_takes_its_hooks_off(one_rank_group, stream, monkeypatch):
    fsdp_sampling_with_a_fault(torch.device("cpu"), monkeypatch, stream)
