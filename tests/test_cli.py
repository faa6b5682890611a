"""The command line, run for real (``python -m pytorch_mem_profiler``) on CSV files the profiler
wrote in the test."""

from __future__ import annotations

import importlib.util
import io
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch

from .helpers import needs_saved_tensor_watch
from .profiled_run import REPO, png_size, profile_tiny_model, run_cli
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.runs import module_of
from pytorch_mem_profiler.analysis.summary import format_seconds
from pytorch_mem_profiler.units import format_amount


needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the plot extra)"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs in ``<cwd>/memory_csv_data``: batch 8, then batch 256 (a larger peak)."""
    cwd = tmp_path_factory.mktemp("cli")
    folder = cwd / "memory_csv_data"
    small, model = profile_tiny_model(folder, batch=8)
    big, _ = profile_tiny_model(folder, batch=256)
    # the second is the newest, whatever the clock's resolution
    stamp = small.stat().st_mtime_ns
    os.utime(big, ns=(stamp + 10**9, stamp + 10**9))
    return {"cwd": cwd, "small": small, "big": big, "model": model}


def assert_bad_input(result, *fragments: str) -> None:
    """Exit status 2, one line on stderr naming the problem, no traceback, nothing on stdout."""
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pytorch-mem-profiler: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


def largest_module(model: torch.nn.Module) -> tuple[str, int]:
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        sizes[module_of(name)] = sizes.get(module_of(name), 0) + p.numel() * p.element_size()
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


