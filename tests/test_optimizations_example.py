"""examples/optimizations.py on CPU, small: four runs, four CSV files, the comparison table."""

from __future__ import annotations

import pandas as pd
import pytest

from .profiled_run import load_example
from pytorch_mem_profiler.analysis.runs import load_run


def test_four_configurations_compared(tmp_path, capsys):
    example = load_example("optimizations")
    args = example.parse_args(
        [
            "--device",
            "cpu",
            "--width",
            "32",
            "--depth",
            "2",
            "--batch",
            "4",
            "--seq",
            "64",
            "--iterations",
            "2",
            "--epochs",
            "1",
            "--csv-dir",
            str(tmp_path),
            "--units",
            "KB",
        ]
    )
    rows = example.measure(args)
    assert [row.name for row in rows] == [name for name, _, _ in example.CONFIGURATIONS]
    files = sorted(tmp_path.glob("memory_stats_*.csv"))
    assert len(files) == 4
    for row in rows:
        # each peak is its own run's largest peak_allocated
        assert row.peak_allocated == pytest.approx(
            pd.read_csv(row.path)["peak_allocated"].max() * 1000
        )
        assert load_run(row.path).device == "cpu"
    baseline, checkpointing, amp, both = (row.peak_allocated for row in rows)
    # activations dominate this model: each technique must lower the peak
    assert checkpointing < baseline
    assert amp < baseline
    assert both < min(checkpointing, amp)
    out = capsys.readouterr().out
    assert "CPU, torch" in out


def test_main_prints_the_table(tmp_path, capsys):
    example = load_example("optimizations")
    table = example.main(
        [
            "--device",
            "cpu",
            "--width",
            "16",
            "--depth",
            "1",
            "--batch",
            "2",
            "--seq",
            "16",
            "--iterations",
            "1",
            "--epochs",
            "1",
            "--csv-dir",
            str(tmp_path),
        ]
    )
    lines = table.splitlines()
    assert lines[0] == "| Configuration | Peak memory | Time per iteration | vs first |"
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| baseline",
        "| gradient checkpointing",
        "| AMP",
        "| checkpointing + AMP",
    ]
    assert table in capsys.readouterr().out


def test_bad_sizes_are_refused():
    example = load_example("optimizations")
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--width", "0"])
    assert exit_info.value.code == 2
