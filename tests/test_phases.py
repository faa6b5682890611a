"""Phases found without the root's forward, inside optimizer.step(closure), and marked by hand, on CPU.

Every figure is compared with one made independently: what a ``saved_tensors_hooks``
pack hook saw autograd keep, a second CPU counter read at boundaries the test
places itself, or a temporary of a known size.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils.checkpoint import checkpoint

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.devices import CpuCounter
from pytorch_mem_profiler.measure.saved_tensors import can_chain

from .helpers import BackwardScratch, SavedBytes, nbytes

F32 = 4
SCRATCH = 1_000_000  # float32 elements: 4 MB, far above anything else these models hold


class StepWrapper(nn.Module):
    """Like a LightningModule: the framework calls ``training_step``, never ``forward``."""

    def __init__(self, net: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = net if net is not None else nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.seen: SavedBytes | None = None
        self.output_bytes = 0

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen = SavedBytes(self.net, (x,))
        with self.seen.hooks():
            out = self.net(x)
        self.output_bytes = nbytes(out)
        return F.mse_loss(out, y)


def profile(model, **kw) -> MemoryProfiler:
    kw.setdefault("strict", True)
    return MemoryProfiler(model, kw.pop("print_period", 1), stream=io.StringIO(), **kw)


def hooked(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]


# -- forward without the root's forward ------------------------------------------------------------
@pytest.mark.parametrize("by_layer", [False, True])
def test_a_method_that_calls_a_child_is_one_forward(by_layer):
    model = StepWrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    with profile(model, by_layer=by_layer) as profiler:
        for _ in range(3):
            model.training_step(x, y).backward()
            opt.step()
            opt.zero_grad()
            record = profiler.record_stats()
            assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
            # what the forward leaves allocated: what autograd saved (ReLU's output, kept once
            # though the second Linear saves it too) and the output
            assert record.feature_maps == model.seen.total + model.output_bytes == (16 * 64 + 16 * 10) * F32
            assert set(record.phases) == {"forward", "backward", "optimizer"}
            assert record.gradients == record.weights == sum(nbytes(p) for p in model.parameters())
            if by_layer and can_chain():
                acts = {m: n for (m, c), n in record.layers.by_module.items() if c == "activations"}
                assert acts == {"(input)": nbytes(x), "net.1": model.seen.total}
                assert record.layers.unattributed == model.output_bytes
                assert record.layers.calls == {"net": 1, "net.0": 1, "net.1": 1, "net.2": 1}


def test_only_the_entry_modules_stay_hooked_after_the_first_forward():
    model = StepWrapper()
    x, y = torch.randn(4, 32), torch.randn(4, 10)
    with profile(model) as profiler:
        assert hooked(model) == ["", "net", "net.0", "net.1", "net.2"]  # learning
        model.training_step(x, y).backward()
        profiler.record_stats()
        assert hooked(model) == ["", "net"]
        model.training_step(x, y).backward()
        assert profiler.record_stats().forward_passes == 1
    assert hooked(model) == []


def test_a_model_entered_another_way_is_found_again():
    model = StepWrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 32), torch.randn(4, 10)
    with profile(model) as profiler:
        model.training_step(x, y).backward()
        opt.step()
        profiler.record_stats()
        assert hooked(model) == ["", "net"]
        # the framework now calls the first layers itself: no hooked module is entered
        F.mse_loss(model.net[2](model.net[1](model.net[0](x))), y).backward()
        opt.step()
        missed = profiler.record_stats()
        assert (missed.forward_passes, missed.optimizer_steps) == (0, 1)
        assert hooked(model) == ["", "net", "net.0", "net.1", "net.2"]  # learning again
        F.mse_loss(model.net[2](model.net[1](model.net[0](x))), y).backward()
        opt.step()
        found = profiler.record_stats()
    # three entries before one backward: one forward pass
    assert (found.forward_passes, found.backward_passes, found.optimizer_steps) == (1, 1, 1)
    assert found.feature_maps == (4 * 64 + 4 * 10) * F32


class EncoderDecoder(nn.Module):
    """Lightning's autoencoder example: the step calls two children one after the other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(32, 16), nn.Tanh())
        self.decoder = nn.Sequential(nn.Linear(16, 32), nn.Sigmoid())

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        return F.mse_loss(self.decoder(z), x)


