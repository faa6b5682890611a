"""Charts: the PNG's size, what is stacked, labels and units, matplotlib as an optional extra."""

from __future__ import annotations

import io
import sys
from dataclasses import replace

import pandas as pd
import pytest
import torch

from .profiled_run import png_size, profile_tiny_model
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.runs import load_run
from pytorch_mem_profiler.units import format_amount

pytest.importorskip("matplotlib")

from pytorch_mem_profiler.analysis.plot import (  # noqa: E402
    CATEGORIES,
    RESERVED_LABEL,
    memory_categories,
    plot_iteration_time,
    plot_layers,
    plot_memory,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path, _ = profile_tiny_model(tmp_path_factory.mktemp("plot"), epochs=3, print_period=1)
    return load_run(path)


@pytest.mark.parametrize("width,height,dpi", [(1200, 600, 100), (800, 500, 80), (1600, 900, 150)])
def test_png_has_the_pixel_size_asked(run, tmp_path, width, height, dpi):
    out = tmp_path / "memory.png"
    plot_memory(run, out, width=width, height=height, dpi=dpi)
    assert png_size(out) == (width, height)


def test_other_charts_write_pngs(run, tmp_path):
    plot_layers(run, tmp_path / "layers.png", width=900, height=400)
    plot_iteration_time(run, tmp_path / "time.png", width=700, height=300)
    assert png_size(tmp_path / "layers.png") == (900, 400)
    assert png_size(tmp_path / "time.png") == (700, 300)


def test_stacked_categories(run):
    parts = memory_categories(run)
    rec = run.records
    assert list(parts.columns) == [column for column, _, _ in CATEGORIES]
    assert list(parts["weights"]) == list(rec["weights"])
    assert list(parts["feature_maps"]) == list(rec["feature_maps"])
    known = rec[
        ["weights", "gradients", "optimizer_state", "feature_maps", "intermediate_gradients"]
    ].sum(axis=1)
    expected_other = (rec["iteration_peak_allocated"] - known).clip(lower=0)
    assert list(parts["other"]) == list(expected_other)
    # where "other" is positive, the stack's top is the iteration's peak; where the categories
    # (not all alive at once) reach past the peak, "other" is 0 and the top is their sum
    top = parts.sum(axis=1)
    positive = parts["other"] > 0
    assert list(top[positive]) == list(rec["iteration_peak_allocated"][positive])
    assert list(top[~positive]) == list(known[~positive])
    assert (known[~positive] >= rec["iteration_peak_allocated"][~positive]).all()
    # a file without intermediate gradients (written before backward's peak was explained):
    # the peak's room above the other categories is "other", and the stack's top is the peak
    older = replace(run, records=rec.assign(intermediate_gradients=float("nan")))
    parts = memory_categories(older)
    assert (parts["intermediate_gradients"] == 0).all()
    assert (parts["other"] > 0).all()
    assert list(parts.sum(axis=1)) == list(rec["iteration_peak_allocated"])


def test_memory_chart_labels_units_and_epochs(run):
    figure = plot_memory(run, unit="KiB")
    ax = figure.axes[0]
    assert ax.get_ylabel() == "Memory (KiB, 1 KiB = 1,024 bytes)"
    assert "Iteration" in ax.get_xlabel()
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[:2] == [RESERVED_LABEL, "peak allocated, this iteration"]
    assert sorted(labels[2:]) == sorted(label for _, label, _ in CATEGORIES)
    # the reserved line is current_cached, in KiB
    reserved = next(line for line in ax.lines if line.get_label() == RESERVED_LABEL)
    assert list(reserved.get_ydata()) == pytest.approx(list(run.records["current_cached"] / 1024))
    # one label per epoch, a boundary line between epochs
    epoch_labels = [t.get_text() for t in ax.texts if t.get_text().startswith("epoch ")]
    assert epoch_labels == ["epoch 1", "epoch 2", "epoch 3"]
    boundaries = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(boundaries) == 2
    steps = run.records["step"]
    assert (
        boundaries[0].get_xdata()[0]
        == (steps[run.records["epoch"] == 1].max() + steps[run.records["epoch"] == 2].min()) / 2
    )


def test_a_single_record_is_drawn(tmp_path):
    model = torch.nn.Linear(8, 8)
    with memory_profiler(model, 1, True, csv_dir=tmp_path, stream=io.StringIO()) as profiler:
        model(torch.randn(4, 8)).sum().backward()
        profiler.record_stats()
    figure = plot_memory(load_run(profiler.csv_path), tmp_path / "one.png", width=600, height=300)
    assert png_size(tmp_path / "one.png") == (600, 300)
    lo, hi = figure.axes[0].get_xlim()
    assert hi - lo == pytest.approx(1.0)


def test_bad_size_is_named(run):
    with pytest.raises(ValueError, match="width must be an integer >= 1, got 0"):
        plot_memory(run, width=0)


def test_without_matplotlib_the_error_says_what_to_install(run, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(
        ImportError, match=r"pip install 'pytorch_mem_profiler\[plot\]' to draw plots"
    ):
        plot_memory(run)

    from pytorch_mem_profiler.analysis.cli import main

    assert main(["plot", str(run.path), "-o", "unused.png"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "pytorch-mem-profiler: error: pip install 'pytorch_mem_profiler[plot]' to draw plots\n"
    )

    from pytorch_mem_profiler.analysis.html_report import render_html

    page = render_html(run)
    assert 'id="no-charts"' in page and "pytorch_mem_profiler[plot]" in page
    assert "<img" not in page


def test_layers_chart_orders_by_size(run):
    figure = plot_layers(run)
    ax = figure.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    sizes = run.weights.iloc[-1].groupby(lambda n: n.rpartition(".")[0]).sum()
    grads = run.gradients.max().groupby(lambda n: n.rpartition(".")[0]).sum()
    expected = (sizes + grads).sort_values(ascending=False)
    assert names == list(expected.index)
    assert isinstance(expected, pd.Series)


# -- the peak's breakdown ----------------------------------------------------------------
@pytest.fixture(scope="module")
def broken_down(tmp_path_factory):
    """A KB run with a breakdown per record; record 3 (epoch 2, iteration 2) has the run's peak."""
    from .peak_columns import add_peak_columns

    path, _ = profile_tiny_model(tmp_path_factory.mktemp("peak-plot"), units="KB")
    peak = round(pd.read_csv(path)["iteration_peak_allocated"].max() * 1000) * 2
    total = round(peak * 100 / 60)  # the run's peak: 60% of the device
    expected = add_peak_columns(path, device_total=total, peak_scale={2: 2})
    return load_run(path), expected


def test_the_peak_bar_is_the_run_peak_record(broken_down, tmp_path):
    from pytorch_mem_profiler.analysis.plot import PEAK_COLOURS, plot_peak_breakdown
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS, PHASE_LABELS

    run, expected = broken_down
    record = expected.iloc[2]
    assert record["peak"] == expected["peak"].max()
    figure = plot_peak_breakdown(run, tmp_path / "peak.png", unit="KB", width=900, height=240)
    assert png_size(tmp_path / "peak.png") == (900, 240)
    ax = figure.axes[0]
    drawn = [c for c in PEAK_CATEGORIES if record[c] > 0]
    bars = [patch for patch in ax.patches]
    # left to right in the vocabulary's order, each as wide as its bytes, in KB
    assert [bar.get_width() for bar in bars] == pytest.approx([record[c] / 1000 for c in drawn])
    assert [bar.get_x() for bar in bars] == pytest.approx(
        [sum(record[c] for c in drawn[:i]) / 1000 for i in range(len(drawn))]
    )
    assert [bar.get_gid() for bar in bars] == [f"peak-{c}" for c in drawn]
    assert [tuple(round(v, 3) for v in bar.get_facecolor()[:3]) for bar in bars] == [
        tuple(round(int(PEAK_COLOURS[c][i : i + 2], 16) / 255, 3) for i in (1, 3, 5)) for c in drawn
    ]
    assert ax.get_xlim() == pytest.approx((0, record["peak"] / 1000))
    # the legend: largest first, with bytes and share
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    ranked = sorted(drawn, key=lambda c: -record[c])
    assert ranked[0] == "optimizer_state"  # epoch 2's shares
    assert labels[0] == (
        f"optimizer state: {format_amount(record['optimizer_state'], 'KB', digits=3)} "
        f"({record['optimizer_state'] / record['peak'] * 100:.0f}%)"
    )
    assert [label.split(":")[0] for label in labels] == [
        PEAK_CATEGORY_LABELS[c].split(" (")[0] for c in ranked
    ]
    phase = PHASE_LABELS[run.records["peak_phase"].iloc[2]]
    assert ax.get_title(loc="left") == (
        f"At the run's peak: {format_amount(record['peak'], 'KB', digits=3)}, epoch 2 iteration 2, "
        f"{phase}; 60% of the device's {format_amount(run.device_total, 'KB', digits=3)}"
    )


def test_memory_chart_gets_the_bar_as_a_panel(broken_down, run, tmp_path):
    broken, expected = broken_down
    figure = plot_memory(broken, tmp_path / "memory.png", width=1000, height=560)
    assert png_size(tmp_path / "memory.png") == (1000, 560)
    assert len(figure.axes) == 2
    chart, bar = figure.axes
    assert chart.get_ylabel().startswith("Memory (KB")
    assert sum(p.get_width() for p in bar.patches) == pytest.approx(expected["peak"].max() / 1000)
    # asked not to, or a file without the breakdown: the chart alone, no error
    assert len(plot_memory(broken, peak_bar=False).axes) == 1
    assert len(plot_memory(run).axes) == 1


def test_peak_bar_of_an_older_file_is_refused_with_the_reason(run):
    from pytorch_mem_profiler.analysis.plot import plot_peak_breakdown

    with pytest.raises(ValueError, match="does not record what was alive at its peak"):
        plot_peak_breakdown(run)


def test_cli_plot_draws_the_panel(broken_down, tmp_path):
    from .profiled_run import run_cli

    broken, _ = broken_down
    out = tmp_path / "memory.png"
    result = run_cli("plot", broken.path, "-o", out, "--width", 800, "--height", 500, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert png_size(out) == (800, 500)


def test_reserved_line_says_what_it_is_and_why_it_can_run_inside_the_stack(run):
    # A CUDA-like file: the allocator's reserved memory read at record_stats(), here set below
    # the stack's top (as when the categories' own largest add past what was alive at once).
    rec = run.records
    stack_top = memory_categories(run).sum(axis=1)
    reserved = stack_top * 0.9
    cuda_like = replace(run, records=rec.assign(current_cached=reserved))
    figure = plot_memory(cuda_like, unit="B")
    ax = figure.axes[0]
    legend = ax.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    entry = next(t for t in texts if t.startswith("reserved"))
    flat = " ".join(entry.split())
    assert "reserved by the allocator at record_stats()" in flat
    assert "allocated + its cache, at that moment" in flat
    assert "may run inside the stack" in flat
    assert "each category at its own largest" in flat
    # the line drawn is the file's current_cached, and it does run inside the stack here
    line = next(l for l in ax.get_lines() if l.get_label() == entry)
    assert list(line.get_ydata()) == list(reserved)
    assert (line.get_ydata() < stack_top.to_numpy()).all()
    # a CPU file (no reserved memory) has no such entry
    cpu = plot_memory(replace(run, records=rec.assign(current_cached=float("nan"))))
    assert not any(t.get_text().startswith("reserved") for t in cpu.axes[0].get_legend().get_texts())
