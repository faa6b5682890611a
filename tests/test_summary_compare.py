"""Summary tables and the comparison, in process, on runs the profiler wrote."""

from __future__ import annotations

import pandas as pd
import pytest

from .profiled_run import profile_tiny_model
from pytorch_mem_profiler.analysis.compare import (
    Comparison,
    compare_runs,
    comparison_frame,
    format_markdown,
)
from pytorch_mem_profiler.analysis.runs import load_run
from pytorch_mem_profiler.analysis.summary import (
    epoch_table,
    format_seconds,
    largest_layers,
    peak_memory,
    time_per_iteration,
)
from pytorch_mem_profiler.units import format_amount


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair")
    small, model = profile_tiny_model(folder, batch=4, units="B")
    big, _ = profile_tiny_model(folder, batch=512, units="B")
    return load_run(small), load_run(big), model


def test_format_size_and_seconds():
    assert format_amount(0, "MB", digits=3) == "0 MB"
    assert format_amount(123_456_789, "MB", digits=3) == "123 MB"
    assert format_amount(12_345_678, "MB", digits=3) == "12.3 MB"
    assert format_amount(1_234_567, "MB", digits=3) == "1.23 MB"
    assert format_amount(1_234, "MB", digits=3) == "0.00123 MB"
    assert format_amount(3 * 2**30, "GiB", digits=3) == "3.00 GiB"
    assert format_amount(12_345_678_901, "B", digits=3) == "12,345,678,901 B"
    assert format_amount(float("nan"), "MB", digits=3) == "n/a"
    assert format_seconds(0.1234) == "123 ms"
    assert format_seconds(9.5) == "9,500 ms"
    assert format_seconds(136.4) == "136 s"
    assert format_seconds(None) == "n/a"


def test_peak_and_time_are_the_columns(pair):
    small, _, _ = pair
    raw = pd.read_csv(small.path)
    assert peak_memory(small) == raw["peak_allocated"].max()  # unit B: the file's own numbers
    assert time_per_iteration(small) == pytest.approx(raw["iteration_time_s"].median(), rel=1e-12)


def test_epoch_table(pair):
    small, _, _ = pair
    raw = pd.read_csv(small.path)
    table = epoch_table(small)
    assert list(table["epoch"]) == [1, 2]
    assert list(table["records"]) == [2, 2]
    assert list(table["peak_allocated"]) == list(
        raw.groupby("epoch")["iteration_peak_allocated"].max()
    )
    assert list(table["peak_cached"]) == list(raw.groupby("epoch")["peak_cached"].max())
    for row, (_, group) in zip(table.itertuples(), raw.groupby("epoch")):
        assert row.slowest_s == group["iteration_time_s"].max()
        assert row.fastest_s == group["iteration_time_s"].min()


def test_largest_layers_are_the_largest_modules(pair):
    small, _, model = pair
    expected = {}
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        expected[module] = expected.get(module, 0) + p.numel() * p.element_size()
    ranked = sorted(expected.items(), key=lambda kv: -kv[1])
    layers = largest_layers(small, top=2)
    assert layers["weights"] == [(n, float(b)) for n, b in ranked[:2]]
    assert layers["gradients"] == [(n, float(b)) for n, b in ranked[:2]]


def test_compare_runs(pair):
    small, big, _ = pair
    rows = compare_runs([small, big], ["small", "big"])
    assert [r.name for r in rows] == ["small", "big"]
    assert rows[0].peak_allocated == pd.read_csv(small.path)["peak_allocated"].max()
    assert rows[1].peak_allocated == pd.read_csv(big.path)["peak_allocated"].max()
    assert rows[1].peak_allocated > rows[0].peak_allocated
    frame = comparison_frame(rows, "KB")
    assert frame["peak_memory"][1] == pytest.approx(rows[1].peak_allocated / 1000)
    assert frame["peak_memory_change_pct"][1] == pytest.approx(
        (rows[1].peak_allocated - rows[0].peak_allocated) / rows[0].peak_allocated * 100
    )
    assert [r.name for r in compare_runs([small, big])] == [small.name, big.name]
    with pytest.raises(ValueError, match="names must give one name per run"):
        compare_runs([small, big], ["only one"])


def test_markdown_percentages():
    rows = [
        Comparison("baseline", 4_000_000_000, None, 0.200),
        Comparison("checkpointing", 1_500_000_000, None, 0.250),
        Comparison("mps run", None, None, None),
    ]
    lines = format_markdown(rows, "GB").splitlines()
    assert lines[2] == "| baseline | 4.00 GB | 200 ms | (reference) |"
    assert lines[3] == "| checkpointing | 1.50 GB | 250 ms | -62.5% memory, +25.0% time |"
    assert lines[4] == "| mps run | n/a | n/a | n/a memory, n/a time |"
    assert (
        format_markdown([Comparison("a|b", 1, None, 1.0)], "B")
        .splitlines()[2]
        .startswith("| a\\|b |")
    )
    with pytest.raises(ValueError, match="unit must be one of"):
        format_markdown(rows, "furlong")


def test_a_bad_unit_is_named(pair):
    from pytorch_mem_profiler.analysis.html_report import render_html
    from pytorch_mem_profiler.analysis.summary import format_summary

    small, _, _ = pair
    for call in (lambda: format_summary(small, "MBs"), lambda: render_html(small, "MBs")):
        with pytest.raises(
            ValueError, match="unit must be one of B, KB, MB, GB, KiB, MiB, GiB; got 'MBs'"
        ):
            call()
