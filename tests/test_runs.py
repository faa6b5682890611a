"""Reading the profiler's CSV files back: runs.py, on files the profiler wrote in the test."""

from __future__ import annotations

import io
import os

import pandas as pd
import pytest
import torch

from .profiled_run import TinyNet, profile_tiny_model
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.units import UNITS
from pytorch_mem_profiler.analysis.runs import (
    RunFileError,
    find_run,
    layers_path,
    load_run,
    module_of,
    newest_run,
)
from pytorch_mem_profiler.measure.saved_tensors import can_chain


def param_bytes(model: torch.nn.Module) -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


@pytest.mark.parametrize("units", ["KB", "B", "MiB"])
def test_figures_come_back_in_bytes(tmp_path, units):
    path, model = profile_tiny_model(tmp_path, units=units)
    run = load_run(path)
    raw = pd.read_csv(path)
    expected = param_bytes(model)

    assert run.unit == units
    assert run.parameters == list(expected)
    # 2 epochs x 4 iterations, reported every 2nd
    assert list(run.records["epoch"]) == [1, 1, 2, 2]
    assert list(run.records["iteration"]) == [2, 4, 2, 4]
    assert list(run.records["step"]) == [2, 4, 6, 8]
    for name, nbytes in expected.items():
        assert list(run.weights[name]) == [nbytes] * 4
        # Adam trains every parameter: each has a gradient the size of its weight
        assert list(run.gradients[name]) == [nbytes] * 4
    assert list(run.records["weights"]) == [sum(expected.values())] * 4
    # every amount is the file's figure times the unit, a whole number of bytes
    assert list(run.records["allocated"]) == pytest.approx(
        list(raw["allocated"] * UNITS[units]), abs=0.5
    )
    assert (run.records["allocated"] % 1 == 0).all()
    assert run.device == "cpu"
    assert run.epochs == [1, 2]
    assert run.layers is None and run.warnings == ()


def test_added_columns_are_carried_not_mistaken_for_parameters(tmp_path):
    path, model = profile_tiny_model(tmp_path)
    frame = pd.read_csv(path)
    # a later version adds figures: one among the parameter columns, one at the end
    frame.insert(frame.columns.get_loc("total_weight_usage") + 1, "total_buffer_usage", 0.0)
    frame["something_new"] = 1.5
    frame.to_csv(path, index=False)

    run = load_run(path)
    assert run.parameters == list(param_bytes(model))
    assert "total_buffer_usage" not in run.weights


def test_module_of():
    assert module_of("encoder.layers.0.weight") == "encoder.layers.0"
    assert module_of("scale") == "(model)"


def test_missing_file(tmp_path):
    with pytest.raises(RunFileError, match="no such file"):
        load_run(tmp_path / "nope.csv")


