"""Feature maps by layer, phases, peak location and leak warnings, on CPU, to the byte."""

from __future__ import annotations

import io
import warnings

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pytorch_mem_profiler.measure.layers as layers_module
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.devices import CpuCounter
from pytorch_mem_profiler.outputs.leaks import LeakWarning
from pytorch_mem_profiler.outputs.sinks import LeakSink
from pytorch_mem_profiler.stats import diff_records

from .helpers import BackwardScratch, mlp, nbytes, needs_saved_tensor_watch

F32 = 4


def profile_one_step(model, x, **kw):
    stream = io.StringIO()
    with MemoryProfiler(model, 1, by_layer=True, stream=stream, strict=True, **kw) as profiler:
        out = model(x)
        out.float().pow(2).mean().backward()
        record = profiler.record_stats()
    return record, stream.getvalue()


def activations(record) -> dict[str, int]:
    return {m: n for (m, c), n in record.layers.by_module.items() if c == "activations"}


@needs_saved_tensor_watch
def test_mlp_by_layer():
    model = mlp(32, 64, 10)
    record, text = profile_one_step(model, torch.randn(16, 32))
    # ReLU keeps its output (the second Linear saves the same storage: counted once);
    # the first Linear saves only its input, the batch.
    assert activations(record) == {"(input)": 16 * 32 * F32, "1": 16 * 64 * F32}
    assert record.layers.total == 16 * 64 * F32
    assert record.layers.inputs == 16 * 32 * F32
    # what the allocator shows beyond that: the model's output
    assert record.layers.unattributed == 16 * 10 * F32
    assert record.feature_maps == record.layers.total + record.layers.unattributed
    assert "Feature maps by layer" in text and "Total by layer" in text


@needs_saved_tensor_watch
def test_cnn_with_batchnorm_by_layer():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5)
    )
    record, _ = profile_one_step(model, torch.randn(4, 3, 8, 8))
    conv_out = 4 * 8 * 8 * 8 * F32
    # BatchNorm saves the conv output and its batch mean and inverse std (8 channels each);
    # ReLU saves its output, which Flatten views and the Linear saves again (counted once).
    assert activations(record) == {
        "(input)": 4 * 3 * 8 * 8 * F32,
        "1": conv_out + 2 * 8 * F32,
        "2": conv_out,
    }
    assert record.layers.unattributed == 4 * 5 * F32
    assert record.buffers == 2 * 8 * F32 + 8  # running mean, var, num_batches_tracked


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.act = nn.Tanh()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.act(self.fc(self.act(self.fc(x)))))


@needs_saved_tensor_watch
def test_module_called_twice_is_summed_with_a_call_count():
    record, text = profile_one_step(CalledTwice(), torch.randn(8, 32))
    assert activations(record) == {"(input)": 8 * 32 * F32, "act": 2 * 8 * 32 * F32}
    assert record.layers.calls["fc"] == 2 and record.layers.calls["act"] == 2
    assert record.layers.calls["out"] == 1
    assert "x2 calls" in text


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        h = self.pre(x)
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


@needs_saved_tensor_watch
def test_checkpointed_block_keeps_only_its_input():
    record, _ = profile_one_step(Checkpointed(), torch.randn(8, 16))
    acts = activations(record)
    # nothing inside the checkpointed block is kept ...
    assert not any(name.startswith("block") for name in acts)
    # ... but its input, saved by the checkpoint call in the model's own forward,
    # and the head's input (the block's output)
    assert acts == {"(input)": 8 * 16 * F32, "": 8 * 64 * F32, "head": 8 * 64 * F32}
    assert record.layers.unattributed == 8 * 2 * F32  # the output
    # the recomputation during backward is backward's transient memory
    plain = Checkpointed()
    plain.forward = lambda x: plain.head(plain.block(plain.pre(x)))  # type: ignore[method-assign]
    uncheckpointed, _ = profile_one_step(plain, torch.randn(8, 16))
    assert record.feature_maps < uncheckpointed.feature_maps


@needs_saved_tensor_watch
def test_autocast_weight_copies_are_named():
    model = mlp(32, 64, 10)
    with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(16, 32))
        out.float().pow(2).mean().backward()
        record = profiler.record_stats()
    by = dict(record.layers.by_module)
    # the second Linear keeps the bf16 copy of its weight for the input gradient
    assert by[("2", "weight copies")] == 10 * 64 * 2
    assert by[("0", "activations")] == 16 * 32 * 2  # the bf16 cast of the input batch
    assert by[("1", "activations")] == 16 * 64 * 2


