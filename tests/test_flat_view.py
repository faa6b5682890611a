"""One flat view of a record (``stats.flat_metrics``): the CSV row, TensorBoard's scalars and the
frameworks' logger metrics are all made from it, and agree figure by figure."""

from __future__ import annotations

import dataclasses
import io

import pandas as pd
import pytest
import torch

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.integrations._common import LOGGED_FIGURES, logger_metrics
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.outputs.export import EXTRA_COLUMNS, SEED_COLUMNS, record_columns, record_row
from pytorch_mem_profiler.outputs.tensorboard import SCALARS, log_record, scalar_tag
from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PLAIN_METRICS, IterationRecord, flat_metrics
from pytorch_mem_profiler.units import UNITS


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.calls.append((tag, scalar_value, global_step))

    def at(self, step: int) -> dict[str, float]:
        return {tag: value for tag, value, s in self.calls if s == step}


def column(figure: str) -> str:
    return SEED_COLUMNS.get(figure, figure)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real per-layer run, every iteration reported, with its CSV file and TensorBoard scalars;
    and one record with the figures a CPU run lacks (the device's), set by hand."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    writer = FakeWriter()
    folder = tmp_path_factory.mktemp("csv")
    records = []
    with memory_profiler(
        model, 1, csv=True, csv_dir=folder, stream=io.StringIO(), units="KB", tensorboard=writer,
        by_layer=True, strict=True, overhead=None,  # every iteration measured in full
    ) as profiler:
        for _ in range(3):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(profiler.record_stats())
        csv_path = profiler.csv_path
    names = list(records[0].weights_by_name)
    device_figures = dataclasses.replace(
        records[-1], step=99, current_cached=3_000_000, device_used=10**9, process_used=5 * 10**8,
        outside_pytorch=123_456, device_total=8 * 10**9, rank=1, ddp_gradient_buckets=4096,
        fsdp_gathered_parameters=777,
    )
    return model, records, device_figures, names, writer, pd.read_csv(csv_path)


def test_the_flat_view_holds_the_records_bytes(run):
    model, records, _, _, _, _ = run
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for record in records:
        flat = flat_metrics(record)
        assert flat["weights"] == weights
        assert flat["gradients"] == weights  # each gradient the size of its parameter
        assert flat["fragmentation"] == record.current_cached - record.allocated
        # what was alive at the peak, by category, sums to the peak
        assert sum(flat[f"peak_{c}"] for c in PEAK_CATEGORIES) == record.iteration_peak_allocated
        assert flat["forward_peak_allocated"] == record.phases["forward"].peak_allocated
        if can_chain():  # feature maps by layer: torch 2.8 or later
            assert flat["layers_total_feature_maps"] == record.layers.total > 0
        else:
            assert record.layers is None and flat["layers_total_feature_maps"] is None


def test_every_figure_of_the_flat_view_has_a_csv_column():
    flat = flat_metrics(IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0))
    assert {column(figure) for figure in flat} == set(record_columns([])) - {"unit"}
    assert set(EXTRA_COLUMNS) - {"unit"} <= set(flat)
    assert PLAIN_METRICS <= set(flat)


def test_csv_tensorboard_and_loggers_agree_figure_by_figure(run):
    _, records, device_figures, names, writer, frame = run
    div = UNITS["KB"]
    for record in [*records, device_figures]:
        flat = flat_metrics(record)
        row = record_row(record, names, "KB")
        for figure, value in flat.items():  # the CSV row: every figure, amounts in the unit
            expected = value if value is None or figure in PLAIN_METRICS else value / div
            assert row[column(figure)] == expected, figure
        scalars = writer.at(record.step) if record is not device_figures else _scalars(record)
        logged = {scalar_tag(f, "KB"): f for f in SCALARS if flat[f] is not None}
        assert set(scalars) == set(logged)  # a figure not known is left out, never sent as 0
        for tag, figure in logged.items():
            assert scalars[tag] == row[column(figure)], tag
        for separator in ("/", "."):
            metrics = logger_metrics(record, "KB", "memory", separator)
            for figure, key in LOGGED_FIGURES:
                name = f"memory{separator}{key}" + ("" if figure in PLAIN_METRICS else "_KB")
                if flat[figure] is None:
                    assert name not in metrics
                else:
                    assert metrics[name] == row[column(figure)], name
            assert len(metrics) == sum(flat[f] is not None for f, _ in LOGGED_FIGURES)
    # the device's figures reach all three where a device knows them
    assert _scalars(device_figures)["memory_KB/outside_pytorch"] == 123.456
    assert logger_metrics(device_figures, "KB")["memory/peak_share"] == pytest.approx(
        device_figures.iteration_peak_allocated / 8e9
    )
    # and the file on disk holds what TensorBoard was sent
    for (_, line), record in zip(frame.iterrows(), records):
        for tag, value in writer.at(record.step).items():
            figure = next(f for f in SCALARS if scalar_tag(f, "KB") == tag)
            assert line[column(figure)] == pytest.approx(value), tag


def _scalars(record: IterationRecord) -> dict[str, float]:
    writer = FakeWriter()
    log_record(writer, record, "KB")
    return writer.at(record.step)
