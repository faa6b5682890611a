"""The report made from kept text (ReportFormatter, ReportSink) is the text made afresh, byte for byte.

The reference is :func:`format_record` with the report module's caches emptied
before each call; every record is formatted in every layout and several units,
and the kept text must follow every change of every field of the record.
"""

from __future__ import annotations

import dataclasses
import io
from types import MappingProxyType as MP

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.outputs import report
from pytorch_mem_profiler.outputs.report import REPORT_MODES, ReportFormatter, format_record
from pytorch_mem_profiler.outputs.sinks import ReportSink
from pytorch_mem_profiler.stats import ACTIVATIONS, INPUT, IterationRecord, LayerFeatureMaps, PhaseStats

UNITS = ("B", "MB", "GiB")


def fresh(record: IterationRecord, unit: str = "MB", mode: str = "full") -> str:
    """The text made with nothing kept from an earlier record."""
    for cached in (report._line, report._rows, report._width):
        cached.cache_clear()
    return format_record(record, unit, mode)


def _layers(extra: int = 0) -> LayerFeatureMaps:
    return LayerFeatureMaps(
        by_module=MP({("0", ACTIVATIONS): 4_000_000 + extra, ("2", ACTIVATIONS): 4_000_000, ("4", ACTIVATIONS): 3_000_000,
                      ("4", "weight copies"): 500_000, (INPUT, ACTIVATIONS): 1_000_000}),
        calls=MP({"0": 1, "2": 1, "4": 2}),
        total=11_500_000 + extra,
        inputs=1_000_000,
        unattributed=2_000_000,
    )


def _rich(**changes: object) -> IterationRecord:
    """A record with every field set, so that every figure is printed somewhere."""
    base = dict(
        epoch=2, iteration=7, step=17, device="cuda:0", allocated=600_000_000, peak_allocated=900_000_000,
        iteration_peak_allocated=800_000_000, peak_phase="backward", peak_cached=1_000_000_000,
        current_cached=950_000_000, feature_maps=300_000_000, intermediate_gradients=30_000_000,
        weights=100_000_000, weights_by_name=MP({"0.weight": 60_000_000, "0.bias": 40_000_000}),
        gradients=100_000_000, gradients_by_name=MP({"0.weight": 60_000_000, "0.bias": 40_000_000}),
        optimizer_state=200_000_000, buffers=1_000, forward_passes=1, backward_passes=1, optimizer_steps=1,
        iteration_time_s=0.0123, phases=MP({"forward": PhaseStats(500, 600)}), peak_location="2", layers=_layers(),
        device_used=2_000_000_000, process_used=1_500_000_000, outside_pytorch=1_050_000_000,
        device_total=80_000_000_000,
        peak_breakdown=MP({"weights": 100_000_000, "gradients": 100_000_000, "optimizer_state": 200_000_000,
                           "activations": 350_000_000, "activation_gradients": 30_000_000, "inputs": 1_000_000,
                           "other": 19_000_000}),
        peak_layers=MP({"0": 150_000_000, "2": 120_000_000, "4": 80_000_000}), peak_transient=5_000_000,
        peak_other_before=9_000_000, peak_step_temporaries=2_000_000, model_name="Net",
        peak_transient_in="2", ddp_gradient_buckets=25_000_000, fsdp_gathered_parameters=7_000_000, rank=3,
        reported=True,
    )
    base.update(changes)
    return IterationRecord(**base)  # type: ignore[arg-type]


def _other(name: str, value: object) -> object:
    """A different value for field ``name`` of the same type."""
    if name == "layers":
        return _layers(extra=5_000_000)
    if name == "phases":
        return MP({"forward": PhaseStats(500, 700), "backward": PhaseStats(900, 1_000)})
    if name == "peak_phase":
        return "forward"
    if name == "overhead_budget":
        return 0.05
    if name == "detail":
        return "light"
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return value + "1"
    if isinstance(value, float):
        return value * 3 + 0.5
    if isinstance(value, int):
        return value + 7_000_000
    if isinstance(value, MP):
        first = next(iter(value))
        return MP({**value, first: value[first] + 7_000_000})
    raise AssertionError(f"no other value for {name}={value!r}")


