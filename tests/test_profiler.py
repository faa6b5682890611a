"""The profiler on CPU: exact bytes of every figure, the loop API, bad input, faults."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import pytorch_mem_profiler
from pytorch_mem_profiler import IterationRecord, MemoryProfiler, memory_profiler
from pytorch_mem_profiler.measure.devices import CpuCounter

from .helpers import BackwardScratch, ScratchNet, mlp, nbytes, train_step, unique_storage_bytes


def make(model, stream, **kw) -> MemoryProfiler:
    kw.setdefault("strict", True)
    return MemoryProfiler(model, kw.pop("print_period", 1), kw.pop("csv", False), stream=stream, **kw)


def test_star_import_exposes_the_seed_api():
    namespace: dict = {}
    exec("from pytorch_mem_profiler import *", namespace)
    assert namespace["memory_profiler"] is namespace["MemoryProfiler"]
    assert pytorch_mem_profiler.__version__


def test_mlp_weights_gradients_and_feature_maps_by_hand(stream):
    model = mlp(32, 64, 10)
    batch = 16
    with make(model, stream) as profiler:
        train_step(model, None, torch.randn(batch, 32))
        record = profiler.record_stats()
    assert isinstance(record, IterationRecord)
    w1, b1, w2, b2 = (64 * 32 * 4, 64 * 4, 10 * 64 * 4, 10 * 4)
    assert dict(record.weights_by_name) == {"0.weight": w1, "0.bias": b1, "2.weight": w2, "2.bias": b2}
    assert record.weights == w1 + b1 + w2 + b2 == sum(nbytes(p) for p in model.parameters())
    assert dict(record.gradients_by_name) == dict(record.weights_by_name)
    assert record.gradients == record.weights
    # What forward leaves for backward: ReLU's output (saved by ReLU and by the
    # second Linear) and the model's output. The first Linear's output dies
    # once ReLU has used it.
    assert record.feature_maps == batch * 64 * 4 + batch * 10 * 4
    assert record.forward_passes == record.backward_passes == 1


def test_intermediate_gradients_are_what_backward_made_and_holds_at_its_peak(stream):
    x = torch.randn(128, 64)
    model = ScratchNet()
    with make(model, stream, by_layer=True) as profiler:
        output = model(x)
        output.pow(2).mean().backward()
        record = profiler.record_stats()
    # Backward's peak is reached inside BackwardScratch.backward, at `grad * scratch[0]`:
    # alive then and made by backward are the gradient it was handed (128 x 256 float32),
    # its scratch and its result. The weight gradients of `b` count as gradients, and the
    # gradients backward already freed (of the output, of ReLU's output) are not alive.
    hidden = 128 * 256 * 4
    assert record.intermediate_gradients == BackwardScratch.SCRATCH_ELEMS * 4 + 2 * hidden
    assert record.peak_phase == "backward"
    assert record.peak_breakdown["activation_gradients"] == record.intermediate_gradients


def test_intermediate_gradients_are_never_negative(stream):
    model = mlp()
    x = torch.randn(8, 32)
    with make(model, stream, by_layer=True) as profiler:
        train_step(model, None, x)
        per_layer = profiler.record_stats()
        assert per_layer.intermediate_gradients >= 0 and per_layer.detail == "full"
    model.zero_grad(set_to_none=True)
    with make(model, stream) as profiler:  # measured by default too, at the "phases" level
        train_step(model, None, x)
        record = profiler.record_stats()
    assert record.detail == "phases" and record.layers is None
    # the CPU's breakdown sees every storage: module boundaries change nothing
    assert record.intermediate_gradients == per_layer.intermediate_gradients
    assert record.peak_breakdown == per_layer.peak_breakdown


def test_tied_weights_count_once(stream):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, idx):
            return self.head(self.embed(idx))

    model = Tied()
    with make(model, stream) as profiler:
        model(torch.tensor([1, 2, 3])).sum().backward()
        record = profiler.record_stats()
    assert dict(record.weights_by_name) == {"embed.weight": 50 * 8 * 4}
    assert dict(record.gradients_by_name) == {"embed.weight": 50 * 8 * 4}


def test_frozen_layers_have_no_gradient(stream):
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    with make(model, stream) as profiler:
        train_step(model, None, torch.randn(4, 32))
        record = profiler.record_stats()
    assert set(record.gradients_by_name) == {"2.weight", "2.bias"}
    assert record.gradients == nbytes(model[2].weight) + nbytes(model[2].bias)
    assert record.weights == sum(nbytes(p) for p in model.parameters())
    assert "0.weight grad" not in stream.getvalue()


def test_batchnorm_buffers(stream):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    with make(model, stream) as profiler:
        model(torch.randn(2, 3, 8, 8)).mean().backward()
        record = profiler.record_stats()
    bn = model[1]
    assert record.buffers == nbytes(bn.running_mean) + nbytes(bn.running_var) + nbytes(bn.num_batches_tracked)
    assert record.buffers == 8 * 4 * 2 + 8


class LazyPositions(nn.Module):
    """A buffer replaced in forward, as modules keep a cache they build at the first call
    (timm's ConViT: relative positions for the sequence length it sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.register_buffer("positions", torch.zeros(1, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.positions.shape[0] != x.shape[1]:
            self.positions = torch.randn(x.shape[1], 3)
        return x + self.proj(self.positions).sum(-1)


def test_a_buffer_replaced_in_forward_is_counted_at_its_new_size(stream):
    model = nn.Sequential(nn.BatchNorm1d(6), LazyPositions())
    buffers = []
    with make(model, stream) as profiler:
        for _ in range(3):
            model(torch.randn(4, 6)).sum().backward()
            buffers.append(profiler.record_stats().buffers)
    # the model's unique buffer storages after each step: BatchNorm's 56 B and the 6 x 3 positions
    truth = sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}.values())
    assert buffers == [truth] * 3 == [6 * 4 * 2 + 8 + 6 * 3 * 4] * 3


