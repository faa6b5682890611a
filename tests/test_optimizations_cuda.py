"""examples/optimizations.py on a GPU: checkpointing and mixed precision cut the peak by > 30%,
and the command line reads the CUDA runs' files."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from .profiled_run import load_example, png_size, run_cli

pytestmark = pytest.mark.cuda


def test_peak_reductions_on_gpu(tmp_path):
    example = load_example("optimizations")
    args = example.parse_args(
        ["--device", "cuda", "--iterations", "4", "--epochs", "2", "--csv-dir", str(tmp_path)]
    )
    rows = example.measure(args)
    print()
    print(example.format_markdown(rows, "MB"))
    baseline, checkpointing, amp, both = (row.peak_allocated for row in rows)
    for row in rows:
        assert row.device.startswith("cuda")
        assert row.peak_allocated == pytest.approx(
            pd.read_csv(row.path)["peak_allocated"].max() * 1e6
        )
        assert row.time_per_iteration_s > 0
        # the reservation holds at least the peak of what was allocated
        assert row.peak_cached >= row.peak_allocated
    # 8 blocks of width 1024 over 16 x 1024 tokens: activations are most of the peak
    assert checkpointing < 0.7 * baseline
    assert both < 0.7 * baseline
    assert amp < baseline
    assert both < amp

    # the CUDA files through the command line
    result = run_cli(
        "compare", *[row.path for row in rows], "--names", "a", "b", "c", "d", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].startswith("| a | ")
    result = run_cli("plot", rows[0].path, "-o", tmp_path / "baseline.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert png_size(tmp_path / "baseline.png") == (1200, 600)
    result = run_cli("summary", rows[0].path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "on cuda" in result.stdout.splitlines()[0]
    torch.cuda.empty_cache()
