"""What is alive at the peak on a CUDA GPU: the breakdown sums to the allocator's own peak of the
same step, its activations match what a ``saved_tensors_hooks`` pack hook saw (GPT-2 small in bf16
autocast, ResNet-50), and a cuDNN LSTM's per-layer total is every storage it saved."""

from __future__ import annotations

import io
from typing import Callable

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

from .helpers import SavedBytes

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def allocator_peak_of(step: Callable[[], None]) -> int:
    """``torch.cuda.max_memory_allocated()`` over one unprofiled ``step`` (after two warm-ups:
    optimizer state, cuBLAS/cuDNN workspaces)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def profiled(model: nn.Module, step: Callable[[], None], **kw):
    """One profiled iteration of ``step`` (the profiler starts its iteration at a record)."""
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, **kw) as profiler:
        profiler.record_stats()
        step()
        return profiler.record_stats()


def check_sums(record, expected_peak: int) -> None:
    breakdown = dict(record.peak_breakdown)
    assert all(v >= 0 for v in breakdown.values()), breakdown
    assert sum(breakdown.values()) == record.iteration_peak_allocated == expected_peak, (breakdown, expected_peak)
    assert breakdown["weights"] >= record.weights


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(DEV)  # built from its config, nothing downloaded
    model.train()
    config.use_cache = False
    ids = torch.randint(0, config.vocab_size, (4, 256), device=DEV)
    return model, ids


def gpt2_step(model, ids, opt, saved: SavedBytes | None = None):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if saved is not None:
                with saved.hooks():
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def test_gpt2_small_bf16_peak_and_activations():
    model, ids = gpt2()
    # GPT-2's dropout draws random numbers: the same seed makes the same step
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    expected = allocator_peak_of(gpt2_step(model, ids, opt))
    saved = SavedBytes(model, (ids,))
    record = profiled(model, gpt2_step(model, ids, opt, saved), by_layer=True)
    check_sums(record, expected)
    activations = record.peak_breakdown["activations"]
    # the peak is where backward begins (the logits' gradients): everything saved is alive then
    assert activations == pytest.approx(saved.total, rel=0.02), (dict(record.peak_breakdown), saved.total)
    assert record.intermediate_gradients > 0


def test_resnet50_peak_and_activations():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(16, 3, 224, 224, device=DEV)
    target = torch.randint(0, 1000, (16,), device=DEV)

    def make_step(saved: SavedBytes | None = None):
        def step():
            if saved is not None:
                with saved.hooks():
                    out = model(x)
            else:
                out = model(x)
            nn.functional.cross_entropy(out, target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    # BatchNorm's running statistics change each step, its figures do not
    expected = allocator_peak_of(make_step())
    saved = SavedBytes(model, (x,))
    record = profiled(model, make_step(saved), by_layer=True)
    check_sums(record, expected)
    assert record.peak_breakdown["activations"] == pytest.approx(saved.total, rel=0.02), (
        dict(record.peak_breakdown),
        saved.total,
    )
    assert record.peak_breakdown["inputs"] == x.untyped_storage().nbytes()


class CudnnLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(256, 512, num_layers=2, batch_first=True)
        self.head = nn.Linear(512, 256)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_cudnn_lstm_per_layer_total_is_every_saved_storage():
    """cuDNN's RNN saves a reserve buffer it makes inside the op: attributed to the LSTM all the same."""
    assert torch.backends.cudnn.enabled
    model = CudnnLstm().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 128, 256, device=DEV)
    holder: dict[str, SavedBytes] = {}

    def step():
        saved = holder["saved"] = SavedBytes(model, ())
        with saved.hooks():
            out = model(x)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    expected = allocator_peak_of(step)
    record = profiled(model, step, by_layer=True)
    check_sums(record, expected)
    saved = holder["saved"]
    layers = record.layers
    attributed = sum(layers.by_module.values())
    assert attributed == saved.total, (dict(layers.by_module), saved.total)
    assert layers.inputs == saved.seen.get(x.untyped_storage().data_ptr(), 0)
    assert layers.by_module[("rnn", "activations")] > attributed / 2
    # the peak breakdown's activations by module come from the same storages
    assert record.peak_layers is not None
    assert sum(record.peak_layers.values()) <= record.peak_breakdown["activations"]
