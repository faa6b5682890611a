"""Autograd's engine sums a tensor's gradient pieces in place where it holds the last reference
(``InputBuffer::accumulate``), unless a dispatch mode is on: the fake step, always under one, sums
them into new tensors. A CUDA estimate makes the sums as the device does (``measure.engine_sums``).

The truth on the CPU: a real step without any mode (the data pointers of the pieces and of the
sum), and the estimate's own allocator events; on the GPU (``cuda``): the allocator's count of
allocations in backward against the estimate's. The CPU estimate sums in place too, as the
profiled CPU step does (``tests/test_engine_sums.py``): the zoo's CPU tests hold it to the byte.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

ADD = "aten.add.Tensor"


class Tap(torch.autograd.Function):
    """Identity whose backward notes the data pointer of the gradient piece it hands on."""

    @staticmethod
    def forward(ctx, x, log):  # type: ignore[override]
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        piece = grad * 1.0  # a piece only the engine will hold
        ctx.log.append(piece.data_ptr())
        return piece, None


class Branches(nn.Module):
    """``h`` feeds ``width`` linear branches (their gradient pieces summed), and, with
    ``residual``, also the output directly (``AddBackward`` hands one gradient to both)."""

    def __init__(self, width: int = 3, residual: bool = False, dim: int = 64) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.branches = nn.ModuleList(nn.Linear(dim, dim) for _ in range(width))
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        out = sum(branch(h) for branch in self.branches)
        return out + h if self.residual else out


def _backward_births(est) -> list[str]:
    events = est.step_events
    return [
        events.sources[key].split(";")[0]
        for i, (key, n) in enumerate(events.events)
        if n > 0 and events.phase_at(i) == (2, "backward")
    ]


def test_without_a_mode_the_engine_sums_a_tensor_s_gradient_pieces_into_the_first_one():
    x = torch.randn(8, 16, requires_grad=True)
    log: list[int] = []
    h = torch.relu(x)
    summed: list[int] = []
    h.register_hook(lambda g: summed.append(g.data_ptr()))
    (Tap.apply(h, log) * 2.0 + Tap.apply(h, log) * 3.0).sum().backward()
    assert len(log) == 2 and summed[0] in log  # the sum is one of the pieces, added into


def test_under_a_dispatch_mode_it_makes_a_new_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Nothing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(8, 16, requires_grad=True)
    log: list[int] = []
    h = torch.relu(x)
    summed: list[int] = []
    h.register_hook(lambda g: summed.append(g.data_ptr()))
    with Nothing():
        (Tap.apply(h, log) * 2.0 + Tap.apply(h, log) * 3.0).sum().backward()
    assert len(log) == 2 and summed[0] not in log


def _without_in_place_sums(monkeypatch) -> None:
    from pytorch_mem_profiler.measure import engine_sums as accumulation

    monkeypatch.setattr(accumulation.EngineAccumulation, "in_place", lambda self, args, kwargs: False)


def test_a_cuda_estimate_sums_gradient_pieces_in_place(monkeypatch):
    """Three branches: ``h``'s buffer sums three pieces (two sums), each piece a fresh ``mm``
    output only the engine holds: no sum is a new tensor on CUDA, and the step's backward makes
    two allocations fewer, of one piece's bytes each, than it would under a mode."""
    x = torch.randn(32, 64)
    in_place = estimate_memory(Branches(width=3), x, device="cuda", fit=False)
    _without_in_place_sums(monkeypatch)
    new_tensors = estimate_memory(Branches(width=3), x, device="cuda", fit=False)
    assert _backward_births(in_place).count(ADD) == 0
    assert _backward_births(new_tensors).count(ADD) == 2
    before = [n for i, (_, n) in enumerate(new_tensors.step_events.events) if n > 0 and new_tensors.step_events.phase_at(i) == (2, "backward")]
    after = [n for i, (_, n) in enumerate(in_place.step_events.events) if n > 0 and in_place.step_events.phase_at(i) == (2, "backward")]
    assert sum(before) - sum(after) == 2 * 32 * 64 * 4  # two float32 pieces of 32 x 64 (512-byte blocks already)
    assert in_place.peak_allocated <= new_tensors.peak_allocated


def test_a_gradient_the_engine_does_not_hold_alone_is_summed_into_a_new_tensor():
    """A residual: ``AddBackward`` hands the loss's gradient (an expanded view, not dense) to the
    branch and to ``h``; ``h``'s buffer holds it first and cannot add into it: one new tensor,
    as on the device. Without the residual one branch leaves nothing to sum."""
    x = torch.randn(32, 64)
    plain = estimate_memory(Branches(width=1, residual=False), x, device="cuda", fit=False)
    residual = estimate_memory(Branches(width=1, residual=True), x, device="cuda", fit=False)
    two = estimate_memory(Branches(width=2, residual=True), x, device="cuda", fit=False)
    assert _backward_births(plain).count(ADD) == 0
    assert _backward_births(residual).count(ADD) == 1
    assert _backward_births(two).count(ADD) == 1  # the second branch's piece is added in place


def test_a_calibration_that_fails_leaves_every_sum_a_new_tensor(monkeypatch):
    """A fault in the calibration switches the rule off, not the estimate: the sums are new tensors,
    as under a mode."""
    from pytorch_mem_profiler.measure import engine_sums as accumulation

    def broken(self, args, kwargs):
        if self._calibrating:
            raise RuntimeError("calibration broke")
        return self.signature is not None and (args, kwargs) is None

    monkeypatch.setattr(accumulation.EngineAccumulation, "in_place", broken)
    est = estimate_memory(Branches(width=3), torch.randn(32, 64), device="cuda", fit=False)
    assert _backward_births(est).count(ADD) == 2


class Fan(nn.Module):
    """A wide hidden state read by four narrow heads: its gradient's sums hold the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 2048)
        self.heads = nn.ModuleList(nn.Linear(2048, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return sum(head(h) for head in self.heads)


def test_a_cpu_estimate_sums_in_place_and_equals_the_profiled_cpu_step(monkeypatch):
    """The profiled CPU step sums in place (the counter's mode puts the engine's sums back), and
    the CPU estimate does too: its peak is the profiler's to the byte. With the sums out of place
    it would be three pieces above it."""
    from .helpers import measured_peak

    make = lambda: torch.randn(64, 64)  # noqa: E731
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    measured = measured_peak(Fan, make, sgd)
    est = estimate_memory(Fan(), make(), device="cpu", optimizer=sgd, fit=False)
    assert est.peak_allocated == measured
    _without_in_place_sums(monkeypatch)
    out_of_place = estimate_memory(Fan(), make(), device="cpu", optimizer=sgd, fit=False)
    assert out_of_place.peak_allocated - measured == 64 * 2048 * 4  # one piece more, at the peak