def test_compiled_model_does_not_crash_and_reports_totals(caplog):
    model = mlp(32, 64, 10)
    compiled = torch.compile(model, backend="aot_eager")
    with MemoryProfiler(compiled, 1, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(2):
            compiled(torch.randn(16, 32)).pow(2).mean().backward()
            record = profiler.record_stats()
    assert record.layers is None
    assert record.weights == sum(nbytes(p) for p in model.parameters())
    assert record.gradients == record.weights
    assert record.feature_maps > 0 and record.forward_passes == record.backward_passes == 1
    assert any("torch.compile" in r.getMessage() for r in caplog.records)


@needs_saved_tensor_watch
def test_per_layer_hooks_run_only_on_reported_iterations(monkeypatch):
    starts = []
    real_start = layers_module.LayerAttribution.start

    def counting_start(self, inputs, **kwargs):
        starts.append(1)
        return real_start(self, inputs, **kwargs)

    monkeypatch.setattr(layers_module.LayerAttribution, "start", counting_start)
    model = mlp()
    records = []
    with MemoryProfiler(model, 5, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        for _epoch in range(2):
            for _ in range(7):
                model(torch.randn(4, 32)).sum().backward()
                records.append(profiler.record_stats())
            profiler.epoch_end()
    assert len(starts) == 2  # iteration 5 of each epoch
    assert [r.iteration for r in records if r.layers is not None] == [5, 5]


def test_phase_figures_match_a_second_counter():
    """A second counter, running beside the profiler's, read by hand at the phase ends."""
    model = mlp(32, 64, 10)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 32)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
        manual = CpuCounter()
        manual.start()
        try:
            manual.adopt(model.parameters())
            profiler.record_stats()  # both counters now count the same storages
            manual.mark()
            out = model(x)
            after_forward = manual.read()
            loss = out.pow(2).mean()
            loss.backward()
            after_backward = manual.read().allocated
            manual.mark()
            opt.step()
            after_step = manual.mark()
            opt.zero_grad()
            record = profiler.record_stats()
        finally:
            manual.stop()
    phases = record.phases
    assert phases["forward"].allocated_at_end == after_forward.allocated
    assert phases["forward"].peak_allocated == after_forward.peak_allocated
    # backward's end is read inside the autograd engine, while the loss's 4-byte
    # gradient seed still lives; it is freed when loss.backward() returns
    assert phases["backward"].allocated_at_end == after_backward + F32
    assert phases["optimizer"].allocated_at_end == after_step.allocated
    assert phases["optimizer"].peak_allocated == after_step.peak_allocated
    assert record.iteration_peak_allocated == max(p.peak_allocated for p in phases.values())


class ScratchLayer(nn.Module):
    def forward(self, x):
        return BackwardScratch.apply(x)


def test_peak_location_names_the_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ScratchLayer(), nn.Linear(32, 4))
    record, text = profile_one_step(model, torch.randn(8, 32))
    assert record.peak_phase == "backward"
    assert record.peak_location == "1"  # backward through ScratchLayer holds its 4 MB scratch
    assert "Peak during: backward" in text and "reached in 1" in text


def test_leak_warning_for_a_loop_that_keeps_losses():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with pytest.warns(LeakWarning) as caught:
        with MemoryProfiler(model, 1, stream=io.StringIO(), leak_window=5) as profiler:
            for _ in range(12):
                loss = model(torch.randn(4, 32)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                kept.append(loss)  # keeps each loss tensor alive
                profiler.record_stats()
    leak_warnings = [w for w in caught if issubclass(w.category, LeakWarning)]
    assert len(leak_warnings) == 1
    message = str(leak_warnings[0].message)
    # each kept loss is one float32 scalar: 4 bytes a step
    assert "grows by 0.00000400 MB per iteration" in message  # 4 bytes, three significant digits
    assert "tensors kept alive by the training loop" in message
    assert "since iteration 1 of epoch 1" in message
    first, last = profiler.first_record, profiler.records[-1]
    assert diff_records(first, last)["allocated"] == 4 * (last.step - first.step)


def test_clean_loop_never_warns_over_200_iterations():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeakWarning)
        with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
            for _ in range(200):
                loss = model(torch.randn(4, 32)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                profiler.record_stats()
    assert profiler._sink(LeakSink).detector.found is None


@needs_saved_tensor_watch
def test_layers_csv_long_format(csv_dir):
    model = mlp(32, 64, 10)
    with MemoryProfiler(model, 2, True, by_layer=True, csv_dir=csv_dir, stream=io.StringIO()) as profiler:
        for _ in range(4):
            model(torch.randn(16, 32)).pow(2).mean().backward()
            profiler.record_stats()
    frame = pd.read_csv(profiler.layers_csv_path)
    assert list(frame.columns) == ["epoch", "iteration", "step", "module", "category", "calls", "bytes"]
    assert sorted(set(frame.iteration)) == [2, 4]
    pivot = frame.pivot_table(index="step", columns="module", values="bytes", aggfunc="sum")
    assert list(pivot["1"]) == [16 * 64 * F32] * 2
    assert list(pivot["(allocator delta)"]) == [16 * (64 + 10) * F32] * 2
    main = pd.read_csv(profiler.csv_path)
    assert list(main.layers_total_feature_maps) == [16 * 64 * F32 / 1e6] * 2


def test_outside_pytorch_is_unknown_on_cpu():
    record, text = profile_one_step(mlp(), torch.randn(2, 32))
    assert record.device_used is None and record.outside_pytorch is None
    assert "outside PyTorch" not in text


class ForwardScratch(nn.Module):
    """A forward that briefly holds 4 MB it frees before returning."""

    def forward(self, x):
        # only a 4-byte sum outlives the scratch (nothing of it is saved for backward)
        return x + torch.ones(1_000_000).sum() * 0


def test_peak_location_in_forward_names_the_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ForwardScratch(), nn.Linear(32, 4))
    stream = io.StringIO()
    with MemoryProfiler(model, 1, by_layer=True, stream=stream, strict=True) as profiler:
        out = model(torch.randn(8, 32))
        out.sum().backward()
        record = profiler.record_stats()
    assert record.peak_phase == "forward"
    assert record.peak_location == "1"
    assert record.phases["forward"].peak_allocated >= 4_000_000


