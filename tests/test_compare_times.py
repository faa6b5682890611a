"""``compare``'s time column: the median over the run's timed iterations with its interquartile range,
"within noise" where two runs' ranges overlap, a signed change only where they do not.

The runs are the profiler's own CSV files, written here by training a tiny model whose step sleeps
a known time; the figures are checked against the files' ``iteration_time_s`` read with pandas.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.compare import (
    MIN_TIMED_ITERATIONS,
    NOISE_FLOOR,
    comparison_frame,
    compare_runs,
    format_markdown,
)
from pytorch_mem_profiler.analysis.runs import load_run
from pytorch_mem_profiler.analysis.summary import format_seconds

from .profiled_run import TinyNet, run_cli

ITERATIONS = 30


def _profiled(folder: Path):
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = memory_profiler(model, 1, True, csv_dir=folder, stream=io.StringIO(), units="KB", strict=True)
    return model, optimizer, profiler


def _step(model, optimizer, profiler, sleep_s: float) -> None:
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(sleep_s)  # the configuration's own cost per step
    profiler.record_stats()


def train(folder: Path, sleep_s: float) -> Path:
    """One configuration: ``ITERATIONS`` steps, each sleeping ``sleep_s``, every one reported."""
    folder.mkdir()
    model, optimizer, profiler = _profiled(folder)
    with profiler:
        for _ in range(ITERATIONS):
            _step(model, optimizer, profiler, sleep_s)
        profiler.epoch_end()
    return Path(profiler.csv_path)


def _times(path: Path) -> pd.Series:
    return pd.read_csv(path)["iteration_time_s"].dropna()


def _same_configuration_again(run: Path, folder: Path) -> Path:
    """A second run of ``run``'s configuration whose iterations took the same times in another order:
    the same distribution, whatever else the machine was doing while ``run`` ran (two runs made one
    after the other on a loaded machine drift apart by tens of percent)."""
    import shutil

    shutil.copytree(run.parent, folder)
    copy = folder / run.name
    frame = pd.read_csv(copy)
    timed = frame["iteration_time_s"].notna()
    frame.loc[timed, "iteration_time_s"] = frame.loc[timed, "iteration_time_s"].to_numpy()[::-1]
    frame.to_csv(copy, index=False)
    return copy


def test_two_identical_configurations_are_within_noise(tmp_path):
    first = train(tmp_path / "first", 0.05)
    second = _same_configuration_again(first, tmp_path / "second")
    rows = compare_runs([load_run(first), load_run(second)], ["first", "second"])
    for row, path in zip(rows, (first, second)):
        times = _times(path)
        assert row.timed_iterations == len(times) == ITERATIONS >= MIN_TIMED_ITERATIONS
        assert row.time_per_iteration_s == pytest.approx(times.median(), rel=1e-12)
        assert row.time_quartiles_s == pytest.approx((times.quantile(0.25), times.quantile(0.75)), rel=1e-12)
    a, b = rows[0].time_quartiles_s, rows[1].time_quartiles_s
    medians = rows[0].time_per_iteration_s, rows[1].time_per_iteration_s
    # the interquartile ranges overlap, or the medians are within the noise floor
    assert (a[0] <= b[1] and b[0] <= a[1]) or abs(medians[1] - medians[0]) < NOISE_FLOOR * medians[0]
    line = format_markdown(rows, "KB").splitlines()[3]
    assert "time within noise" in line
    assert "% time" not in line  # no signed percentage for the time
    frame = comparison_frame(rows, "KB")
    assert bool(frame["time_within_noise"][1]) is True


def test_a_configuration_that_sleeps_longer_shows_the_difference(tmp_path):
    fast = train(tmp_path / "fast", 0.002)
    slow = train(tmp_path / "slow", 0.080)
    rows = compare_runs([load_run(fast), load_run(slow)], ["fast", "slow"])
    fast_times, slow_times = _times(fast), _times(slow)
    # every iteration of the slow run sleeps 78 ms more: far outside the fast run's spread
    assert slow_times.quantile(0.25) > fast_times.quantile(0.75)
    assert slow_times.min() >= 0.080
    change = (slow_times.median() - fast_times.median()) / fast_times.median() * 100
    lines = format_markdown(rows, "KB").splitlines()
    assert lines[3].endswith(f"memory, {change:+.1f}% time |")
    assert change > 0  # (+1000% or more on an idle machine; a loaded one stretches the fast run's steps)
    low, high = slow_times.quantile(0.25), slow_times.quantile(0.75)
    assert f"| {format_seconds(slow_times.median())} (IQR {format_seconds(low)[:-3]}-{format_seconds(high)}, {ITERATIONS} it.) |" in lines[3]
    assert bool(comparison_frame(rows, "KB")["time_within_noise"][1]) is False

    # the command line says the same, and explains the column
    result = run_cli("compare", fast, slow, "--names", "fast", "slow", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[3] == lines[3]
    assert "interquartile range (IQR)" in result.stdout and '"within noise"' in result.stdout


def test_too_few_timed_iterations_give_no_time_change(tmp_path):
    fast = train(tmp_path / "fast", 0.0)
    slow = train(tmp_path / "slow", 0.0)
    short = pd.read_csv(slow).head(MIN_TIMED_ITERATIONS - 1)
    short_path = tmp_path / "short.csv"
    short.to_csv(short_path, index=False)
    rows = compare_runs([load_run(fast), load_run(short_path)], ["full", "short"])
    assert rows[1].timed_iterations == MIN_TIMED_ITERATIONS - 1
    line = format_markdown(rows, "KB").splitlines()[3]
    assert line.endswith(
        f"time: too few timed iterations ({MIN_TIMED_ITERATIONS - 1}; {MIN_TIMED_ITERATIONS} needed) |"
    )
