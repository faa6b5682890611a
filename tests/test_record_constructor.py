"""``IterationRecord`` is made by its constructor, fields named: a misspelt field is a TypeError,
never a silent attribute; the meter's records carry exactly the record's fields."""

from __future__ import annotations

import dataclasses
import inspect
import io

import pytest
import torch

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.stats import IterationRecord


def test_the_constructor_has_the_dataclass_signature():
    params = inspect.signature(IterationRecord).parameters
    fields = dataclasses.fields(IterationRecord)
    assert list(params) == [f.name for f in fields]
    for f in fields:
        default = params[f.name].default
        if f.default is not dataclasses.MISSING:
            assert default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert default == f.default_factory(), f.name
        else:
            assert default is inspect.Parameter.empty, f.name


def test_a_misspelt_or_missing_field_is_a_type_error():
    with pytest.raises(TypeError, match="featuer_maps"):
        IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0, featuer_maps=3)
    with pytest.raises(TypeError, match="allocated"):
        IterationRecord(epoch=1, iteration=1, step=1, device="cpu")


def test_a_record_is_frozen_and_compares_by_its_fields():
    record = IterationRecord(1, 2, 3, "cpu", 4_000, feature_maps=1_024)  # positionally, as before
    assert (record.epoch, record.iteration, record.step, record.allocated, record.feature_maps) == (1, 2, 3, 4_000, 1_024)
    assert record.gradients == 0 and record.peak_allocated is None and dict(record.phases) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.allocated = 5  # type: ignore[misc]
    changed = dataclasses.replace(record, allocated=5_000)
    assert changed.allocated == 5_000 and changed != record
    assert dataclasses.replace(changed, allocated=4_000) == record
    assert "feature_maps=1024" in repr(record)


@pytest.mark.parametrize("print_period", [1, 3])
def test_the_meters_records_carry_exactly_the_records_fields(print_period):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {f.name for f in dataclasses.fields(IterationRecord)}
    records = []
    with memory_profiler(model, print_period, stream=io.StringIO(), by_layer=True, strict=True) as profiler:
        for _ in range(6):
            model(torch.randn(4, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(profiler.record_stats())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for record in records:
        assert set(vars(record)) == names
        assert record.weights == weights
        assert record == dataclasses.replace(record)  # what the constructor makes of its own fields
    assert {r.reported for r in records} == ({True} if print_period == 1 else {True, False})
    assert all(r.gradients == weights for r in records if r.reported)
