"""``memory_profiler(..., tensorboard=writer)``: each reported record's figures as scalars."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.outputs.tensorboard import MEMORY_FIGURES


class FakeWriter:
    """Records add_scalar calls as (tag, value, step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.calls.append((tag, scalar_value, global_step))

    def at(self, step: int) -> dict[str, float]:
        return {tag: value for tag, value, s in self.calls if s == step}


def train(profiler, model, optimizer, iterations):
    records = []
    for _ in range(iterations):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        records.append(profiler.record_stats())
    return records


def test_reported_records_become_scalars():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    writer = FakeWriter()
    with memory_profiler(
        model, 2, stream=io.StringIO(), units="KB", tensorboard=writer, strict=True
    ) as profiler:
        records = train(profiler, model, optimizer, 4)
        profiler.epoch_end()
        records += train(profiler, model, optimizer, 2)

    # only the reported iterations (every 2nd), at their step
    assert sorted({step for _, _, step in writer.calls}) == [2, 4, 6]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for record in (records[1], records[3], records[5]):
        logged = writer.at(record.step)
        assert logged["memory_KB/weights"] == weights / 1000
        assert logged["memory_KB/gradients"] == weights / 1000
        for name in MEMORY_FIGURES:
            value = getattr(record, name)
            if value is None:  # unknown on this device (outside_pytorch on CPU): not logged
                assert f"memory_KB/{name}" not in logged, name
            else:
                assert logged[f"memory_KB/{name}"] == value / 1000, name
        assert "memory_KB/outside_pytorch" not in logged
        assert logged["time/iteration_s"] == record.iteration_time_s
        assert logged["progress/epoch"] == record.epoch
    assert writer.at(6)["progress/epoch"] == 2
    # Adam's state: two float32 moments per weight plus a step count per parameter
    assert writer.at(4)["memory_KB/optimizer_state"] >= 2 * weights / 1000


def test_unknown_figures_are_left_out():
    from pytorch_mem_profiler.stats import IterationRecord
    from pytorch_mem_profiler.outputs.tensorboard import log_record

    writer = FakeWriter()
    log_record(
        writer,
        IterationRecord(
            epoch=1,
            iteration=1,
            step=7,
            device="mps",
            allocated=2**20,
            peak_allocated=None,
            intermediate_gradients=None,
        ),
        "MiB",
    )
    logged = writer.at(7)
    assert logged["memory_MiB/allocated"] == 1.0
    assert "memory_MiB/peak_allocated" not in logged
    assert "memory_MiB/intermediate_gradients" not in logged
    assert "time/iteration_s" not in logged


def test_a_writer_without_add_scalar_is_refused():
    with pytest.raises(TypeError, match="tensorboard must be a writer with add_scalar.*got str"):
        memory_profiler(torch.nn.Linear(2, 2), tensorboard="runs/")


def test_a_failing_writer_never_stops_training(caplog):
    class Broken:
        calls = 0

        def add_scalar(self, *args, **kwargs):
            Broken.calls += 1
            raise OSError("disk full")

    model = torch.nn.Linear(32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        with memory_profiler(model, 1, stream=io.StringIO(), tensorboard=Broken()) as profiler:
            records = train(profiler, model, optimizer, 3)
    assert all(r is not None for r in records)
    assert Broken.calls == 1  # switched off after the first fault
    assert sum("tensorboard failed" in r.getMessage() for r in caplog.records) == 1

    with memory_profiler(
        model, 1, stream=io.StringIO(), tensorboard=Broken(), strict=True
    ) as profiler:
        with pytest.raises(OSError, match="disk full"):
            train(profiler, model, optimizer, 1)


def test_real_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = torch.nn.Linear(32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = SummaryWriter(log_dir=str(tmp_path))
    with memory_profiler(
        model, 1, stream=io.StringIO(), units="B", tensorboard=writer, strict=True
    ) as profiler:
        records = train(profiler, model, optimizer, 3)
    writer.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    weights = events.Scalars("memory_B/weights")
    assert [e.step for e in weights] == [1, 2, 3]
    assert [e.value for e in weights] == [float((32 * 4 + 4) * 4)] * 3
    allocated = events.Scalars("memory_B/allocated")
    assert [e.value for e in allocated] == pytest.approx([float(r.allocated) for r in records])
