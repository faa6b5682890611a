"""What is alive at the peak, by category, on the CPU (exact): each category computed here
independently (parameter storages, the optimizer's state storages, the batch, our own
``saved_tensors_hooks`` pack hook) and the peak by hand; per-layer completeness for RNNs and
attention (every storage autograd saved is attributed to a module, the input or the root)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.stats import PEAK_CATEGORIES

from .helpers import BackwardScratch, SavedBytes, needs_saved_tensor_watch, unique_storage_bytes

SCRATCH = BackwardScratch.SCRATCH_ELEMS * 4


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def saved_bytes(model: nn.Module, *args: torch.Tensor) -> int:
    """Unique storages a forward of ``model`` saves for backward (our own pack hook), the
    parameters and ``args`` left out."""
    saved = SavedBytes(model, args)
    with saved.hooks():
        out = model(*args)
    del out
    return saved.total


class Scratched(nn.Module):
    """``body`` then :class:`BackwardScratch`: backward begins with a 4 MB temporary, while every
    activation the body saved is still alive (none of its backward nodes ran yet)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BackwardScratch.apply(self.body(x))


def mlp_body() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn_body() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )


@pytest.mark.parametrize("by_layer", [True, False], ids=["by_layer", "default"])
@pytest.mark.parametrize("body,shape", [(mlp_body, (64, 32)), (cnn_body, (16, 3, 16, 16))], ids=["mlp", "cnn"])
def test_the_peak_by_category_computed_by_hand(body, shape, by_layer):
    model = Scratched(body())
    opt = torch.optim.Adam(model.parameters())
    records = []
    # by default (the "phases" level, no per-layer hooks) the same figures: the CPU's breakdown
    # sees every storage, module boundaries or not
    with memory_profiler(model, 1, stream=io.StringIO(), strict=True, by_layer=by_layer, overhead=None) as profiler:
        for _ in range(2):
            torch.manual_seed(1)
            x = torch.randn(*shape)  # made while profiled, as a data loader's batch is
            out = model(x)
            loss = out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
            records.append(profiler.record_stats())
    record = records[-1]
    out_bytes = shape[0] * 10 * 4
    # The peak: BackwardScratch.backward, first in backward, at `grad * scratch[0]`. Alive then:
    # the weights, Adam's state (from the first step), the batch, everything the body saved
    # (none of its nodes ran), the output and the loss (still referenced), the loss's seed
    # (made by loss.backward() before backward reached the model: other), and what backward
    # made: the scratch and the result of `grad * scratch[0]` (the gradient handed in is a
    # broadcast view of the seed: sum's backward expands it, no bytes of its own).
    expected = {
        "weights": unique_storage_bytes(*model.parameters()),
        "gradients": 0,  # zero_grad(set_to_none=True) last step, none made yet
        "optimizer_state": unique_storage_bytes(*state_tensors(opt)),
        "activations": saved_bytes(model.body, x),
        "activation_gradients": SCRATCH + out_bytes,
        "inputs": x.untyped_storage().nbytes(),
        "other": out_bytes + 4 + 4,
    }
    assert expected["optimizer_state"] == 2 * expected["weights"] + 4 * len(list(model.parameters()))
    assert expected["activations"] > 0
    if not can_chain():  # torch < 2.8 watches no saved tensors: what they hold counts as other
        expected["other"] += expected.pop("activations")
        expected = {c: expected.get(c, 0) for c in PEAK_CATEGORIES}
    assert record.peak_phase == "backward"
    assert dict(record.peak_breakdown) == expected
    assert list(record.peak_breakdown) == list(PEAK_CATEGORIES)
    assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated == sum(expected.values())
    # backward's peak is the iteration's: intermediate gradients are its activation gradients
    assert record.intermediate_gradients == expected["activation_gradients"] > 0
    # the first iteration had no Adam state yet: the same peak, less the state
    first = records[0]
    assert first.peak_breakdown["optimizer_state"] == 0
    assert first.iteration_peak_allocated == record.iteration_peak_allocated - expected["optimizer_state"]


def test_activation_gradients_at_backwards_peak_without_a_scratch():
    """A plain MLP: backward's peak holds gradients with respect to activations (> 0), and the
    breakdown of the iteration's peak sums to it to the byte."""
    model = mlp_body()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memory_profiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        for _ in range(2):
            x = torch.randn(256, 32)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = profiler.record_stats()
    assert record.intermediate_gradients > 0
    # at least one hidden gradient (256 x 128 float32) is alive at backward's peak
    assert record.intermediate_gradients >= 256 * 128 * 4
    assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated
    assert record.peak_breakdown["weights"] == unique_storage_bytes(*model.parameters())
    assert record.peak_breakdown["inputs"] == x.untyped_storage().nbytes()


# -- per-layer completeness -------------------------------------------------------------------
class Recurrent(nn.Module):
    """A recurrent layer (``nn.LSTM`` or ``nn.GRU`` of 16 -> 32) and a linear head."""

    def __init__(self, kind: type[nn.RNNBase], num_layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = kind(16, 32, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def Lstm() -> Recurrent:
    return Recurrent(nn.LSTM, num_layers=2)


def Gru() -> Recurrent:
    return Recurrent(nn.GRU, num_layers=1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.proj(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0])


@needs_saved_tensor_watch
@pytest.mark.parametrize("build", [Lstm, Gru, Attention], ids=["lstm2", "gru", "multihead_attention"])
def test_per_layer_total_is_every_saved_storage(build):
    model = build()
    # What the user's own pack hook sees (unique storages, parameters left out; the input in).
    saved = SavedBytes(model)
    with memory_profiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        x = torch.randn(8, 12, 16)
        with saved.hooks():
            out = model(x)
        out.pow(2).mean().backward()
        record = profiler.record_stats()
    layers = record.layers
    assert layers is not None and saved.total > 0
    attributed = sum(layers.by_module.values())
    assert attributed == saved.total, (dict(layers.by_module), saved.total)
    assert layers.total + layers.inputs == attributed
    # the batch, where autograd saved it (attention's input projection does; the RNNs save
    # none of it as is on the CPU), is under "(input)"
    assert layers.inputs == saved.seen.get(x.untyped_storage().data_ptr(), 0)
    if build is Attention:
        assert layers.inputs == x.untyped_storage().nbytes()
    # the recurrent or attention module itself saved most of it
    inner = "rnn" if build is not Attention else "attn"
    assert layers.by_module[(inner, "activations")] > attributed / 2