def test_gradients_split_from_one_concatenation_count_its_whole_storage(stream):
    from .test_accounting import ConcatenatedBias, _unique_grad_storages

    model = ConcatenatedBias()
    with make(model, stream) as profiler:
        model(torch.randn(4, 16)).sum().backward()
        record = profiler.record_stats()
        truth = _unique_grad_storages(model)
    assert record.gradients == truth == 48 * 16 * 4 + 48 * 4


def test_adam_state_found_without_being_passed(stream):
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    unrelated = torch.optim.SGD([nn.Parameter(torch.zeros(1000))], lr=0.1, momentum=0.9)
    with make(model, stream) as profiler:
        train_step(model, opt, torch.randn(4, 32))
        unrelated.param_groups[0]["params"][0].grad = torch.ones(1000)
        unrelated.step()
        record = profiler.record_stats()
    params = list(model.parameters())
    # exp_avg + exp_avg_sq per parameter, and a 4-byte float32 step each (on CPU, the profiled device)
    assert record.optimizer_state == 2 * sum(nbytes(p) for p in params) + 4 * len(params)
    assert record.optimizer_steps == 1


def test_adam_state_of_a_given_optimizer(stream):
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with make(model, stream, optimizer=opt) as profiler:
        assert profiler.record_stats().optimizer_state == 0
        train_step(model, opt, torch.randn(4, 32))
        record = profiler.record_stats()
    expected = sum(nbytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert record.optimizer_state == expected > 0


def test_gradient_accumulation_reports_the_largest_forward(stream):
    model = mlp(32, 64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make(model, stream) as profiler:
        for batch in (8, 24, 16):  # three micro-batches, one optimizer step
            model(torch.randn(batch, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        record = profiler.record_stats()
    assert record.forward_passes == 3 and record.backward_passes == 3
    assert record.feature_maps == 24 * (64 + 10) * 4
    assert record.phases["forward"].occurrences == 3


def test_zero_grad_before_record_stats_keeps_the_gradients(stream):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make(model, stream) as profiler:
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        record = profiler.record_stats()
    assert record.gradients == sum(nbytes(p) for p in model.parameters())


def test_no_grad_forward_is_not_a_training_forward(stream):
    model = mlp()
    with make(model, stream) as profiler:
        with torch.no_grad():
            model(torch.randn(4, 32))
        record = profiler.record_stats()
    assert record.forward_passes == 0 and record.feature_maps == 0


def test_print_period_and_epoch_numbering(stream):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with make(model, stream, print_period=3) as profiler:
        for _epoch in range(2):
            for _ in range(7):
                train_step(model, opt, torch.randn(4, 32))
                rec = profiler.record_stats()
                seen.append((rec.epoch, rec.iteration, rec.step))
            profiler.epoch_end()
    text = stream.getvalue()
    headers = [line for line in text.splitlines() if line.startswith("Memory Usage")]
    assert headers == [
        "Memory Usage for Iteration 3 of Epoch 1",
        "Memory Usage for Iteration 6 of Epoch 1",
        "Memory Usage for Iteration 3 of Epoch 2",
        "Memory Usage for Iteration 6 of Epoch 2",
    ]
    assert text.count("Epoch 1 finished") == 1 and text.count("Epoch 2 finished") == 1
    assert seen[0] == (1, 1, 1) and seen[6] == (1, 7, 7) and seen[7] == (2, 1, 8)
    assert [r.iteration for r in profiler.records] == [3, 6, 3, 6]


def test_iteration_peak_is_the_largest_phase_peak(stream):
    model = ScratchNet()
    opt = torch.optim.Adam(model.parameters())
    with make(model, stream) as profiler:
        train_step(model, opt, torch.randn(64, 64))
        record = profiler.record_stats()
    phases = record.phases
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert record.iteration_peak_allocated == max(p.peak_allocated for p in phases.values())
    assert record.peak_phase == "backward"  # the 4 MB scratch
    assert record.iteration_peak_allocated >= BackwardScratch.SCRATCH_ELEMS * 4
    assert record.peak_allocated >= record.iteration_peak_allocated
    assert "Peak during: backward" in stream.getvalue()


def test_model_without_parameters_gives_a_zero_report(stream):
    model = nn.ReLU()
    with make(model, stream) as profiler:
        model(torch.randn(4, requires_grad=True)).sum().backward()
        record = profiler.record_stats()
    assert record.weights == record.gradients == 0
    assert record.optimizer_state is None  # no optimizer known: unknown, not a false zero
    assert "Total layer weight usage...............0 MB" in stream.getvalue()
    assert "Optimizer state.........................n/a" in stream.getvalue()


def test_units(stream):
    model = nn.Linear(256, 1024, bias=False)  # exactly 1 MiB of float32
    with make(model, stream, units="MiB") as profiler:
        model(torch.randn(2, 256))
        profiler.record_stats()
    assert "Total layer weight usage" + "." * 14 + "1 MiB" in stream.getvalue()


def test_close_removes_every_hook():
    model = mlp()
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    profiler = MemoryProfiler(model, stream=io.StringIO())
    assert model._forward_pre_hooks and model._forward_hooks
    assert len(_global_optimizer_pre_hooks) == pre + 1
    profiler.close()
    profiler.close()  # twice is harmless
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("model", [None, "resnet", torch.zeros(3), [nn.Linear(2, 2)]])
def test_model_must_be_a_module(model):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got"):
        memory_profiler(model)


@pytest.mark.parametrize("period", [0, -1, 1.5, "5", True, None])
def test_print_period_must_be_a_positive_int(period):
    with pytest.raises(ValueError, match=r"print_period must be an integer >= 1, got"):
        memory_profiler(nn.Linear(2, 2), period)


def test_other_bad_arguments_name_themselves():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="units must be one of"):
        memory_profiler(model, units="megabytes")
    with pytest.raises(TypeError, match="optimizer must be"):
        memory_profiler(model, optimizer="adam")
    with pytest.raises(TypeError, match="stream must have a write"):
        memory_profiler(model, stream=42)
    with pytest.raises(TypeError, match="csv must be True or False"):
        memory_profiler(model, 1, "yes")
    with pytest.raises(ValueError, match="device="):
        memory_profiler(model, device="gpu0")


def test_unwritable_csv_folder_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="csv_dir=.*cannot be created or written"):
        memory_profiler(nn.Linear(2, 2), 1, True, csv_dir=blocker / "sub")


def test_meta_model_gets_a_clear_message():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        memory_profiler(model)


# -- faults never stop training ------------------------------------------------


def test_a_fault_is_logged_once_and_training_goes_on(monkeypatch, caplog, stream):
    import pytorch_mem_profiler.measure.meter as meter_module

    def broken(*args, **kwargs):
        raise RuntimeError("simulated profiler bug")

    monkeypatch.setattr(meter_module, "optimizer_state_bytes", broken)
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        profiler = MemoryProfiler(model, stream=stream)
        for _ in range(3):
            train_step(model, opt, torch.randn(4, 32))
            assert profiler.record_stats() is None  # the record could not be made
        profiler.close()
    faults = [r for r in caplog.records if "switched off" in r.getMessage()]
    assert len(faults) == 1 and "simulated profiler bug" in faults[0].getMessage()
    assert all(p.grad is None for p in model.parameters())  # the loop really ran


def test_a_fault_inside_backward_does_not_break_backward(monkeypatch, stream):
    from pytorch_mem_profiler.measure.phases import PhaseMachine

    def broken(self, grad_outputs):
        return 1 / 0

    # what the backward hook calls, from inside autograd's engine
    monkeypatch.setattr(PhaseMachine, "backward_started", broken)
    model = mlp()
    profiler = MemoryProfiler(model, stream=stream)
    model(torch.randn(4, 32)).sum().backward()
    assert model[0].weight.grad is not None
    assert "backward hooks" in profiler._guard.disabled
    profiler.close()


def test_strict_reraises(monkeypatch, stream):
    import pytorch_mem_profiler.measure.meter as meter_module

    monkeypatch.setattr(meter_module, "optimizer_state_bytes", lambda *a: 1 / 0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with make(model, stream) as profiler:
        train_step(model, opt, torch.randn(4, 32))
        with pytest.raises(ZeroDivisionError):
            profiler.record_stats()


def test_a_device_without_peak_counters_reads_na(monkeypatch, stream):
    """MPS keeps no peak: the figures that need one say n/a, never a wrong 0."""
    import pytorch_mem_profiler.measure.meter as meter_module
    from pytorch_mem_profiler.measure.devices import CpuCounter, Reading

    class NoPeaks(CpuCounter):
        has_peak = False

        def _read_device(self) -> Reading:
            now = super()._read_device()
            return Reading(now.allocated, None, now.reserved, None)

    monkeypatch.setattr(meter_module, "make_counter", lambda device: NoPeaks(device))
    model = mlp()
    with make(model, stream) as profiler:
        train_step(model, None, torch.randn(4, 32))
        record = profiler.record_stats()
    assert record.peak_cached is None and record.intermediate_gradients is None
    assert record.iteration_peak_allocated is None and record.peak_allocated is None
    assert record.feature_maps == 4 * (64 + 10) * 4  # allocated deltas still work
    # the CPU caches nothing: no cache lines (on a device without peak counters they read n/a)
    assert "Peak cached" not in stream.getvalue() and "Current cached" not in stream.getvalue()


def test_a_closed_profiler_is_freed_without_the_cycle_collector(stream):
    import gc
    import weakref

    model = mlp()
    profiler = MemoryProfiler(model, stream=stream, by_layer=True)
    train_step(model, torch.optim.Adam(model.parameters()), torch.randn(2, 32))
    profiler.record_stats()
    profiler.close()
    ref = weakref.ref(profiler)
    gc.disable()
    try:
        del profiler
        assert ref() is None
    finally:
        gc.enable()


def test_the_settings_read_back_as_given_and_stay_fixed(stream, tmp_path):
    model = mlp()
    profiler = memory_profiler(model, 3, True, stream=stream, csv_dir=tmp_path, units="MiB", by_layer=True)
    assert (profiler.print_period, profiler.csv, profiler.units, profiler.by_layer, profiler.strict) == (3, True, "MiB", True, False)
    assert profiler.csv_path.parent == tmp_path and profiler.layers_csv_path.parent == tmp_path
    assert profiler.cross_rank_summary is None and profiler.file_tag == ""  # one process
    with pytest.raises(AttributeError):
        profiler.print_period = 1  # the outputs and the budget were made for 3
    assert not profiler.closed
    profiler.close()
    assert profiler.closed
    assert profiler.record_stats() is None  # after close(): nothing measured, the run goes on


def test_a_model_moved_after_the_profiler_was_made_is_measured_where_it_went(stream, monkeypatch, caplog):
    """The device measured follows the model (no device given): made before ``model.to(...)``,
    the profiler measures the new device from the first forward on (the counter, the records, the
    weights). A move to another CPU device id stands in for ``model.to("cuda")``."""
    from pytorch_mem_profiler.measure import model_state

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = make(model, stream)
    assert profiler.device == torch.device("cpu")
    moved_to = torch.device("cpu", 0)
    monkeypatch.setattr(model_state, "model_device", lambda *args: moved_to)
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        train_step(model, opt, torch.randn(4, 32))
        record = profiler.record_stats()
    assert "the model moved from cpu to cpu:0" in caplog.text
    assert profiler.device == moved_to and record.device == "cpu:0"
    assert record.weights == unique_storage_bytes(*model.parameters())
    profiler.close()
