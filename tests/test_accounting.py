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


class PartsOfStorages(nn.Module):
    """Weights and buffers that are parts of larger storages: two parameters sliced from one flat
    buffer (with a gap neither covers), a periodic window (``torch.hann_window(n)`` keeps ``n`` of
    ``n + 1`` values), and two overlapping buffers over one storage."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.randn(100)
        self.w = nn.Parameter(flat[:48].view(6, 8))
        self.b = nn.Parameter(flat[60:66])
        self.register_buffer("window", torch.hann_window(8))
        shared = torch.zeros(20)
        self.register_buffer("left", shared[:12])
        self.register_buffer("right", shared[8:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x * self.window, self.w, self.b) + self.left[:6] + self.right[:6]


def _unique_storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_weights_and_buffers_that_are_parts_of_a_storage_hold_all_of_it_once():
    model = PartsOfStorages()
    assert model.window.untyped_storage().nbytes() == 9 * 4  # torch's periodic window: a slice
    params = unique_parameters(model, CPU)
    assert sum(n for _, n in weight_bytes(params)) == _unique_storage_bytes(model.parameters()) == 100 * 4
    assert dict(weight_bytes(params)) == {"w": 48 * 4 + (100 - 54) * 4, "b": 6 * 4}
    truth = _unique_storage_bytes(model.buffers())
    assert truth == 9 * 4 + 20 * 4
    assert sum(n for _, n in buffer_bytes(model, CPU)) == buffers_total(model.buffers(), CPU) == truth
    assert dict(buffer_bytes(model, CPU))["window"] == 9 * 4


def test_the_profiler_and_the_estimate_count_parts_of_storages_whole():
    """The record's weights and buffers are the storages', and the CPU estimate equals the measured peak."""
    import functools
    import io

    from pytorch_mem_profiler import MemoryProfiler, estimate_memory

    from .helpers import measured_peak

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    model = PartsOfStorages()
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True) as profiler:
        model(torch.randn(4, 8)).sum().backward()
        record = profiler.record_stats()
    assert record.weights == _unique_storage_bytes(model.parameters())
    assert record.buffers == _unique_storage_bytes(model.buffers())
    measured = measured_peak(PartsOfStorages, lambda: torch.randn(4, 8), sgd)
    est = estimate_memory(PartsOfStorages, lambda b: torch.randn(b, 8), batch_size=4, optimizer=sgd, device="cpu", fit=False)
    assert est.peak == measured and est.weights == record.weights and est.buffers == record.buffers
