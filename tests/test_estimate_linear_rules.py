"""A linear layer over a non-contiguous input: the bias added in place, as the device adds it
(``estimate.linear_rules``), against what a mode-free step runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.linear_rules import LinearBiasRules


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape, dims", [((6, 5, 16), (1, 0, 2)), ((3, 6, 5, 16), (0, 2, 1, 3))])
def test_the_rule_computes_what_linear_computes_bit_for_bit(shape, dims):
    """On real tensors the rule gives ``F.linear``'s output and gradients to the bit: without a mode
    ATen runs the same ``matmul`` and in-place ``add_`` for a non-contiguous input."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 24)
    source = torch.randn(shape, requires_grad=True)
    results = []
    for rules in (None, LinearBiasRules("cpu")):
        layer.zero_grad(set_to_none=True)
        source.grad = None
        x = source.permute(dims)
        assert not x.is_contiguous()
        if rules is None:
            out = F.linear(x, layer.weight, layer.bias)
        else:
            with rules:
                out = F.linear(x, layer.weight, layer.bias)
        out.square().sum().backward()
        results.append((out.detach(), source.grad, layer.weight.grad, layer.bias.grad))
    for mine, theirs in zip(*results):
        assert torch.equal(mine, theirs)


def test_under_the_fake_mode_the_bias_is_added_in_place_only_where_aten_adds_it_so():
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        weight, bias = torch.empty(24, 16), torch.empty(24)
        cases = {
            "transposed": (torch.empty(5, 6, 16).transpose(0, 1), ["aten.add_.Tensor"], ["aten.add.Tensor"]),
            "contiguous 3-D": (torch.empty(6, 5, 16), ["aten.addmm.default"], ["aten.add_.Tensor", "aten.add.Tensor"]),
            "2-D": (torch.empty(5, 16).t().contiguous().t(), ["aten.addmm.default"], ["aten.add_.Tensor"]),
        }
        for name, (x, present, absent) in cases.items():
            ops = Ops()
            with LinearBiasRules("cpu"), ops:
                out = F.linear(x, weight, bias)
            assert out.shape == (*x.shape[:-1], 24), name
            assert all(op in ops.names for op in present) and not any(op in ops.names for op in absent), (name, ops.names)
            ops = Ops()
            with ops:
                F.linear(x, weight, bias)
            if name == "transposed":  # the fake mode alone takes ATen's out-of-place branch
                assert "aten.add.Tensor" in ops.names and "aten.add_.Tensor" not in ops.names


class TransposedHead(nn.Module):
    """A vocabulary head over a transposed activation: the head's output is the step's largest tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).transpose(0, 1))


def test_the_cuda_estimate_makes_no_output_sized_add_where_the_device_adds_in_place():
    """The emulated CUDA estimate's allocations: the head's output once (its ``matmul``), no
    ``aten.add`` copy of it; the CPU estimate (checked against the CPU counter, which runs under a
    dispatch mode and so takes ATen's out-of-place branch) keeps it."""
    est = estimate_memory(TransposedHead, lambda b: torch.randn(b, 16, 32), batch_size=8, device="cuda", fit=False, emulate=True)
    output = 8 * 16 * 4096 * 4
    made = [(n, est.step_events.sources.get(k, "")) for k, n in est.step_events.events if n >= output]
    assert made and not any(source.startswith("aten.add.Tensor") for _, source in made), made
    assert any(source.startswith("aten.mm.default; forward") for _, source in made), made


def test_the_rule_reaches_the_linear_calls_inside_torchs_attention():
    """``nn.MultiheadAttention`` runs ``F.multi_head_attention_forward``, which a mode sees once, for
    itself; its projections over the transposed ``batch_first`` input are ``linear`` calls beneath it.
    Under the rule each of them adds its bias in place, as ATen does without a mode, and the name
    ``F.linear`` is torch's own again after the block."""
    from torch._subclasses import FakeTensorMode

    own = F.linear
    attention = nn.MultiheadAttention(32, 4, batch_first=True, kdim=24, vdim=24)  # three projections
    with FakeTensorMode(allow_non_fake_inputs=True):
        x, memory = torch.empty(2, 5, 32), torch.empty(2, 7, 24)
        ops = Ops()
        with ops:
            attention(x, memory, memory, need_weights=False)
        plain = ops.names.count("aten.add.Tensor")
        ops = Ops()
        with LinearBiasRules("cpu"), ops:
            attention(x, memory, memory, need_weights=False)
    assert F.linear is own and torch.nn.functional.linear is torch._C._nn.linear
    assert plain >= 3, ops.names  # without the rule: the projections' biases out of place
    assert ops.names.count("aten.add_.Tensor") >= 3 and ops.names.count("aten.add.Tensor") == plain - 3, ops.names


def test_the_rule_leaves_real_tensors_to_linear_and_gives_it_back_when_the_block_fails():
    own = F.linear
    calls: list[tuple] = []

    def users_linear(*args, **kwargs):  # another library's patch of F.linear, made before the estimate
        calls.append(args)
        return own(*args, **kwargs)

    x, layer = torch.randn(5, 6, 16).transpose(0, 1), nn.Linear(16, 8)
    F.linear = users_linear
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with LinearBiasRules("cpu"):
                assert F.linear is not users_linear
                out = F.linear(x, layer.weight, layer.bias)  # real tensors: the replaced function's call
                raise RuntimeError("inside")
        assert F.linear is users_linear and len(calls) == 1
        assert torch.equal(out, own(x, layer.weight, layer.bias))
    finally:
        F.linear = own