@pytest.mark.parametrize("by_layer", [False, True])
def test_children_entered_one_after_the_other_are_one_forward_pass(by_layer):
    model = EncoderDecoder()
    x = torch.randn(8, 32)
    with profile(model, by_layer=by_layer) as profiler:
        model.training_step(x).backward()
        record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes) == (1, 1)
    assert record.phases["forward"].occurrences == 1
    # Tanh keeps z (the decoder's Linear saves it too), Sigmoid its output, which is also the output
    assert record.feature_maps == (8 * 16 + 8 * 32) * F32
    if by_layer and can_chain():
        acts = {m: n for (m, c), n in record.layers.by_module.items() if c == "activations"}
        assert acts == {"(input)": nbytes(x), "encoder.1": 8 * 16 * F32, "decoder.1": 8 * 32 * F32}
        assert record.layers.calls["encoder"] == record.layers.calls["decoder"] == 1


def test_no_grad_and_checkpoint_recomputation_are_not_forwards():
    class Checkpointed(StepWrapper):
        def training_step(self, x, y):
            return F.mse_loss(checkpoint(self.net, x, use_reentrant=False), y)

    model = Checkpointed()
    x, y = torch.randn(4, 32), torch.randn(4, 10)
    with profile(model) as profiler:
        with torch.no_grad():
            model.net(x)
        model.training_step(x, y).backward()  # recomputes net's forward inside backward
        record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes) == (1, 1)


def test_gradient_accumulation_through_a_child():
    model = StepWrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(model) as profiler:
        for batch in (8, 24, 16):
            model.training_step(torch.randn(batch, 32), torch.randn(batch, 10)).backward()
        opt.step()
        record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (3, 3, 1)
    assert record.feature_maps == 24 * (64 + 10) * F32


def test_close_removes_every_module_hook_while_learning():
    model = StepWrapper()
    pre = len(_global_optimizer_pre_hooks)
    profiler = profile(model)
    assert len(hooked(model)) == 5
    profiler.close()
    assert hooked(model) == [] and len(_global_optimizer_pre_hooks) == pre


# -- optimizer.step(closure) -------------------------------------------------------------------------
class ScratchSGD(torch.optim.SGD):
    """SGD whose update holds a temporary of ``SCRATCH`` float32 elements after the closure ran."""

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scratch = torch.ones(SCRATCH)
        del scratch
        super().step()
        return loss


def test_a_closure_runs_forward_and_backward_inside_the_step():
    model = StepWrapper()
    opt = ScratchSGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 10)

    def closure():
        opt.zero_grad()
        preamble = torch.ones(2 * SCRATCH)  # before the forward: not the update
        del preamble
        loss = model.training_step(x, y)
        loss.backward()
        return loss

    with profile(model) as profiler:
        for _ in range(2):
            opt.step(closure)
            record = profiler.record_stats()
            assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
            assert record.feature_maps == model.seen.total + model.output_bytes
            phases = record.phases
            # the optimizer phase is the update after the closure's backward; its peak is the
            # scratch's (backward's end is read while the loss's 4-byte gradient seed still lives)
            update_start = phases["backward"].allocated_at_end - F32
            assert phases["optimizer"].peak_allocated == update_start + SCRATCH * F32
            assert record.peak_phase == "other"  # the preamble, 8 MB
            assert record.iteration_peak_allocated > phases["optimizer"].peak_allocated
            assert phases["forward"].peak_allocated < phases["optimizer"].peak_allocated


def test_lbfgs_counts_every_closure_call_and_the_updates_peak():
    torch.manual_seed(0)
    model = StepWrapper()
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5, history_size=3)
    profiler = profile(model)
    manual = CpuCounter()  # a second counter, read at boundaries this test places
    manual.start()
    try:
        manual.adopt(model.parameters())
        x, y = torch.randn(16, 32), torch.randn(16, 10)  # made while both counters count
        update_peaks: list[int] = []
        calls = 0
        in_step = [False]

        def closure():
            nonlocal calls
            calls += 1
            reading = manual.mark()  # what ran since the last closure's end was the update
            if calls > 1:
                update_peaks.append(reading.peak_allocated)
            opt.zero_grad()
            loss = model.training_step(x, y)
            loss.backward()
            manual.mark()
            return loss

        profiler.record_stats()  # both counters start the iteration here
        opt.step(closure)
        update_peaks.append(manual.mark().peak_allocated)  # the last update, to the step's end
        record = profiler.record_stats()
    finally:
        manual.stop()
        profiler.close()
    assert calls > 2
    assert record.forward_passes == record.backward_passes == calls
    assert record.optimizer_steps == 1 and record.phases["optimizer"].occurrences == 1
    assert record.phases["forward"].occurrences == calls
    assert record.phases["optimizer"].peak_allocated == max(update_peaks)


