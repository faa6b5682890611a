"""The CPU counter's fast paths (one new result, several new results, views, in-place) stay exact.

Each figure is checked against bytes computed apart from the counter: ``nbytes()`` of the unique
storages of the results, or the sizes the test itself asked for.
"""

from __future__ import annotations

import gc

import pytest
import torch

from pytorch_mem_profiler.measure import storage_counting
from pytorch_mem_profiler.measure.devices import CpuCounter

from .helpers import grown
from .helpers import unique_storage_bytes as storage_bytes

aten = torch.ops.aten


def test_each_kind_of_operator_takes_the_path_its_plan_names():
    """The fast paths below are taken: one new result, several new results, nothing to look at."""
    assert storage_counting.return_kinds(aten.mm.default) is storage_counting._ONE_NEW
    for several in (aten.max.dim, aten.sort.default, aten.native_layer_norm_backward.default):
        assert storage_counting.return_kinds(several) in storage_counting._ALL_NEW
    assert storage_counting.return_kinds(aten.sort.values) not in storage_counting._ALL_NEW  # out=: resized
    for nothing in (aten.t.default, aten.add_.Tensor, aten.detach.default, aten.unbind.int):
        assert storage_counting.return_kinds(nothing) is None


def test_several_new_results_are_each_counted_and_each_subtracted_when_they_die(counter):
    x = torch.randn(50, 40)
    base = counter.read().allocated
    values, indices = torch.sort(x, dim=1)  # float32 and int64, 2000 elements each
    top = torch.topk(x, 5, dim=0)
    assert grown(counter, base) == storage_bytes(values, indices, top.values, top.indices)
    assert grown(counter, base) == 2000 * 4 + 2000 * 8 + 200 * 4 + 200 * 8
    del values, top
    gc.collect()
    assert grown(counter, base) == storage_bytes(indices) == 2000 * 8
    del indices
    gc.collect()
    assert grown(counter, base) == 0


def test_several_results_with_none_among_them_count_the_tensors(counter):
    """native_layer_norm_backward returns None for the gradients not asked for."""
    x, w, b = torch.randn(16, 32), torch.randn(32), torch.randn(32)
    out, mean, rstd = aten.native_layer_norm.default(x, [32], w, b, 1e-5)
    grad_out = torch.ones_like(out)
    base = counter.read().allocated
    grad_x, grad_w, grad_b = aten.native_layer_norm_backward.default(
        grad_out, x, [32], mean, rstd, w, b, [True, False, True]
    )
    assert grad_w is None
    assert grown(counter, base) == storage_bytes(grad_x, grad_b) == 16 * 32 * 4 + 32 * 4
    del grad_x, grad_b
    gc.collect()
    assert grown(counter, base) == 0


def test_a_result_that_is_an_input_storage_is_not_counted_twice(counter):
    """An operator planned as new may hand back a storage already counted (here: lift_fresh)."""
    x = torch.empty(300)
    base = counter.read().allocated
    same = aten.lift_fresh.default(x)
    assert same.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert grown(counter, base) == 0


def test_views_and_in_place_results_count_nothing_and_keep_their_storage_counted_once(counter):
    base = counter.read().allocated
    x = torch.randn(64, 32)  # the one new storage
    views = [x.t(), x.view(-1), x[1:5], *x.unbind(0), *x.split(8), x.detach(), x.transpose(0, 1)]
    x.add_(1).mul_(0.5).clamp_(-1, 1)
    views[0].relu_()
    assert grown(counter, base) == storage_bytes(x, *views) == 64 * 32 * 4
    del x
    gc.collect()
    assert grown(counter, base) == 64 * 32 * 4  # the views keep the storage alive
    views.clear()
    gc.collect()
    assert grown(counter, base) == 0


def test_out_variants_of_several_results_and_of_one_change_a_counted_storage(counter):
    x = torch.randn(30, 10)
    base = counter.read().allocated
    values, indices = torch.empty(0), torch.empty(0, dtype=torch.long)
    torch.sort(x, dim=1, out=(values, indices))  # both grow from 0 bytes
    assert grown(counter, base) == storage_bytes(values, indices) == 300 * 4 + 300 * 8
    total = torch.empty(0)
    torch.mm(x, x.t(), out=total)  # grows to 30 x 30
    assert grown(counter, base) == storage_bytes(values, indices, total) == 300 * 12 + 900 * 4
    torch.add(total, 1.0, out=total)  # the same size: nothing changes
    assert grown(counter, base) == storage_bytes(values, indices, total)
    del values, indices, total
    gc.collect()
    assert grown(counter, base) == 0


def test_a_storage_freed_inside_an_operator_is_subtracted_where_it_died(counter):
    """set_ drops the tensor's old storage inside the operator: its bytes go, in order."""
    base = counter.mark().allocated
    x = torch.empty(2500)  # +10,000: the peak
    small = torch.empty(10)  # +40
    x.set_(small.untyped_storage(), 0, (10,))  # the 10,000 bytes die inside set_
    assert x.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    reading = counter.mark()
    assert reading.allocated - base == storage_bytes(x, small) == 40
    assert reading.peak_allocated - base == 10_040


def test_the_keyed_log_holds_every_change_of_the_fast_paths_in_order(counter):
    """While the peak's make-up is wanted, each change is also logged with its storage."""
    x = torch.randn(20, 10)
    counter.read()
    alive, keyed = counter.watch_storages()
    try:
        assert counter.storage_ref(x) in alive and alive[counter.storage_ref(x)] == storage_bytes(x)
        y = torch.mm(x, x.t())  # one new result
        values, indices = torch.max(x, dim=0)  # several
        view = y.t()  # nothing
        del values
        gc.collect()
        changes = [delta for _, delta in keyed]
        assert changes == [20 * 20 * 4, 10 * 4, 10 * 8, -10 * 4]
        refs = [ref for ref, _ in keyed]
        assert refs[0] is counter.storage_ref(y) and refs[2] is counter.storage_ref(indices)
        assert refs[1] is refs[3]  # the values' storage: counted, then gone
        assert sum(changes) == counter.read().allocated - sum(alive.values()) == storage_bytes(y, indices)
        del view
    finally:
        counter.unwatch_storages()
    z = torch.empty(5)
    assert len(keyed) == 4  # no longer logged once unwatched
    del z


def test_a_fault_in_the_fast_path_of_several_results_never_breaks_the_operator(monkeypatch, caplog):
    registry = storage_counting.shared_registry()
    counter = CpuCounter()
    counter.start()
    x = torch.randn(8, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated counting bug")

    monkeypatch.setattr(registry, "add", broken)
    try:
        values, indices = torch.max(x, dim=1)
    finally:
        counter.stop()
        monkeypatch.undo()
    assert torch.equal(values, x.max(dim=1).values) and torch.equal(indices, x.argmax(dim=1))
    assert any("CPU storage counter failed" in r.getMessage() for r in caplog.records)