def test_every_field_changed_gives_the_fresh_text_in_every_layout_and_unit():
    base = _rich()
    changed_full = set()
    for field in dataclasses.fields(IterationRecord):
        other = _rich(**{field.name: _other(field.name, getattr(base, field.name))})
        for unit in UNITS:
            for mode in REPORT_MODES:
                formatter = ReportFormatter()
                assert formatter(base, unit, mode) == fresh(base, unit, mode)
                assert formatter(other, unit, mode) == fresh(other, unit, mode), (field.name, unit, mode)
                assert formatter(base, unit, mode) == fresh(base, unit, mode), (field.name, unit, mode)
        if fresh(other) != fresh(base):
            changed_full.add(field.name)
    # the perturbations reach the text: every printed figure shows its change (no stale text passes unseen)
    printed = {f.name for f in dataclasses.fields(IterationRecord)} - {
        "step", "rank", "reported", "phases", "backward_passes", "optimizer_steps", "peak_transient",
        "peak_transient_in", "forward_passes",
        "model_name",  # printed only for the model's own forward's saved activations, which _rich has none of
        "overhead_budget",  # printed on "light" records only (tests/test_budget.py)
    }
    assert printed <= changed_full, printed - changed_full


def test_a_sequence_of_changing_records_gives_the_fresh_text_each_time():
    empty = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=1_000_000,
                            weights_by_name=MP({"w": 1_000_000}), weights=1_000_000, gradients=None, optimizer_state=None)
    steps = [
        empty,
        dataclasses.replace(empty, iteration=2, gradients=1_000_000, gradients_by_name=MP({"w": 1_000_000})),
        dataclasses.replace(empty, iteration=3, gradients=1_000_000, gradients_by_name=MP({"w": 1_000_000}),
                            optimizer_state=2_000_000),
        dataclasses.replace(empty, iteration=4, iteration_peak_allocated=5_000_000, peak_allocated=5_000_000),
        dataclasses.replace(empty, iteration=5, iteration_peak_allocated=6_000_000, peak_allocated=6_000_000),
        _rich(iteration=6),
        _rich(iteration=7, layers=None, peak_breakdown=None),
        _rich(iteration=8, device_total=None, device_used=None),
        _rich(iteration=9, iteration_time_s=None),
        dataclasses.replace(empty, iteration=10, epoch=2),
        dataclasses.replace(empty, iteration=10, epoch=2),
    ]
    for unit in UNITS:
        for mode in REPORT_MODES:
            formatter = ReportFormatter()
            texts = [formatter(r, unit, mode) for r in steps]
            assert texts == [fresh(r, unit, mode) for r in steps]
            assert len(set(texts)) == len(steps) - 1  # only the last two records are alike


def test_a_mapping_changed_in_place_is_not_served_from_the_kept_text():
    sizes = {"w": 1_000_000, "b": 2_000}
    record = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0, weights=1_002_000,
                             weights_by_name=MP(sizes))
    formatter = ReportFormatter()
    before = formatter(record)
    sizes["w"] = 3_000_000  # the view the record holds now shows another size
    after = formatter(record)
    assert after == fresh(record) != before
    assert [line for line in after.splitlines() if line.startswith("  w.")] == [report.dotted_line("  w", "3 MB")]


def _real_records(by_layer: bool) -> list[IterationRecord]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())])
    optimizer = torch.optim.Adam(model.parameters())
    with MemoryProfiler(model, 1, stream=io.StringIO(), optimizer=optimizer, by_layer=by_layer) as prof:
        for i in range(5):  # gradients appear at the second step, the optimizer's state at the third
            loss = model(torch.randn(4, 16)).square().mean()
            if i >= 1:
                loss.backward()
            if i >= 2:
                optimizer.step()
            optimizer.zero_grad()
            prof.record_stats()
        return list(prof.records)


@pytest.mark.parametrize("by_layer", [False, True])
def test_the_sink_writes_the_fresh_text_of_a_real_run(by_layer):
    records = _real_records(by_layer)
    assert [bool(r.gradients) for r in records] == [False, True, True, True, True]
    assert [bool(r.optimizer_state) for r in records] == [False, False, True, True, True]
    for mode in REPORT_MODES:
        out = io.StringIO()
        sink = ReportSink(lambda: out, units="KB", prefix="[rank 1] ", mode=mode)
        for record in records:
            sink.on_record(record)
            assert sink.last_report == fresh(record, "KB", mode)
        expected = "".join(
            "\n".join("[rank 1] " + line for line in fresh(r, "KB", mode).split("\n")) + "\n" for r in records
        )
        assert out.getvalue() == expected


def test_the_sink_follows_a_change_of_units_or_layout():
    out = io.StringIO()
    sink = ReportSink(lambda: out, units="MB")
    record = _rich()
    sink.on_record(record)
    sink.units = "GiB"
    sink.on_record(record)
    sink.mode = "line"
    sink.on_record(record)
    assert out.getvalue() == fresh(record, "MB") + "\n" + fresh(record, "GiB") + "\n" + fresh(record, "GiB", "line") + "\n"
