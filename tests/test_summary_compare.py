"""Summary tables and the comparison, in process, on runs the profiler wrote."""

from __future__ import annotations

import io

import pandas as pd
import pytest
import torch

from pytorch_mem_profiler import memory_profiler

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
    # rows made without the times' spread say so beside the change
    assert lines[3] == "| checkpointing | 1.50 GB | 250 ms | -62.5% memory, +25.0% time (spread unknown) |"
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


# -- headroom and the peak's breakdown ---------------------------------------------------
def _share(fraction: float) -> str:
    """Whole percents, as printed; the tests choose figures far from a rounding edge."""
    return f"{fraction * 100:.0f}%"


@pytest.fixture(scope="module")
def broken_down(tmp_path_factory):
    """A KB run whose file has a breakdown per record; record 2 (epoch 1, iteration 4) has its
    iteration peak doubled, so it is the run's peak, and the run's peak is 48% of the device."""
    from .peak_columns import add_peak_columns

    path, model = profile_tiny_model(tmp_path_factory.mktemp("breakdown"), units="KB")
    peak = round(pd.read_csv(path)["iteration_peak_allocated"].max() * 1000) * 2
    total = round(peak * 100 / 48)
    expected = add_peak_columns(path, device_total=total, peak_scale={1: 2})
    assert expected["peak"].max() == peak and expected["peak"].idxmax() == 1
    return {"run": load_run(path), "expected": expected, "total": total, "raw": pd.read_csv(path)}


def test_summary_headroom_and_largest_category_per_epoch(broken_down):
    from pytorch_mem_profiler.analysis.summary import epoch_header, epoch_rows, format_summary

    run, expected, total, raw = (broken_down[k] for k in ("run", "expected", "total", "raw"))
    kb = lambda n: format_amount(n, "KB", digits=3)  # noqa: E731
    peak = expected["peak"].max()
    reserved = round(raw["peak_cached"].max() * 1000)
    lines = format_summary(run).splitlines()
    assert lines[4] == (
        f"Headroom: peak {kb(peak)} of {kb(total)} (48%); "
        f"reserved at most {kb(reserved)} ({_share(reserved / total)})"
    )

    table = epoch_table(run)
    assert list(table["largest_category"]) == ["activations", "optimizer_state"]
    # each epoch's highest-peak record: epoch 1's is the doubled one, epoch 2's the first
    first, second = expected.iloc[1], expected.iloc[2]
    assert list(table["largest_bytes"]) == [first["activations"], second["optimizer_state"]]
    assert list(table["largest_share"]) == [
        first["activations"] / first["peak"],
        second["optimizer_state"] / second["peak"],
    ]
    assert list(table["device_share"]) == [first["peak"] / total, second["peak"] / total]
    assert epoch_header(table)[-2:] == ("Peak of device", "Largest at the peak")
    rows = epoch_rows(table, kb)
    assert rows[0][-2:] == ("48%", f"feature maps (saved for backward) {_share(first['activations'] / first['peak'])}")
    assert rows[1][-2:] == (
        _share(second["peak"] / total),
        f"optimizer state {_share(second['optimizer_state'] / second['peak'])}",
    )
    # the text table shows the same cells
    at = next(i for i, line in enumerate(lines) if line.startswith("Epoch "))
    assert lines[at].split("  ")[-1] == "Largest at the peak"
    assert lines[at + 2].endswith("48%  feature maps (saved for backward) 45%")
    assert lines[at + 3].endswith(f"{_share(second['peak'] / total)}  optimizer state 50%")