def test_not_a_profiler_csv(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(
        RunFileError, match=r"not a pytorch_mem_profiler CSV: missing column\(s\) epoch"
    ):
        load_run(path)


def test_empty_and_binary_files(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(RunFileError, match="is empty"):
        load_run(empty)
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(RunFileError):
        load_run(binary)


def test_header_only_file_has_no_records(tmp_path):
    profiler = memory_profiler(
        torch.nn.Linear(2, 2), 1, True, csv_dir=tmp_path, stream=io.StringIO()
    )
    profiler.close()
    with pytest.raises(RunFileError, match="has no records yet"):
        load_run(profiler.csv_path)


def test_bad_values(tmp_path):
    path, _ = profile_tiny_model(tmp_path)
    frame = pd.read_csv(path)
    frame["allocated"] = frame["allocated"].astype(object)
    frame.loc[0, "allocated"] = "lots"
    frame.to_csv(path, index=False)
    with pytest.raises(
        RunFileError, match="column 'allocated' holds something that is not a number"
    ):
        load_run(path)

    path, _ = profile_tiny_model(tmp_path)
    frame = pd.read_csv(path)
    frame.loc[1, "epoch"] = None
    frame.to_csv(path, index=False)
    with pytest.raises(RunFileError, match="has a row without its epoch or iteration"):
        load_run(path)

    path, _ = profile_tiny_model(tmp_path)
    frame = pd.read_csv(path)
    frame["unit"] = "furlongs"
    frame.to_csv(path, index=False)
    with pytest.raises(RunFileError, match="unknown unit 'furlongs'"):
        load_run(path)


def test_newest_run_by_time_written(tmp_path):
    first, _ = profile_tiny_model(tmp_path)
    second, _ = profile_tiny_model(tmp_path)
    assert first != second
    os.utime(first, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
    os.utime(second, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    assert newest_run(tmp_path) == first
    # a per-layer companion file is never taken for a run
    companion = layers_path(second)
    companion.write_text("epoch,iteration,module,category,bytes\n")
    os.utime(companion, ns=(3_000_000_000_000_000_000, 3_000_000_000_000_000_000))
    assert newest_run(tmp_path) == first
    assert find_run(None, tmp_path) == first
    assert find_run(tmp_path, "elsewhere") == first
    assert find_run(second, "elsewhere") == second


def test_no_runs(tmp_path):
    with pytest.raises(RunFileError, match="no folder"):
        newest_run(tmp_path / "missing")
    with pytest.raises(RunFileError, match=r"no memory_stats_\*\.csv file"):
        newest_run(tmp_path)


def test_layers_file_is_read_when_present(tmp_path):
    path, _ = profile_tiny_model(tmp_path, by_layer=True)
    raw = pd.read_csv(layers_path(path))
    run = load_run(path)
    assert run.layers is not None
    assert len(run.layers) == len(raw)
    assert list(run.layers["bytes"]) == list(raw["bytes"])
    assert list(run.layers["category"]) == list(raw["category"])
    # the model's own forward has the empty module name: it reads back as "(model)"
    assert list(run.layers["module"]) == list(raw["module"].fillna("(model)"))
    if can_chain():
        assert "(model)" in set(run.layers["module"]) and "norm" in set(run.layers["module"])
    else:  # torch < 2.8 measures no feature maps by layer: the file holds its header alone
        assert raw.empty and run.layers.empty


def test_bad_layers_file_is_a_warning_not_an_error(tmp_path):
    path, _ = profile_tiny_model(tmp_path)
    layers_path(path).write_text("epoch,iteration,what\n1,2,3\n")
    run = load_run(path)
    assert run.layers is None
    assert len(run.warnings) == 1 and "missing column(s) module, category" in run.warnings[0]
    assert len(run.records) == 4


def test_tiny_net_layer_sizes_differ():
    # the CLI tests rely on one largest layer
    sizes = {}
    for name, nbytes in param_bytes(TinyNet()).items():
        sizes[module_of(name)] = sizes.get(module_of(name), 0) + nbytes
    assert max(sizes, key=sizes.get) == "encoder"
    assert sorted(sizes.values())[-1] > sorted(sizes.values())[-2]


# -- the device's size and the peak's breakdown (newer files) ------------------------------
@pytest.mark.parametrize("units", ["KB", "MiB", "B"])
def test_device_total_and_peak_columns_come_back_in_bytes(tmp_path, units):
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES

    from .peak_columns import add_peak_columns

    path, model = profile_tiny_model(tmp_path, units=units)
    total = 16_000_000_000 if units != "MiB" else 16 * 2**30
    expected = add_peak_columns(path, device_total=total)
    run = load_run(path)
    assert run.has_peak_breakdown
    assert run.device_total == total
    for category in PEAK_CATEGORIES:
        # bytes again, exactly, whatever the unit the file was written in
        assert list(run.records[f"peak_{category}"]) == list(expected[category].astype(float))
    parts = run.records[[f"peak_{c}" for c in PEAK_CATEGORIES]].sum(axis=1)
    assert list(parts) == list(run.records["iteration_peak_allocated"])
    # peak_share is a fraction, read as it is, not multiplied by the unit
    assert list(run.records["peak_share"]) == pytest.approx(list(expected["peak"] / total), rel=1e-12)
    assert (run.records["peak_share"] < 1).all()
    # the new columns come after the parameters' and are not mistaken for parameters
    assert run.parameters == list(param_bytes(model))


def test_older_files_have_no_breakdown_and_no_device_size(tmp_path):
    from .peak_columns import add_peak_columns

    old, _ = profile_tiny_model(tmp_path / "old")
    run = load_run(old)
    assert not run.has_peak_breakdown and run.device_total is None
    assert run.records["peak_activations"].isna().all()
    assert run.records["peak_share"].isna().all()

    # the columns present but empty: not measured (a CPU run, a version that did not measure)
    empty, _ = profile_tiny_model(tmp_path / "empty")
    add_peak_columns(empty, device_total=None, shares=None)
    assert "peak_activations" in pd.read_csv(empty)
    run = load_run(empty)
    assert not run.has_peak_breakdown and run.device_total is None
