"""The benchmark scripts run on a CPU with tiny sizes, and the accuracy script's exact figures are exact."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import accuracy  # noqa: E402
import overhead  # noqa: E402
from workloads import QUICK, WorkloadUnavailable, build, median  # noqa: E402

from pytorch_mem_profiler.measure.saved_tensors import can_chain  # noqa: E402

CPU_QUICK = ["--device", "cpu", "--quick"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny steps on a small shared machine time more steadily on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_mlp_bytes() -> tuple[int, int]:
    """Parameter bytes and parameter count of the quick tiny MLP, from its sizes."""
    width, depth = QUICK["tiny_mlp"]["width"], QUICK["tiny_mlp"]["depth"]
    return depth * (width * width + width) * 4, 2 * depth


def test_accuracy_weights_gradients_optimizer_state_are_exact_on_cpu(tmp_path):
    results = accuracy.main([*CPU_QUICK, "--workloads", "tiny_mlp", "--out", str(tmp_path)])
    by_figure = {c.figure: c for c in results if c.workload == "tiny_mlp"}
    weights, n_params = _tiny_mlp_bytes()
    # Adam keeps two moments per parameter, and a float32 step counter each on the CPU.
    expected = {"weights": weights, "gradients": weights, "optimizer state": 2 * weights + 4 * n_params}
    for figure, nbytes in expected.items():
        c = by_figure[figure]
        assert c.independent == nbytes, figure
        assert c.profiler == nbytes, figure
        assert c.error == 0 and c.error_pct == 0.0, figure
    # ReLU saves its output and each Linear its input: 8 outputs of (16, 128) float32, the first
    # Linear's input being the batch, left out.
    saved = by_figure["feature maps by layer"]
    batch, width = QUICK["tiny_mlp"]["batch"], QUICK["tiny_mlp"]["width"]
    assert saved.independent == 8 * batch * width * 4
    if can_chain():
        assert saved.error == 0
    else:  # torch < 2.8 cannot watch saved tensors: the profiler measures no feature maps by layer
        assert saved.profiler is None and saved.error is None
        assert saved.status.startswith(f"n/a on torch {torch.__version__}")
    assert by_figure["iteration peak"].status.startswith("n/a on CPU")

    rows = list(csv.DictReader(open(tmp_path / "accuracy.csv")))
    errors = {r["figure"]: r["error_bytes"] for r in rows}
    assert errors["weights"] == errors["gradients"] == errors["optimizer state"] == "0"
    assert "| tiny_mlp | weights |" in (tmp_path / "accuracy.md").read_text()


def test_accuracy_skips_a_workload_it_cannot_build(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails as where torchvision is missing
    with pytest.raises(WorkloadUnavailable, match="torchvision"):
        build("resnet50", torch.device("cpu"), quick=True)
    results = accuracy.main([*CPU_QUICK, "--workloads", "resnet50", "tiny_mlp", "--out", str(tmp_path)])
    assert [c.status for c in results if c.workload == "resnet50"] == [
        "unavailable: resnet50 needs torchvision (import of torchvision halted; None in sys.modules)"
    ]
    assert {c.figure for c in results if c.workload == "tiny_mlp" and c.status == "ok"} >= {"weights", "gradients"}


def _has_mem_tracker() -> bool:
    """Whether this torch has MemTracker (torch.distributed._tools.mem_tracker, torch 2.5 and later)."""
    if not torch.distributed.is_available():
        return False
    try:
        return importlib.util.find_spec("torch.distributed._tools.mem_tracker") is not None
    except ModuleNotFoundError:  # a parent package is missing too
        return False


def test_overhead_runs_every_tool_or_says_why_not(tmp_path):
    args = [*CPU_QUICK, "--workloads", "tiny_mlp", "--rounds", "3", "--peer-rounds", "3", "--records", "40"]
    rows = overhead.main([*args, "--round-seconds", "0.02", "--warmup", "1", "--out", str(tmp_path)])
    by_tool = {r.tool: r for r in rows}
    assert set(by_tool) == set(overhead.make_tools(100_000))
    measured = ["profiler, print_period=1", "profiler by_layer, print_period=10"]
    if _has_mem_tracker():
        measured.append("MemTracker")
    else:  # torch < 2.5 has no MemTracker: that tool alone says why
        prefix = f"unavailable: torch {torch.__version__} has no torch.distributed._tools.mem_tracker ("
        assert by_tool["MemTracker"].status.startswith(prefix), by_tool["MemTracker"].status
    for name in measured:
        row = by_tool[name]
        assert row.status == "ok", row.status
        assert len(row.ratios) == 3
        assert row.ratio == median(row.ratios) > 0
        assert row.base_ms > 0 and row.tool_ms > 0
    if _has_mem_tracker():
        assert by_tool["MemTracker"].base_steps == by_tool["MemTracker"].tool_steps == 1
    assert by_tool["profiler, print_period=1"].goal == overhead.GOAL_TINY
    assert by_tool["profiler by_layer, print_period=10"].goal == overhead.GOAL_BY_LAYER
    # per-layer mode at print_period=1 has no fixed goal: it is to cost less than torch.profiler
    assert by_tool["profiler by_layer, print_period=1"].goal is None
    assert "levels: full 100%" in by_tool["profiler by_layer, print_period=1"].note
    for stacks in ("python", "all"):
        assert by_tool[f'_record_memory_history, stacks="{stacks}"'].status == "unavailable: needs a CUDA device"
    memlab = by_tool["MemReporter(model).report() each step"]
    assert memlab.status == "ok" or memlab.status.startswith("unavailable: pytorch_memlab is not installed")

    table = list(csv.DictReader(open(tmp_path / "overhead.csv")))
    assert len(table) == len(rows)
    host = list(csv.DictReader(open(tmp_path / "overhead_host_memory.csv")))
    assert [int(r["Records kept"]) for r in host] == [40, 40]
    assert all(int(r["Bytes held"]) > 0 for r in host)
    assert "Host memory of the profiler's records" in (tmp_path / "overhead.md").read_text()


def test_the_budgets_start_runs_before_the_timed_steps_and_shows_apart(monkeypatch, tmp_path):
    # A fresh profiler with a budget spends its first reported iterations measuring its levels (the
    # richest, then "light" for the base, then one try of each detailed level): once a run. The
    # rounds run them before timing, keep their records out of the levels, and note their cost.
    assert overhead.profiler_tool(1).start_steps == 3
    assert overhead.profiler_tool(10).start_steps == 30
    assert overhead.profiler_tool(1, by_layer=True).start_steps == 2  # overhead=None: no start to measure
    tool = overhead.profiler_tool(1)
    tools = {"profiler, print_period=1": tool}
    seen = [0]
    counted_seconds: list[float] = []
    level_note = tool.level_note

    def counted() -> str:
        seen[0] = sum(tool.levels.values())
        counted_seconds[:] = tool.budget_seconds
        return level_note()

    tool.level_note = counted
    whole = [0.0, 0.0]  # every profiler's own account over its whole life, the start included

    class Profiler(overhead.MemoryProfiler):
        def close(self) -> None:
            super().close()
            whole[0] += self._budget.spent
            whole[1] += self._budget.allowed

    monkeypatch.setattr(overhead, "MemoryProfiler", Profiler)
    monkeypatch.setattr(overhead, "make_tools", lambda max_entries: tools)
    rows = overhead.main(
        [*CPU_QUICK, "--workloads", "tiny_mlp", "--rounds", "3", "--records", "5", "--round-seconds", "0.01",
         "--warmup", "1", "--out", str(tmp_path)]
    )
    row = rows[0]
    assert row.status == "ok"
    assert "its start, once a run, untimed (3 of its 3 steps): +" in row.note
    # each round's records: the start's three, then the timed steps'; only the timed ones are counted
    assert seen[0] == 3 * row.tool_steps + 2  # + the first round's two sizing steps
    # the budget's own count is of the timed steps: the start's spending and earning left out
    assert 0 < counted_seconds[1] < whole[1] and counted_seconds[0] <= whole[0]
    # the row's counts are its own: the next workload starts from nothing
    assert not tool.levels and tool.budget_seconds == [0.0, 0.0] and not tool.start_seconds


def test_overhead_goes_on_after_a_failing_tool(monkeypatch, tmp_path):
    def broken(work, device):
        raise RuntimeError("tool exploded")

    tools = {
        "broken": overhead.Tool("broken", broken),
        "profiler, print_period=1": overhead.profiler_tool(1),
    }
    monkeypatch.setattr(overhead, "make_tools", lambda max_entries: tools)
    rows = overhead.main(
        [*CPU_QUICK, "--workloads", "tiny_mlp", "--rounds", "3", "--records", "5", "--round-seconds", "0.01", "--warmup", "1"]
    )
    assert rows[0].status == "unavailable: RuntimeError: tool exploded"
    assert rows[1].status == "ok" and rows[1].ratio > 0


def test_host_memory_of_records_grows_with_the_records_kept():
    held_few, _, kept_few, _ = overhead.host_memory_of_records(torch.device("cpu"), 20, by_layer=False)
    held_many, _, kept_many, per_record = overhead.host_memory_of_records(torch.device("cpu"), 220, by_layer=False)
    assert (kept_few, kept_many) == (20, 220)
    between_runs = (held_many - held_few) / 200
    # A record is a frozen dataclass of ints sharing its by-name maps: well under 10 kB.
    assert 0 < between_runs < 10_000
    # The figure the table gives is that growth within one run, not the held bytes spread over the
    # records, which carry what the first iterations allocate once.
    assert 0 < per_record < 10_000
    assert per_record < held_many / kept_many
    assert abs(per_record - between_runs) < 0.5 * between_runs
