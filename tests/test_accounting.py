"""Bytes of weights, gradients, buffers and optimizer state, against numel() * element_size()."""

from __future__ import annotations

import torch
from torch import nn

from pytorch_mem_profiler.measure.accounting import (
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