def test_summary_lists_the_peak_largest_first(broken_down):
    import re

    from pytorch_mem_profiler.analysis.summary import format_summary
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS, PHASE_LABELS

    run, expected, raw = (broken_down[k] for k in ("run", "expected", "raw"))
    lines = format_summary(run, "B").splitlines()
    record = expected.iloc[1]
    phase = PHASE_LABELS[raw["peak_phase"][1]]
    at = lines.index(
        f"At the run's peak (epoch 1, iteration 4, during {phase}): "
        f"{format_amount(record['peak'], 'B', digits=3)}"
    )
    ranked = sorted(
        ((c, int(record[c])) for c in PEAK_CATEGORIES if record[c] > 0), key=lambda kv: -kv[1]
    )
    shown = [re.split(r"\s{2,}", line.strip()) for line in lines[at + 1 : at + 1 + len(ranked)]]
    assert shown == [
        [PEAK_CATEGORY_LABELS[c], format_amount(n, "B", digits=3), _share(n / record["peak"])]
        for c, n in ranked
    ]
    assert sum(n for _, n in ranked) == record["peak"]
    assert lines[at + 1 + len(ranked)] == ""


def test_summary_of_an_older_file_has_no_headroom_and_no_breakdown(pair):
    from pytorch_mem_profiler.analysis.summary import epoch_header, format_summary

    small, _, _ = pair
    text = format_summary(small)
    assert "Headroom" not in text and "At the run's peak" not in text
    assert epoch_header(epoch_table(small)) == (
        "Epoch",
        "Records",
        "Peak allocated",
        "Peak reserved",
        "Slowest iteration",
        "Fastest iteration",
    )
    # torch's words: reserved and allocated; cached only as the seed's column names
    assert "Peak cached" not in text and "fragmentation" not in text.lower()
    assert "Peak reserved:  " in text


def test_groups_of_unequal_layers():
    from pytorch_mem_profiler.analysis.summary import group_line
    from pytorch_mem_profiler.grouping import group_repeated

    sizes = {"layers.0.ff": 2_000_000, "layers.1.ff": 3_000_000, "layers.2.ff": 2_500_000, "head": 1}
    size = lambda n: format_amount(n, "MB", digits=3)  # noqa: E731
    groups = group_repeated(sizes)
    assert group_line(groups[0], sizes, size) == ("layers.[0-2].ff", "3 x 2.00 to 3.00 MB", 7_500_000)
    assert group_line(groups[1], sizes, size) == ("head", "", 1)


# -- compare: categories, names, notes ----------------------------------------------------
def test_compare_categories_are_the_runs_figures(pair, broken_down):
    from pytorch_mem_profiler.analysis.compare import format_categories_markdown
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES

    small, big, model = pair
    run = broken_down["run"]
    rows = compare_runs([small, big, run], ["small", "big", "broken down"])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for row, r in zip(rows, (small, big, run)):
        raw = pd.read_csv(r.path)
        scale = 1 if r is not run else 1000
        assert row.categories["weights"] == weights
        assert row.categories["gradients"] == weights  # Adam: every parameter has a gradient
        assert row.categories["optimizer_state"] == round(raw["optimizer_state"].max() * scale)
        assert row.categories["feature_maps"] == round(raw["total_feature_map_usage"].max() * scale)
    # the breakdown: at the run's highest-peak record; runs without one have no such category
    record = broken_down["expected"].iloc[1]
    assert {k: v for k, v in rows[2].categories.items() if k.startswith("peak_")} == {
        f"peak_{c}": record[c] for c in PEAK_CATEGORIES
    }
    assert not any(k.startswith("peak_") for k in rows[0].categories)

    lines = format_categories_markdown(rows, "B").splitlines()
    assert lines[0] == "| Category | small | big | broken down |"
    b = lambda n: format_amount(n, "B", digits=3)  # noqa: E731
    assert lines[2] == f"| weights | {b(weights)} | {b(weights)} (same) | {b(weights)} (same) |"
    fm_small, fm_big = rows[0].categories["feature_maps"], rows[1].categories["feature_maps"]
    assert fm_big > fm_small
    feature_line = next(line for line in lines if line.startswith("| feature maps |"))
    assert feature_line.split(" | ")[2] == (
        f"{b(fm_big)} (+{b(fm_big - fm_small)}, {(fm_big - fm_small) / fm_small * 100:+.1f}%)"
    )
    activations = next(line for line in lines if "at the peak: feature maps" in line)
    assert activations == (
        f"| at the peak: feature maps (saved for backward) | n/a | n/a | {b(record['activations'])} |"
    )

    frame = comparison_frame(rows, "KB")
    assert frame["feature_maps"].tolist() == pytest.approx(
        [r.categories["feature_maps"] / 1000 for r in rows]
    )
    assert frame["feature_maps_change_pct"][1] == pytest.approx((fm_big - fm_small) / fm_small * 100)
    assert frame["peak_activations"][2] == pytest.approx(record["activations"] / 1000)
    assert frame["peak_activations"][:2].isna().all()
    assert frame["device_total"][2] == pytest.approx(broken_down["total"] / 1000)
    assert frame["same_model_as_first"].tolist() == [True, True, True]