# -- phases marked by the framework ------------------------------------------------------------------
def comparable(record):
    return (
        record.forward_passes,
        record.backward_passes,
        record.optimizer_steps,
        record.feature_maps,
        record.gradients,
        record.iteration_peak_allocated,
        record.peak_phase,
        dict(record.phases),
    )


def test_marking_phases_the_hooks_also_find_changes_no_figure():
    model = StepWrapper()
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    with profile(model, by_layer=True) as profiler:  # by_layer: intermediate gradients measured
        model.training_step(x, y).backward()
        opt.step()
        opt.zero_grad()
        profiler.record_stats()  # Adam's state exists from here: both iterations below alike

        loss = F.mse_loss(model.net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
        plain = profiler.record_stats()

        with profiler.phase("forward"):
            out = model.net(x)
        loss = F.mse_loss(out, y)
        del out
        with profiler.phase("backward"):
            loss.backward()
        with profiler.phase("optimizer"):
            opt.step()
        opt.zero_grad()
        del loss
        marked = profiler.record_stats()
    # the one difference: a backward block ends when backward() has returned and freed the
    # loss's 4-byte gradient seed; the hooks read backward's end inside the engine, before
    backward_marked, backward_plain = marked.phases["backward"], plain.phases["backward"]
    assert backward_marked.allocated_at_end == backward_plain.allocated_at_end - F32
    assert backward_marked.peak_allocated == backward_plain.peak_allocated
    without_backward = lambda r: comparable(r)[:-1] + ({k: v for k, v in r.phases.items() if k != "backward"},)
    assert without_backward(marked) == without_backward(plain)
    # the seed is made inside the marked backward block: backward's own there
    assert marked.intermediate_gradients == plain.intermediate_gradients + F32
    assert (marked.forward_passes, marked.backward_passes, marked.optimizer_steps) == (1, 1, 1)


def test_phases_the_hooks_cannot_see_are_measured_when_marked():
    model = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with profile(model) as profiler:
        with profiler.phase("forward"):
            # a functional forward: no module is called, no hook fires
            hidden = F.linear(x, model.weight, model.bias).relu()
            out = F.linear(hidden, model.weight, model.bias)
        with profiler.phase("backward"):
            out.pow(2).mean().backward()
        record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 0)
    # relu's output (saved by it and by the second linear) and the output
    assert record.feature_maps == 2 * 32 * 64 * F32
    assert record.gradients == sum(nbytes(p) for p in model.parameters())


def test_one_optimizer_block_is_one_step_with_its_closure_inside():
    model = StepWrapper()
    opt = ScratchSGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.net[0].parameters(), lr=0.1)
    x, y = torch.randn(8, 32), torch.randn(8, 10)

    def closure():
        opt.zero_grad()
        loss = model.training_step(x, y)
        loss.backward()
        return loss

    with profile(model) as profiler:
        with profiler.phase("optimizer"):
            with profiler.phase("optimizer"):  # nested in the same phase: ignored
                opt.step(closure)
                other.step()
        record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
    phases = record.phases
    update_start = phases["backward"].allocated_at_end - F32  # the loss's gradient seed is gone
    assert phases["optimizer"].peak_allocated == update_start + SCRATCH * F32


def test_phase_names_are_checked_and_a_closed_profiler_marks_nothing():
    model = StepWrapper()
    profiler = profile(model)
    with pytest.raises(ValueError, match=r"name='update'"):
        profiler.phase("update")
    assert profiler.current_phase == "other"
    with profiler.phase("forward"):
        assert profiler.current_phase == "forward"
    profiler.close()
    with profiler.phase("backward"):
        assert profiler.current_phase is None
    with pytest.raises(ValueError, match=r"name='other'"):
        profiler.phase("other")


def test_an_exception_inside_a_phase_block_propagates_and_the_phase_ends():
    model = StepWrapper()
    with profile(model) as profiler:
        with pytest.raises(KeyError):
            with profiler.phase("optimizer"):
                raise KeyError("inside the step")
        assert profiler.current_phase == "other"
        assert profiler.record_stats().optimizer_steps == 1