@needs_saved_tensor_watch
def test_a_fault_in_the_attribution_takes_its_hooks_away_by_the_iterations_end(caplog):
    """A fault in a per-layer module hook mid-forward switches the attribution off: its hooks on
    every module and its saved-tensor pair go by the end of that iteration (not at close()), so
    neither the model's later forwards nor another model's run through them, and no record from
    then on names a module it may have got wrong; the peak's make-up, which needs no names, stays."""
    import torch.nn.modules.module as module_hooks

    from pytorch_mem_profiler.measure.saved_tensors import top_saved_tensors_hooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), ForwardScratch(), nn.Linear(32, 4))
    other = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    before = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
    seen = []
    with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO()) as profiler:
        for i in range(3):
            if i == 1:
                attribution = profiler._meter._observers.attribution

                def fails(ended_in, now_in):
                    raise RuntimeError("injected")

                attribution.on_exit = fails  # called where a tracked module's forward ends
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            record = profiler.record_stats()
            installed = (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks))
            seen.append((record, installed, top_saved_tensors_hooks()))
            other(torch.randn(2, 4)).sum().backward()  # another model, between iterations
    assert "per-layer attribution failed" in caplog.text
    first, faulted, after = (r for r, _, _ in seen)
    assert first.peak_location == "1" and first.layers is not None
    for record, installed, top in seen:
        assert installed == before and top is None, record.iteration
    for record in (faulted, after):
        assert record.layers is None and record.peak_location is None and record.peak_layers is None
        assert record.peak_breakdown is not None
        assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated


class SampledScores(nn.Module):
    """Attention that picks its queries by scores it computes and drops (ProbSparse's sparsity
    measure, a router's top-k): the scores' graph saves tensors the forward frees before it ends."""

    def __init__(self, width: int = 32, picked: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.picked = picked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = (q @ k.transpose(1, 2)).tanh().exp()  # saved: tanh's and exp's outputs, dropped below
        top = scores.amax(-1).topk(self.picked, dim=-1).indices  # indices only: the graph above goes
        del scores
        rows = torch.gather(q, 1, top.unsqueeze(-1).expand(-1, -1, q.shape[-1]))
        return self.out(torch.softmax(rows @ k.transpose(1, 2), -1) @ k)


def _kept_at_forward_end(model: nn.Module, x: torch.Tensor) -> int:
    """The user's own pack hook: bytes of the unique storages autograd saved that are alive when the
    forward returns (parameters left out), the input included."""
    import weakref

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[tuple[weakref.ref, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and all(r() is not storage for r, _ in saved):
            saved.append((weakref.ref(storage), storage.nbytes()))
        return t.detach() if t.grad_fn is not None else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    kept = sum(n for r, n in saved if r() is not None)
    dropped = sum(n for r, n in saved if r() is None)
    del out
    return kept, dropped


@needs_saved_tensor_watch
def test_storages_saved_in_a_branch_the_forward_drops_are_not_counted():
    model, x = SampledScores(), torch.randn(8, 64, 32)
    kept, dropped = _kept_at_forward_end(model, x)
    assert dropped > 0  # the scores' saved tensors were there, and went
    record, _ = profile_one_step(model, x)
    assert record.layers.total + record.layers.inputs == kept
