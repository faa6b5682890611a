"""CSV files: the original's columns, values in the report's unit, and no row lost."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.outputs.export import new_run_path

from .helpers import mlp, nbytes, train_step

ROOT = Path(__file__).resolve().parents[1]

ORIGINAL_COLUMNS = [
    "epoch",
    "iteration",
    "peak_cached",
    "current_cached",
    "total_feature_map_usage",
    "total_weight_usage",
    "0.weight",
    "0.bias",
    "2.weight",
    "2.bias",
    "total_layer_weight_gradient_usage",
    "0.weight_grad",
    "0.bias_grad",
    "2.weight_grad",
    "2.bias_grad",
    "intermediate_gradients",
]


def test_round_trip_through_pandas(csv_dir):
    model = mlp(32, 64, 10)
    opt = torch.optim.Adam(model.parameters())
    records = []
    with MemoryProfiler(model, 2, True, csv_dir=csv_dir, stream=io.StringIO(), strict=True) as profiler:
        for _epoch in range(2):
            for _ in range(4):
                train_step(model, opt, torch.randn(16, 32))
                records.append(profiler.record_stats())
            profiler.epoch_end()
    frame = pd.read_csv(profiler.csv_path)
    assert list(frame.columns[: len(ORIGINAL_COLUMNS)]) == ORIGINAL_COLUMNS
    assert {"allocated", "peak_allocated", "optimizer_state", "buffers", "iteration_time_s"} <= set(frame.columns)
    assert list(zip(frame.epoch, frame.iteration)) == [(1, 2), (1, 4), (2, 2), (2, 4)]
    reported = [r for r in records if r.iteration % 2 == 0]
    mb = 1e6
    for i, rec in enumerate(reported):
        assert frame.loc[i, "total_weight_usage"] == pytest.approx(rec.weights / mb)
        assert frame.loc[i, "0.weight"] == pytest.approx(nbytes(model[0].weight) / mb)
        assert frame.loc[i, "2.bias_grad"] == pytest.approx(nbytes(model[2].bias) / mb)
        assert frame.loc[i, "total_feature_map_usage"] == pytest.approx(16 * (64 + 10) * 4 / mb)
        assert frame.loc[i, "optimizer_state"] == pytest.approx(rec.optimizer_state / mb)
        assert frame.loc[i, "allocated"] == pytest.approx(rec.allocated / mb)
    assert set(frame.unit) == {"MB"}


def test_units_apply_to_the_csv(csv_dir):
    model = torch.nn.Linear(256, 1024, bias=False)  # 1 MiB
    with MemoryProfiler(model, 1, True, csv_dir=csv_dir, units="MiB", stream=io.StringIO()) as profiler:
        model(torch.randn(2, 256))
        profiler.record_stats()
    frame = pd.read_csv(profiler.csv_path)
    assert frame.loc[0, "total_weight_usage"] == 1.0 and frame.loc[0, "unit"] == "MiB"


def test_every_run_gets_its_own_file(tmp_path):
    paths = {new_run_path(tmp_path, "memory_stats") for _ in range(5)}
    assert len(paths) == 5 and all(p.exists() for p in paths)


def test_folder_is_created(tmp_path):
    target = tmp_path / "deep" / "er"
    with MemoryProfiler(torch.nn.Linear(2, 2), 1, True, csv_dir=target, stream=io.StringIO()) as profiler:
        pass
    assert profiler.csv_path.parent == target and target.is_dir()


_CRASHING_LOOP = """
import sys, torch
sys.path.insert(0, {root!r})
from pytorch_mem_profiler import memory_profiler
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
profiler = memory_profiler(model, 1, True, csv_dir={csv_dir!r})
print(profiler.csv_path, flush=True)
for i in range(100):
    model(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    profiler.record_stats()
    if i == 6:
        raise {exc}("training failed at iteration 7")
"""


@pytest.mark.parametrize("exc, code", [("RuntimeError", 1), ("KeyboardInterrupt", None)])
def test_rows_reach_disk_when_training_raises(tmp_path, exc, code):
    """No epoch_end(), no close(), no context manager: the rows are still written at exit."""
    script = tmp_path / "loop.py"
    script.write_text(_CRASHING_LOOP.format(root=str(ROOT), csv_dir=str(tmp_path / "csv"), exc=exc))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    assert "training failed at iteration 7" in proc.stderr
    csv_path = proc.stdout.strip().splitlines()[0]
    frame = pd.read_csv(csv_path)
    assert list(frame.iteration) == [1, 2, 3, 4, 5, 6, 7]
    assert frame.loc[0, "total_weight_usage"] == pytest.approx((64 + 8) * 4 / 1e6)


def test_rows_reach_disk_when_the_with_block_raises(csv_dir):
    model = mlp()
    with pytest.raises(RuntimeError, match="boom"):
        with MemoryProfiler(model, 1, True, csv_dir=csv_dir, stream=io.StringIO()) as profiler:
            for i in range(3):
                train_step(model, None, torch.randn(2, 32))
                profiler.record_stats()
            raise RuntimeError("boom")
    assert len(pd.read_csv(profiler.csv_path)) == 3


def test_the_file_is_a_valid_csv_before_any_row(csv_dir):
    profiler = MemoryProfiler(mlp(), 1, True, csv_dir=csv_dir, stream=io.StringIO())
    try:
        frame = pd.read_csv(profiler.csv_path)
        assert len(frame) == 0 and list(frame.columns[:2]) == ["epoch", "iteration"]
    finally:
        profiler.close()
    assert os.path.getsize(profiler.csv_path) > 0
