"""On a CUDA GPU: phases without the root forward, closures, sparse embeddings, and the user's
saved-tensor hooks (``save_on_cpu``) with per-layer attribution, against the allocator's own counters.

Run on a GPU machine: ``PYTHONPATH=. python3 -m pytest -m cuda -q tests/test_phases_cuda.py``.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.saved_tensors import can_chain

pytestmark = pytest.mark.cuda

SCRATCH = 4 * 1024 * 1024  # float32 elements: 16 MiB, a multiple of the allocator's 512-byte blocks


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


class StepWrapper(nn.Module):
    """Like a LightningModule: the step calls ``self.net``, never the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 8))

    def training_step(self, x, y):
        return F.mse_loss(self.net(x), y)


class ScratchSGD(torch.optim.SGD):
    """SGD whose update holds a known temporary after the closure ran; notes allocated before it."""

    update_start = 0

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update_start = torch.cuda.memory_allocated()
        scratch = torch.ones(SCRATCH, device=self.param_groups[0]["params"][0].device)
        del scratch
        super().step()
        return loss


def test_closure_step_through_a_child_on_cuda():
    dev = device()
    model = StepWrapper().to(dev)
    opt = ScratchSGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256, device=dev), torch.randn(64, 8, device=dev)

    def closure():
        opt.zero_grad()
        loss = model.training_step(x, y)
        loss.backward()
        return loss

    # one step first: cuBLAS takes its workspace from the allocator at its first matmul
    opt.step(closure)
    opt.zero_grad()
    # the allocator's delta over the child's forward, measured without the profiler
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model.net(x)
    expected_feature_maps = torch.cuda.memory_allocated() - before
    del out
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        for _ in range(3):
            opt.step(closure)
            record = profiler.record_stats()
            assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
            assert record.feature_maps == expected_feature_maps
            assert record.peak_phase == "optimizer"
            assert record.phases["optimizer"].peak_allocated == opt.update_start + SCRATCH * 4
            if can_chain():
                assert {m for m, _ in record.layers.by_module} <= {"(input)", "net.0", "net.1", "net.2", "net.3", "net.4"}
                assert record.layers.by_module[("net.1", "activations")] == 64 * 1024 * 4


def save_on_cpu_run(build, make_batches, print_period: int, profiled: bool):
    """Training steps whose forward runs under ``save_on_cpu()``, with the profiler (``by_layer=True``)
    or without it: per step (what forward left on the GPU, the iteration peak, the record or ``None``),
    and the final weights. The allocator is read around the same steps in both runs."""
    dev = device()
    torch.manual_seed(0)
    model = build().to(dev)
    opt = torch.optim.Adam(model.parameters())
    torch.manual_seed(1)
    batches = make_batches(dev)
    profiler = MemoryProfiler(model, print_period, stream=io.StringIO(), strict=True, by_layer=True) if profiled else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    figures = []
    for x in batches:
        if profiler is None:
            torch.cuda.reset_peak_memory_stats()  # where record_stats() starts an iteration
        before = torch.cuda.memory_allocated()
        with torch.autograd.graph.save_on_cpu():
            out = model(x)
        forward_delta = torch.cuda.memory_allocated() - before
        out.square().mean().backward()
        del out
        opt.step()
        opt.zero_grad()
        if profiler is None:
            torch.cuda.synchronize()
            figures.append((forward_delta, torch.cuda.max_memory_allocated(), None))
        else:
            record = profiler.record_stats()
            if record.reported:  # feature maps are measured on reported iterations (None on the others)
                assert forward_delta == record.feature_maps
            figures.append((forward_delta, record.iteration_peak_allocated, record))
    if profiler is not None:
        profiler.close()
    return figures, [p.detach().cpu() for p in model.parameters()]


