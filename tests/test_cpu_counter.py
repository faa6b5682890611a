"""The CPU counter's per-operator decisions stay exact: new storages, views, in-place, out=, lists."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from pathlib import Path

import pytest
import torch

from pytorch_mem_profiler.measure import storage_counting
from pytorch_mem_profiler.measure.devices import CpuCounter

from .helpers import grown
from .helpers import unique_storage_bytes as storage_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_operators_with_several_returns_count_each_new_storage(counter):
    x = torch.randn(64, 32)
    base = counter.read().allocated
    values, indices = torch.max(x, dim=1)  # float32 and int64 results
    out, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], None, None, 1e-5)
    assert grown(counter, base) == storage_bytes(values, indices, out, mean, rstd) == 64 * 4 + 64 * 8 + 64 * 32 * 4 + 2 * 64 * 4


def test_list_returns_count_new_storages_and_skip_views(counter):
    xs = [torch.randn(100), torch.randn(30)]
    base = counter.read().allocated
    pieces = torch.randn(90).split(30)  # one new storage (randn), three views of it
    summed = torch._foreach_add(xs, 1.0)  # two new storages
    assert grown(counter, base) == 90 * 4 + storage_bytes(*summed) == 90 * 4 + 130 * 4
    del pieces, summed
    gc.collect()
    assert grown(counter, base) == 0


def test_in_place_and_views_count_nothing(counter):
    x = torch.zeros(1000)
    base = counter.read().allocated
    x.add_(1).mul_(2)
    y = x.view(10, 100).t()[3:]
    torch.ops.aten.detach.default(x)
    assert grown(counter, base) == 0
    del y


def test_out_variants_and_resize_change_a_counted_storage(counter):
    base = counter.read().allocated
    out = torch.empty(0)
    torch.add(torch.ones(10), torch.ones(10), out=out)  # out= grows the storage to 40 bytes
    assert grown(counter, base) == storage_bytes(out) == 40
    out.resize_(250)
    assert grown(counter, base) == storage_bytes(out) == 1000
    del out
    gc.collect()
    assert grown(counter, base) == 0


def test_a_tensor_literal_and_a_clone_are_new(counter):
    base = counter.read().allocated
    literal = torch.tensor([1.0, 2.0, 3.0])
    copy = literal.clone()
    assert grown(counter, base) == storage_bytes(literal, copy) == 24


def test_the_peak_between_two_marks_follows_the_order_of_events(counter):
    base = counter.mark().allocated
    a = torch.empty(1000)  # +4000
    b = torch.empty(500)  # +2000: 6000 above base, the peak
    del a  # -4000
    c = torch.empty(700)  # +2800: 4800
    reading = counter.mark()
    assert reading.peak_allocated - base == 6000
    assert reading.allocated - base == storage_bytes(b, c) == 4800


def test_a_storage_freed_on_another_thread_is_subtracted(counter):
    base = counter.read().allocated
    box = [torch.empty(2500)]
    assert grown(counter, base) == 10_000
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert grown(counter, base) == 0


def test_two_counters_count_only_what_each_saw(counter):
    before_second = torch.empty(100)
    second = CpuCounter()
    second.start()
    try:
        first_base, second_base = counter.read().allocated, second.read().allocated
        both = torch.empty(300)
        assert grown(counter, first_base) == grown(second, second_base) == 1200
        second.adopt([before_second, before_second])
        assert grown(second, second_base) == 1600
        assert grown(counter, first_base) == 1200  # adopting into one leaves the other as it was
        del before_second, both
        gc.collect()
        assert grown(second, second_base) == 0
        assert grown(counter, first_base) == -400
    finally:
        second.stop()


def test_a_fault_while_counting_never_breaks_the_operator(monkeypatch, caplog):
    registry = storage_counting.shared_registry()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated counting bug")

    counter = CpuCounter()
    counter.start()
    monkeypatch.setattr(registry, "add", broken)
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        x = torch.ones(4) * 3
        y = torch.ones(4) + 1
    counter.stop()
    assert x.tolist() == [3.0] * 4 and y.tolist() == [2.0] * 4
    faults = [r for r in caplog.records if "CPU storage counter failed" in r.getMessage()]
    assert len(faults) == 1 and "simulated counting bug" in faults[0].getMessage()
    monkeypatch.undo()
    fresh = CpuCounter()  # the next counter counts again
    fresh.start()
    try:
        base = fresh.read().allocated
        z = torch.empty(10)
        assert grown(fresh, base) == storage_bytes(z) == 40
    finally:
        fresh.stop()


def test_operator_plans_are_made_once_and_views_need_no_storage_lookup():
    aten = torch.ops.aten
    assert storage_counting._plan(aten.view.default) is None
    assert storage_counting._plan(aten.add_.Tensor) is None
    assert storage_counting._plan(aten.split.Tensor) is None
    assert storage_counting._plan(aten._local_scalar_dense.default) is None  # item(): a Python number
    assert storage_counting._plan(aten.is_nonzero.default) is None
    assert storage_counting._plan(aten.mm.default) is storage_counting._ONE_NEW
    assert storage_counting._plan(aten.add.out) == (storage_counting._RESIZED,)
    assert storage_counting._plan(aten.resize_.default) == (storage_counting._RESIZED,)
    assert storage_counting._plan(aten.max.dim) == (storage_counting._NEW, storage_counting._NEW)
    assert storage_counting._plan(aten.lift_fresh.default) == (storage_counting._NEW,)


def test_compiled_code_under_the_counter_compiles_none_of_the_counter_and_is_counted(counter):
    """The counting mode has no Dynamo-disabling wrapper: Dynamo must still leave its handler alone.

    Under an active dispatch mode, recent torch runs the compiled function's frame eagerly (no
    graph); torch 2.4 compiles it. Either way no graph holds anything but the function's own three
    operators (none of the counter's Python), Dynamo converts no frame but the function's (the
    handler's frames, which it would compile while the mode is off the stack inside it, broke
    into graphs at ``func._op`` and kept tensors alive), and what the result holds is counted."""
    from torch._dynamo.utils import counters

    counters.clear()
    graphs: list[list] = []

    def backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op in ("call_function", "call_method")])
        return gm.forward

    @torch.compile(backend=backend)
    def f(x):
        return (x.sin() + 1).relu()

    x = torch.randn(64)
    base = counter.read().allocated
    out = f(x)
    assert torch.equal(out, (x.sin() + 1).relu())
    for targets in graphs:
        assert len(targets) == 3 and targets[0] == "sin" and targets[2] == "relu", targets
    assert counters["frames"]["total"] <= 1, dict(counters["frames"])
    assert not counters["graph_break"] and not counters["unimplemented"], (dict(counters["graph_break"]), dict(counters["unimplemented"]))
    assert grown(counter, base) == storage_bytes(out)  # the intermediates died, the result lives


def test_the_cpu_overhead_benchmark_runs(tmp_path):
    import cpu_overhead

    before = torch.get_num_threads()
    rows = cpu_overhead.main(["--quick", "--rounds", "2", "--out", str(tmp_path)])
    assert torch.get_num_threads() == before
    assert {(r.workload, r.variant) for r in rows} == {
        (w, v) for w in ("cpu_mlp", "small_cnn") for v in cpu_overhead.VARIANTS
    }
    for row in rows:
        assert len(row.ratios) == 2 and all(r > 0 for r in row.ratios)
        assert row.operators > 50  # forward, backward and Adam, each operator through the mode
    goals = {(r.workload, r.variant): r.goal for r in rows}
    assert goals[("cpu_mlp", "profiler, print_period=1")] == 1.25
    assert goals[("cpu_mlp", "profiler by_layer, print_period=10")] == 1.15
    assert goals[("small_cnn", "profiler, print_period=1")] == 1.05
    assert goals[("cpu_mlp", "bare dispatch mode (the floor)")] is None
    text = (tmp_path / "cpu_overhead.md").read_text()
    assert "| cpu_mlp | profiler, print_period=1 |" in text
    assert (tmp_path / "cpu_overhead.csv").read_text().count("\n") == len(rows) + 1
