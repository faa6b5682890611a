"""Bytes of weights, gradients, buffers and optimizer state, against numel() * element_size()."""

from __future__ import annotations

import torch
from torch import nn

from pytorch_mem_profiler.measure.accounting import (
    GradientSizes,
    allocation_bytes,
    buffer_bytes,
    buffers_total,
    gradient_bytes,
    optimizer_state_bytes,
    unique_parameters,
    weight_bytes,
)

from .helpers import nbytes

CPU = torch.device("cpu")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # one storage, two names


def test_tied_weights_count_once_under_first_name():
    model = Tied()
    names = [name for name, _ in unique_parameters(model, CPU)]
    assert names == ["embed.weight"]
    assert dict(weight_bytes(unique_parameters(model, CPU))) == {"embed.weight": 100 * 16 * 4}


def test_distinct_parameters_over_one_storage_count_once():
    model = nn.Module()
    base = torch.zeros(10, 10)
    model.a = nn.Parameter(base)
    model.b = nn.Parameter(base)  # another Parameter object, the same memory
    assert [n for n, _ in unique_parameters(model, CPU)] == ["a"]


def test_gradient_bytes_follow_grad_presence():
    model = nn.Linear(8, 4)
    params = unique_parameters(model, CPU)
    assert gradient_bytes(params) == [0, 0]
    model(torch.randn(2, 8)).sum().backward()
    assert gradient_bytes(params) == [nbytes(model.weight), nbytes(model.bias)] == [128, 16]


class ConcatenatedBias(nn.Module):
    """q and v biases concatenated around zeros into one qkv bias, as timm's EVA and BEiT do:
    backward splits the 3 x 16 gradient into views, and ``.grad`` keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(48, 16))
        self.q_bias = nn.Parameter(torch.zeros(16))
        self.v_bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))
        return nn.functional.linear(x, self.weight, bias)


def _unique_grad_storages(model: nn.Module) -> int:
    return sum({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}.values())


def test_gradients_that_share_a_larger_storage_count_all_of_it_once():
    model = ConcatenatedBias()
    model(torch.randn(4, 16)).sum().backward()
    assert model.q_bias.grad.untyped_storage().data_ptr() == model.v_bias.grad.untyped_storage().data_ptr()
    params = unique_parameters(model, CPU)
    # the weight's gradient, and the one 48-float bias gradient both bias gradients are part of
    truth = _unique_grad_storages(model)
    assert truth == 48 * 16 * 4 + 48 * 4
    assert sum(gradient_bytes(params)) == sum(GradientSizes(params)()) == truth
    # each keeps its own bytes; the first also carries the k part no parameter's gradient covers
    assert gradient_bytes(params) == GradientSizes(params)() == [48 * 16 * 4, 32 * 4, 16 * 4]


def test_buffer_bytes_of_batchnorm():
    bn = nn.BatchNorm2d(6)
    expected = nbytes(bn.running_mean) + nbytes(bn.running_var) + nbytes(bn.num_batches_tracked)
    assert sum(n for _, n in buffer_bytes(bn, CPU)) == expected == 6 * 4 * 2 + 8


def test_buffers_total_counts_listed_buffers_once_each_as_buffer_bytes_does():
    model = nn.Sequential(nn.BatchNorm2d(6), nn.BatchNorm1d(3))
    shared = model[0]
    listed = [*model.buffers(), *shared.buffers(), None]  # a module listed twice, a hole
    assert buffers_total(listed, CPU) == sum(n for _, n in buffer_bytes(model, CPU)) == (6 + 3) * 4 * 2 + 2 * 8
    assert buffers_total([torch.zeros(4, device="meta")], CPU) == 0


def test_adam_state_bytes():
    model = nn.Linear(10, 5)
    opt = torch.optim.Adam(model.parameters())
    assert optimizer_state_bytes([opt], CPU) == 0
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    independent = sum(
        nbytes(t) for state in opt.state.values() for t in state.values() if torch.is_tensor(t)
    )
    # exp_avg and exp_avg_sq per parameter, plus a float32 step counter each
    assert optimizer_state_bytes([opt], CPU) == independent == 2 * (50 + 5) * 4 + 2 * 4
    # on another device, Adam's CPU step counters are not that device's memory
    assert optimizer_state_bytes([opt], torch.device("meta")) == 0


def test_allocation_bytes_of_expanded_view():
    ones = torch.ones(())
    assert allocation_bytes(ones.expand(1000)) == 4
    assert allocation_bytes(torch.empty(10)) == 40
