"""On a GPU: the profiler's figures hold against the allocator, and its hooks allocate no device memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import accuracy  # noqa: E402
import overhead  # noqa: E402
from workloads import build  # noqa: E402

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
EXACT = ("weights", "gradients", "optimizer state", "buffers", "allocated", "feature maps by layer")


@pytest.mark.parametrize("name", ["tiny_mlp", "gpt2"])
def test_figures_match_independent_measurements(name):
    work = build(name, CUDA, quick=name == "gpt2")
    by_figure = {c.figure: c for c in accuracy.compare(work, CUDA, warmup=3)}
    for figure in EXACT:
        c = by_figure[figure]
        assert c.status == "ok" and c.error == 0, (figure, c.profiler, c.independent)
    assert by_figure["weights"].independent > 0 and by_figure["feature maps by layer"].independent > 0
    peak = by_figure["iteration peak"]
    # Allocations repeat exactly from one warmed-up step to the next.
    assert abs(peak.error) <= 0.001 * peak.independent, (peak.profiler, peak.independent, peak.method)
    # The categories and the batch never exceed memory_allocated(); what they leave is rounding to
    # 512-byte blocks and cuBLAS workspaces (one per thread that multiplies: forward's and backward's).
    rest = by_figure["categories + other"]
    assert rest.error <= 0 and -rest.error < 256 * 2**20, (rest.profiler, rest.independent)


def test_profiler_adds_no_device_memory_to_a_step():
    work = build("tiny_mlp", CUDA)
    for _ in range(3):
        work.step()
    rows = overhead.device_memory_rows(work, CUDA)
    assert [r[1] for r in rows] == ["profiler, print_period=1", "profiler by_layer, print_period=1"]
    for _, mode, peak, allocated_bytes, allocations, kept in rows:
        assert (peak, allocated_bytes, allocations, kept) == (0, 0, 0, 0), mode


def test_peak_meter_survives_peak_resets():
    torch.cuda.synchronize()
    with overhead.PeakMeter(CUDA) as meter:
        meter.start()
        base = torch.cuda.memory_allocated()
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=CUDA)
        del block
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() < base + 64 * 2**20
        assert meter.stop() >= base + 64 * 2**20


def test_overhead_smoke_on_the_gpu(tmp_path):
    rows = overhead.main(
        ["--device", "cuda", "--quick", "--workloads", "tiny_mlp", "--rounds", "3", "--records", "50",
         "--round-seconds", "0.05", "--out", str(tmp_path)]  # fmt: skip
    )
    by_tool = {r.tool: r for r in rows}
    for name in (
        "profiler, print_period=1",
        "profiler by_layer, print_period=1",
        "torch.profiler(profile_memory, record_shapes)",
        '_record_memory_history, stacks="python"',
        '_record_memory_history, stacks="all"',
        "MemTracker",
    ):
        assert by_tool[name].status == "ok" and by_tool[name].ratio > 0, (name, by_tool[name].status)
    assert (tmp_path / "overhead_device_memory.csv").read_text().count("\n") == 3