def test_default_names(tmp_path):
    import shutil

    from pytorch_mem_profiler.analysis.compare import default_names

    base, _ = profile_tiny_model(tmp_path / "runs" / "baseline")
    ckpt, _ = profile_tiny_model(tmp_path / "runs" / "checkpointing")
    runs = [load_run(base), load_run(ckpt)]
    assert default_names(runs) == (["baseline", "checkpointing"], "folders")
    assert [r.name for r in compare_runs(runs)] == ["baseline", "checkpointing"]
    # the same folder: the file names; a file the user named keeps its name
    shutil.copy(base, tmp_path / "runs" / "baseline" / "mine.csv")
    alike = [load_run(base), load_run(tmp_path / "runs" / "baseline" / "mine.csv")]
    assert default_names(alike) == ([base.stem, "mine"], "file names")
    # one run twice: told apart
    assert default_names([runs[0], runs[0]])[0] == [base.stem, f"{base.stem} (2)"]


def test_notes_on_model_and_device(tmp_path):
    from pytorch_mem_profiler.analysis.compare import comparison_notes

    tiny, model = profile_tiny_model(tmp_path / "tiny")
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with memory_profiler(other, 1, True, csv_dir=tmp_path / "other", stream=io.StringIO()) as p:
        other(torch.randn(3, 4)).sum().backward()
        p.record_stats()
    rows = compare_runs([load_run(tiny), load_run(p.csv_path)])
    tiny_names = [n for n, _ in model.named_parameters()]
    other_names = [n for n, _ in other.named_parameters()]
    assert comparison_notes(rows) == [
        f"runs differ in model: other has {len(other_names)} parameter names tiny lacks "
        f"({other_names[0]}, {other_names[1]}, ...) and lacks {len(tiny_names)} of tiny's "
        f"({tiny_names[0]}, {tiny_names[1]}, ...); comparing them is comparing different things"
    ]
    assert comparison_frame(rows)["same_model_as_first"].tolist() == [True, False]

    # the same model on another kind of device, then on a device of another size
    moved, _ = profile_tiny_model(tmp_path / "moved")
    frame = pd.read_csv(moved)
    frame["device"] = "cuda:0"
    frame.to_csv(moved, index=False)
    rows = compare_runs([load_run(tiny), load_run(moved)])
    assert comparison_notes(rows) == [
        "runs differ in device: tiny on cpu, moved on cuda:0; comparing them is comparing different things"
    ]
    from .peak_columns import add_peak_columns

    add_peak_columns(tiny, device_total=16_000_000_000)
    frame = pd.read_csv(moved)
    frame["device"] = "cpu"
    frame.to_csv(moved, index=False)
    add_peak_columns(moved, device_total=80_000_000_000)
    rows = compare_runs([load_run(tiny), load_run(moved)])
    assert comparison_notes(rows, "GB") == [
        "runs differ in device: tiny on cpu (16.0 GB), moved on cpu (80.0 GB); "
        "comparing them is comparing different things"
    ]
    # the same model on the same device: nothing to say
    assert comparison_notes(compare_runs([load_run(tiny), load_run(tiny)])) == []


def test_share_text():
    from pytorch_mem_profiler.analysis.peaks import format_share

    assert [format_share(f) for f in (0.48, 0.994, 1.0, 0.0, 0.0052, 0.00001, None, float("nan"))] == [
        "48%",
        "99%",  # whole percents from 1%
        "100%",
        "0%",
        "0.52%",
        "<0.01%",
        "n/a",
        "n/a",
    ]