# -- peaks in the right phase ------------------------------------------------------------------------
def test_the_peak_is_put_down_to_backward_for_a_wrapper():
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    model = StepWrapper(net)
    model.net.forward = lambda x: net[2](BackwardScratch.apply(net[1](net[0](x))))  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(model) as profiler:
        model.training_step(torch.randn(16, 64), torch.randn(16, 8)).backward()
        opt.step()
        record = profiler.record_stats()
    assert record.peak_phase == "backward"
    assert record.phases["backward"].peak_allocated >= BackwardScratch.SCRATCH_ELEMS * F32
    assert record.phases["forward"].peak_allocated < BackwardScratch.SCRATCH_ELEMS * F32


# -- a real Lightning Trainer ------------------------------------------------------------------------
def lightning_run(optimizer: str, by_layer: bool):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
            self.steps_in_batch = 0
            self.seen: list[SavedBytes] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.steps_in_batch += 1
            seen = SavedBytes(self.net, (x,))
            with seen.hooks():  # a user's pack hook, beside the profiler's
                out = self.net(x)
            seen.seen[-1] = nbytes(out)  # the output, alive when forward ends
            self.seen.append(seen)
            return F.mse_loss(out, y)

        def configure_optimizers(self):
            if optimizer == "lbfgs":
                return torch.optim.LBFGS(self.parameters(), max_iter=3)
            return ScratchSGD(self.parameters(), lr=0.1)

    class Profile(pl.Callback):
        def __init__(self) -> None:
            self.records: list = []
            self.calls: list[int] = []

        def on_train_start(self, trainer, module):
            self.profiler = profile(module, by_layer=by_layer)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            module.steps_in_batch = 0
            module.seen.clear()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.records.append(self.profiler.record_stats())
            self.calls.append(module.steps_in_batch)
            self.largest_saved = max(s.total for s in module.seen)

        def on_train_end(self, trainer, module):
            self.profiler.close()

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 32), torch.randn(48, 10))
    callback = Profile()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return module, callback


@pytest.mark.parametrize("by_layer", [False, True])
def test_lightning_training_step_and_automatic_optimization(by_layer):
    module, callback = lightning_run("scratch", by_layer)
    assert len(callback.records) == 3
    for record in callback.records:
        assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
        assert record.feature_maps == callback.largest_saved == (16 * 64 + 16 * 10) * F32
        # the update (its 4 MB temporary) is the optimizer phase, and the iteration's peak
        assert record.peak_phase == "optimizer"
        update_start = record.phases["backward"].allocated_at_end - F32
        assert record.phases["optimizer"].peak_allocated == update_start + SCRATCH * F32
        assert record.weights == record.gradients == sum(nbytes(p) for p in module.parameters())
        if by_layer and can_chain():
            acts = {m: n for (m, c), n in record.layers.by_module.items() if c == "activations"}
            assert acts == {"(input)": 16 * 32 * F32, "net.1": 16 * 64 * F32}
            assert set(record.layers.calls) == {"net", "net.0", "net.1", "net.2"}


def test_lightning_with_lbfgs_counts_each_closure_call():
    module, callback = lightning_run("lbfgs", False)
    assert len(callback.records) == 3
    for record, calls in zip(callback.records, callback.calls):
        assert calls >= 2
        assert record.forward_passes == record.backward_passes == calls
        assert record.optimizer_steps == 1
        assert record.feature_maps == (16 * 64 + 16 * 10) * F32
        assert record.phases["optimizer"].occurrences == 1


def test_a_closed_profiler_leaves_no_cycle_behind():
    import gc
    import weakref

    model = StepWrapper()
    profiler = profile(model, by_layer=True)
    model.training_step(torch.randn(4, 32), torch.randn(4, 10)).backward()
    profiler.record_stats()
    profiler.close()
    hooks = weakref.ref(profiler._meter._hooks)
    gc.disable()
    try:
        del profiler
        assert hooks() is None
    finally:
        gc.enable()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_children_take_no_hooks_and_forward_is_still_found():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU())))
    with profile(model) as profiler:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            record = profiler.record_stats()
            assert (record.forward_passes, record.backward_passes) == (1, 1)


def test_a_compiled_child_is_hooked_and_the_modules_inside_it_are_not():
    model = StepWrapper()
    model.net = torch.compile(model.net, backend="eager")
    x, y = torch.randn(8, 32), torch.randn(8, 10)
    with profile(model) as profiler:
        assert hooked(model) == ["", "net"]  # nothing inside the compiled region
        for _ in range(2):
            F.mse_loss(model.net(x), y).backward()
            record = profiler.record_stats()
            assert (record.forward_passes, record.backward_passes) == (1, 1)
            assert record.feature_maps == (8 * 64 + 8 * 10) * F32