# -- summary -----------------------------------------------------------------------------
def test_summary_of_a_named_run(runs):
    result = run_cli("summary", runs["small"], cwd=runs["cwd"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    raw = pd.read_csv(runs["small"])
    assert out.splitlines()[0] == f"Run {runs['small']} on cpu (KB = 1,000 bytes)"
    assert f"Peak allocated: {format_amount(raw['peak_allocated'].max() * 1000, 'KB', digits=3)}" in out
    assert f"Peak reserved:  {format_amount(raw['peak_cached'].max() * 1000, 'KB', digits=3)}" in out
    # torch's words: the seed's "cached" only where a CSV column is named
    header = next(line for line in out.splitlines() if line.startswith("Epoch "))
    assert header.split() == "Epoch Records Peak allocated Peak reserved Slowest iteration Fastest iteration".split()
    assert "cached" not in out.replace("peak_cached", "") and "fragmentation" not in out.lower()

    # per epoch: the highest iteration peak and peak cached of the epoch's rows
    for epoch, group in raw.groupby("epoch"):
        row = next(line for line in out.splitlines() if re.match(rf"{epoch}\s+2\s", line))
        assert format_amount(group["iteration_peak_allocated"].max() * 1000, "KB", digits=3) in row
        assert format_amount(group["peak_cached"].max() * 1000, "KB", digits=3) in row
        slow = group.loc[group["iteration_time_s"].idxmax()]
        assert f"{int(slow['iteration'])} ({format_seconds(slow['iteration_time_s'])})" in row

    # the largest layer by weight is the one with the most numel() * element_size()
    name, nbytes = largest_module(runs["model"])
    lines = out.splitlines()
    first = lines[lines.index("Largest layers by weights:") + 1].split()
    assert first[0] == name
    assert " ".join(first[1:]) == format_amount(nbytes, "KB", digits=3)
    first_grad = lines[lines.index("Largest layers by gradients:") + 1].split()
    assert first_grad[0] == name


def test_summary_of_the_newest_run_in_dir(runs):
    result = run_cli("summary", cwd=runs["cwd"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(
        f"Run {Path('memory_csv_data') / runs['big'].name} "
    )
    # a folder named as RUN: its newest, again
    result = run_cli(
        "summary", runs["cwd"] / "memory_csv_data", "--units", "B", "--top", "1", cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    name, nbytes = largest_module(runs["model"])
    lines = result.stdout.splitlines()
    assert runs["big"].name in lines[0]
    assert lines[lines.index("Largest layers by weights:") + 1].split() == [
        name,
        f"{nbytes:,}",
        "B",
    ]
    assert lines[lines.index("Largest layers by weights:") + 2] == ""  # --top 1


@needs_saved_tensor_watch
def test_summary_shows_the_layers_file(tmp_path):
    path, _ = profile_tiny_model(tmp_path, by_layer=True, units="B")
    result = run_cli("summary", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("Largest layers by feature maps:")
    # independently: each module's bytes per iteration, its largest over the run, totals left out
    raw = pd.read_csv(f"{path.with_suffix('')}_layers.csv")
    raw["module"] = raw["module"].fillna("(model)")
    layers = raw[(raw["category"] == "activations") & (raw["module"] != "(input)")]
    largest = layers.groupby(["step", "module"])["bytes"].sum().groupby("module").max()
    largest = largest.sort_values(ascending=False, kind="stable")
    shown = [line.split() for line in lines[at + 1 : at + 1 + len(largest)]]
    assert [row[0] for row in shown] == list(largest.index)
    assert [" ".join(row[1:]) for row in shown] == [format_amount(n, "B", digits=3) for n in largest]


# -- plot --------------------------------------------------------------------------------
@needs_matplotlib
def test_plot_writes_a_png_of_the_size_asked(runs, tmp_path):
    out = tmp_path / "memory.png"
    result = run_cli(
        "plot", runs["small"], "-o", out, "--width", 640, "--height", 360, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert png_size(out) == (640, 360)
    assert f"wrote {out} (640x360 pixels)" in result.stdout


@needs_matplotlib
def test_plot_default_name_and_size(runs, tmp_path):
    result = run_cli("plot", runs["small"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert png_size(tmp_path / f"{runs['small'].stem}.png") == (1200, 600)


# -- report ------------------------------------------------------------------------------
class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@needs_matplotlib
def test_report_writes_one_html_file(runs, tmp_path):
    out = tmp_path / "report.html"
    result = run_cli("report", runs["small"], "-o", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}"
    parser = _Tags()
    parser.feed(out.read_text(encoding="utf-8"))
    images = [attrs for tag, attrs in parser.tags if tag == "img"]
    assert len(images) == 3
    assert all(img["src"].startswith("data:image/png;base64,") for img in images)
    assert {attrs.get("id") for tag, attrs in parser.tags if tag == "table"} >= {
        "settings-table",
        "epoch-table",
        "parameter-table",
        "records-table",
    }
    assert list(tmp_path.iterdir()) == [out]  # nothing beside it: the file is all


# -- compare -----------------------------------------------------------------------------
def test_compare_table_and_csv(runs, tmp_path):
    out = tmp_path / "table.csv"
    result = run_cli(
        "compare",
        runs["small"],
        runs["big"],
        "--names",
        "batch 8",
        "batch 256",
        "--csv",
        out,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    small, big = pd.read_csv(runs["small"]), pd.read_csv(runs["big"])
    peak_small = small["peak_allocated"].max()
    peak_big = big["peak_allocated"].max()
    assert peak_big > peak_small
    time_small = small["iteration_time_s"].median()
    time_big = big["iteration_time_s"].median()

    lines = result.stdout.splitlines()
    assert lines[0] == "| Configuration | Peak memory | Time per iteration | vs first |"

    def time_cell(times):
        low, high = times.quantile(0.25), times.quantile(0.75)
        return f"{format_seconds(times.median())} (IQR {format_seconds(low)[:-3]}-{format_seconds(high)}, {len(times)} it.)"

    assert lines[2] == (
        f"| batch 8 | {format_amount(peak_small * 1000, 'KB', digits=3)} | {time_cell(small['iteration_time_s'])} | (reference) |"
    )
    change = (peak_big - peak_small) / peak_small * 100
    # these runs report 4 iterations each: too few to say which is faster
    assert len(small) == len(big) == 4
    assert lines[3] == (
        f"| batch 256 | {format_amount(peak_big * 1000, 'KB', digits=3)} | {time_cell(big['iteration_time_s'])} | "
        f"{change:+.1f}% memory, time: too few timed iterations (4; 10 needed) |"
    )

    table = pd.read_csv(out)
    assert list(table["configuration"]) == ["batch 8", "batch 256"]
    assert list(table["unit"]) == ["KB", "KB"]
    assert table["peak_memory"].tolist() == pytest.approx([peak_small, peak_big], rel=1e-12)
    assert table["peak_cached"].tolist() == pytest.approx(
        [small["peak_cached"].max(), big["peak_cached"].max()], rel=1e-12
    )
    assert table["time_per_iteration_s"].tolist() == pytest.approx(
        [time_small, time_big], rel=1e-12
    )
    assert pd.isna(table["peak_memory_change_pct"][0])
    assert table["peak_memory_change_pct"][1] == pytest.approx(change, rel=1e-9)
    assert table["time_q1_s"].tolist() == pytest.approx(
        [small["iteration_time_s"].quantile(0.25), big["iteration_time_s"].quantile(0.25)], rel=1e-12
    )
    assert table["time_q3_s"].tolist() == pytest.approx(
        [small["iteration_time_s"].quantile(0.75), big["iteration_time_s"].quantile(0.75)], rel=1e-12
    )
    assert table["timed_iterations"].tolist() == [4, 4]


def test_compare_in_another_unit_with_file_names(runs, tmp_path):
    result = run_cli("compare", runs["big"], runs["small"], "--units", "B", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    peak_big = round(pd.read_csv(runs["big"])["peak_allocated"].max() * 1000)
    assert result.stdout.splitlines()[2].startswith(f"| {runs['big'].stem} | {peak_big:,} B |")


def test_compare_shows_categories_and_says_how_runs_are_named(runs, tmp_path):
    result = run_cli("compare", runs["small"], runs["big"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # one folder, the profiler's dated names: named by file name, and it says so
    assert lines[2].startswith(f"| {runs['small'].stem} |")
    assert "Runs named by their file names; --names gives others." in lines
    at = lines.index(f"| Category | {runs['small'].stem} | {runs['big'].stem} |")
    weights = sum(p.numel() * p.element_size() for p in runs["model"].parameters())
    kb = format_amount(weights, "KB", digits=3)
    assert lines[at + 2] == f"| weights | {kb} | {kb} (same) |"
    small, big = pd.read_csv(runs["small"]), pd.read_csv(runs["big"])
    fm_small = round(small["total_feature_map_usage"].max() * 1000)
    fm_big = round(big["total_feature_map_usage"].max() * 1000)
    change = format_amount(fm_big - fm_small, "KB", digits=3)
    assert (
        f"| feature maps | {format_amount(fm_small, 'KB', digits=3)} | "
        f"{format_amount(fm_big, 'KB', digits=3)} (+{change}, {(fm_big - fm_small) / fm_small * 100:+.1f}%) |"
    ) in lines
    assert not any(line.startswith("Note:") for line in lines)  # the same model, the same device

    # named by the user: nothing to say about names
    named = run_cli("compare", runs["small"], runs["big"], "--names", "a", "b", cwd=tmp_path)
    assert "Runs named by" not in named.stdout


def test_compare_names_runs_by_folder_and_notes_another_model(tmp_path):
    base, _ = profile_tiny_model(tmp_path / "baseline")
    wide, _ = profile_tiny_model(tmp_path / "wide batch", batch=64)
    model = torch.nn.Linear(3, 2)
    with memory_profiler(model, 1, True, csv_dir=tmp_path / "linear", stream=io.StringIO()) as p:
        model(torch.randn(4, 3)).sum().backward()
        p.record_stats()
    result = run_cli("compare", base, wide, p.csv_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| baseline", "| wide batch", "| linear"]
    assert "Runs named by their folders; --names gives others." in lines
    assert lines[-1] == (
        "Note: runs differ in model: linear has 2 parameter names baseline lacks (weight, bias) "
        "and lacks 6 of baseline's (encoder.weight, encoder.bias, ...); "
        "comparing them is comparing different things."
    )


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["summary", "plot", "report", "compare"])
def test_missing_file(command, tmp_path):
    assert_bad_input(
        run_cli(command, tmp_path / "gone.csv", cwd=tmp_path), "gone.csv", "no such file"
    )


def test_not_a_profiler_csv(tmp_path):
    other = tmp_path / "prices.csv"
    other.write_text("date,price\n2024-01-01,3\n")
    assert_bad_input(
        run_cli("summary", other, cwd=tmp_path), "prices.csv", "not a pytorch_mem_profiler CSV"
    )
    assert_bad_input(
        run_cli("compare", other, other, cwd=tmp_path), "not a pytorch_mem_profiler CSV"
    )


def test_no_run_in_dir(tmp_path):
    assert_bad_input(run_cli("summary", cwd=tmp_path), "no folder 'memory_csv_data'")
    (tmp_path / "empty").mkdir()
    assert_bad_input(
        run_cli("report", "--dir", "empty", cwd=tmp_path), "no memory_stats_*.csv file in 'empty'"
    )


def test_names_must_match_runs(runs, tmp_path):
    assert_bad_input(
        run_cli("compare", runs["small"], runs["big"], "--names", "one", cwd=tmp_path),
        "--names gives 1 name(s) for 2 run(s)",
    )


@needs_matplotlib
def test_unwritable_output(runs, tmp_path):
    assert_bad_input(
        run_cli("plot", runs["small"], "-o", tmp_path / "no" / "such" / "x.png", cwd=tmp_path),
        "cannot write",
    )


def test_usage_errors_exit_2(tmp_path):
    for args in ([], ["frobnicate"], ["plot", "--width", "0"]):
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert "usage: pytorch-mem-profiler" in result.stderr


def test_console_script_is_declared():
    setup = (REPO / "setup.py").read_text()
    assert '"pytorch-mem-profiler=pytorch_mem_profiler.analysis.cli:main"' in setup
    from pytorch_mem_profiler.analysis.cli import main

    assert main(["summary", "/no/such/run.csv"]) == 2
