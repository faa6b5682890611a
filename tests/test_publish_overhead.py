"""The generator of the README's and docs' overhead blocks, on sample CSV files shaped like a run's."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import publish_overhead  # noqa: E402

HEADERS = [
    "workload", "tool", "status", "ratio", "step_ms_without", "step_ms_with", "rounds", "steps_without",
    "steps_with", "tool_stop_s", "goal", "ratios", "note", "device", "torch",
]  # fmt: skip
DEVICE = "Device: NVIDIA H200; torch 2.11.0+cu130; 2026-11-22"


def _row(workload, tool, ratio, goal="", status="ok"):
    ratios = f"{ratio - 0.01:.4f} {ratio:.4f} {ratio + 0.02:.4f}" if ratio is not None else ""
    return [workload, tool, status, ratio if ratio is not None else "", 2.3, 2.4, 3, 100, 100, 0.0, goal, ratios, "", DEVICE, "2.11"]


@pytest.fixture
def run(tmp_path):
    rows = [
        _row("gpt2", "profiler, print_period=1", 1.0012, 1.0),
        _row("tiny_mlp", "profiler, print_period=1", 1.0412, 1.05),
        _row("tiny_mlp", "profiler, print_period=10", 1.0251, 1.02),
        _row("tiny_mlp", "profiler by_layer, print_period=1", 1.0871, 1.1),
        _row("tiny_mlp", "MemTracker", None, status="unavailable: needs torch.distributed"),
    ]
    path = tmp_path / "overhead.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADERS)
        writer.writerows(rows)
    # The run's device-memory file: its "Mode" names the same configurations, its cells are bytes.
    memory = tmp_path / "overhead_device_memory.csv"
    with open(memory, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Workload", "Mode", "Peak allocated", "Bytes allocated in the step"])
        writer.writerow(["tiny_mlp", "profiler by_layer, print_period=1", 1048576, 1048576])
    return path, memory


def test_every_cell_is_the_ratio_of_its_tool_and_workload(run):
    rows = publish_overhead.read_rows(run[0])
    lines = publish_overhead.readme_table(rows).splitlines()
    assert lines[0] == "| Tool | GPT-2 | tiny MLP |"
    assert lines[2] == "| this profiler, `print_period=1` | 1.001x | 1.041x |"
    assert lines[3] == "| this profiler, `print_period=10` |  | 1.025x |"
    assert lines[4] == "| this profiler, `by_layer=True`, `print_period=1` |  | 1.087x |"
    assert lines[5] == "| `MemTracker` (one step) |  | n/a |"
    assert len(lines) == 6
    # 1.0251 rounds to 1.03 > 1.02: missed; the others met.
    assert publish_overhead.goals_line(rows) == (
        "Goals: 3 of 4 met; missed: tiny MLP profiler, print_period=10 1.025x > 1.02x."
    )
    docs = publish_overhead.docs_block(rows)
    assert "| tiny_mlp | 1.041x (1.031-1.061), goal 1.05x: met | 1.025x (1.015-1.045), goal 1.02x: **missed** |" in docs
    assert "1048576" not in docs


def test_the_device_memory_file_is_refused(run):
    with pytest.raises(ValueError, match="is not overhead.py's overhead.csv"):
        publish_overhead.read_rows(run[1])


def test_publish_rewrites_only_the_blocks(run, tmp_path):
    readme = tmp_path / "README.md"
    docs = tmp_path / "benchmarks.md"
    readme.write_text("# x\n<!-- results: headline figures -->\nold | 0 | 1048576\n<!-- /results -->\nafter\n")
    docs.write_text("before\n<!-- overhead results -->\nold\n<!-- /overhead results -->\n<!-- results: other -->\nkept\n<!-- /results -->\n")
    publish_overhead.publish(run[0], readme, docs)
    text = readme.read_text()
    assert text.startswith("# x\n<!-- results: headline figures -->\nMeasured on NVIDIA H200; torch 2.11.0+cu130; 2026-11-22")
    assert text.endswith("<!-- /results -->\nafter\n") and "1048576" not in text and "| 0 |" not in text
    page = docs.read_text()
    assert page.startswith("before\n<!-- overhead results -->\nNVIDIA H200") and "old" not in page
    assert page.endswith("<!-- results: other -->\nkept\n<!-- /results -->\n")