def test_save_on_cpu_with_by_layer_changes_neither_feature_maps_nor_peak():
    def run(profiled: bool):
        return save_on_cpu_run(
            lambda: nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(6)]),
            lambda dev: [torch.randn(512, 1024, device=dev) for _ in range(3)],
            1,
            profiled,
        )

    plain, plain_weights = run(False)
    profiled, weights = run(True)
    for (maps, peak, _), (p_maps, p_peak, record) in zip(plain[1:], profiled[1:]):
        assert p_maps == maps  # the activations went to the CPU, as without the profiler
        assert p_peak == peak
        if can_chain():
            assert record.layers.total == 0  # nothing saved stays on the GPU
    # only the output (512 x 1024 float32) stays on the GPU after forward
    assert plain[1][0] == 512 * 1024 * 4
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


def test_sparse_embeddings_on_cuda():
    dev = device()
    torch.manual_seed(0)
    emb = nn.Embedding(10_000, 64, sparse=True).to(dev)
    opt = torch.optim.SparseAdam(emb.parameters())
    ids = torch.randint(0, 10_000, (4096,), device=dev)
    with MemoryProfiler(emb, 1, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(2):
            emb(ids).square().mean().backward()
            grad = emb.weight.grad
            opt.step()
            record = profiler.record_stats()
            opt.zero_grad()
    held = grad._indices().untyped_storage().nbytes() + grad._values().untyped_storage().nbytes()
    assert record.gradients == held == 4096 * 8 + 4096 * 64 * 4
    state = opt.state[emb.weight]
    assert record.optimizer_state == state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
    assert record.weights == 10_000 * 64 * 4


def test_lightning_on_cuda():
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = StepWrapper().net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return ScratchSGD(self.parameters(), lr=0.01)

    class Profile(pl.Callback):
        def __init__(self) -> None:
            self.records: list = []

        def on_train_start(self, trainer, module):
            self.profiler = MemoryProfiler(module, 1, stream=io.StringIO(), strict=True, by_layer=True)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.records.append(self.profiler.record_stats())

        def on_train_end(self, trainer, module):
            self.profiler.close()

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(192, 256), torch.randn(192, 8))
    callback = Profile()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=64))
    assert len(callback.records) == 3
    for record in callback.records:
        assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
        assert record.peak_phase == "optimizer"
        assert record.feature_maps > 64 * 1024 * 4
        if can_chain():
            assert all(m == "(input)" or m.startswith("net.") for m, _ in record.layers.by_module)


def test_save_on_cpu_with_by_layer_on_a_cnn_reported_or_not():
    """A CNN (convolutions, batch norm) under ``save_on_cpu()``, ``by_layer=True`` and ``print_period=2``:
    on reported and non-reported iterations alike, what forward leaves on the GPU and the iteration
    peak equal those of the run without the profiler, measured by the allocator around the same
    steps (and the reported feature maps equal it), and the weights are the same."""
    deterministic, benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    # the same convolution algorithms (and workspaces) in both runs
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def run(profiled: bool):
        return save_on_cpu_run(
            lambda: nn.Sequential(
                nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                nn.AvgPool2d(64), nn.Flatten(), nn.Linear(64, 10),
            ),  # fmt: skip  (AvgPool2d: AdaptiveAvgPool2d's CUDA backward is not deterministic)
            lambda dev: [torch.randn(64, 3, 64, 64, device=dev) for _ in range(5)],
            2,
            profiled,
        )

    try:
        plain, plain_weights = run(False)
        profiled, weights = run(True)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark
    # the first iteration makes Adam's state: compared from the second on
    for i, ((maps, peak, _), (p_maps, p_peak, record)) in enumerate(zip(plain[1:], profiled[1:]), start=2):
        assert p_maps == maps, i  # the activations went to the CPU, as without the profiler
        assert record.reported == (i % 2 == 0), i
        assert p_peak == peak, i
        if can_chain():
            assert (record.layers is not None) == (i % 2 == 0), i  # per-layer figures on reported iterations
            if record.layers is not None:
                assert record.layers.total == 0  # nothing saved stays on the GPU
    # the activations (each conv's output is 64 MiB) went to the CPU: little stays on the GPU
    assert plain[1][0] < 1024 * 1024
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
