"""The user's saved-tensor hooks run exactly as without the profiler, per-layer mode included.

``saved_tensors_hooks`` is a stack whose top alone runs: the profiler's per-layer
watcher chains to the pair that was on top, so the user's pack and unpack hooks
see every tensor, the run computes the same numbers, and the figures are what
stays on the device after the user's hooks.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

import pytorch_mem_profiler.measure.saved_tensors as saved_tensors
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.saved_tensors import ChainedSavedTensorsHooks, can_chain

from .helpers import needs_saved_tensor_watch


class HalfPrecisionActivations:
    """A hand-written pair: keeps what backward needs in float16, counts its calls."""

    def __init__(self) -> None:
        self.packs = 0
        self.unpacks = 0
        self.kept: dict[int, int] = {}  # storage address -> bytes, of what pack returned

    def pack(self, t: torch.Tensor):
        self.packs += 1
        half = t.half()
        self.kept[half.untyped_storage().data_ptr()] = half.untyped_storage().nbytes()
        return (t.dtype, half)

    def unpack(self, packed):
        self.unpacks += 1
        dtype, half = packed
        return half.to(dtype)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def train(profiled: bool, iterations: int = 4, **kw):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = [(torch.randn(16, 32), torch.randn(16, 10)) for _ in range(iterations)]
    profiler = MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, **kw) if profiled else None
    user = HalfPrecisionActivations()
    per_iteration, records = [], []
    try:
        for x, y in batches:
            before = (user.packs, user.unpacks)
            with user.hooks():
                loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            per_iteration.append((user.packs - before[0], user.unpacks - before[1]))
            if profiler is not None:
                records.append(profiler.record_stats())
    finally:
        if profiler is not None:
            profiler.close()
    return model, per_iteration, records, user


@pytest.mark.parametrize("by_layer", [True, False])
def test_a_hand_written_pair_runs_exactly_as_without_the_profiler(by_layer):
    plain_model, plain_calls, _, _ = train(profiled=False)
    model, calls, records, _ = train(profiled=True, by_layer=by_layer)
    assert calls == plain_calls
    # the first Linear saves its input (the weight's gradient needs it; the input needs no
    # gradient), the others their input and weight, ReLU and Tanh their outputs, pow its base
    assert plain_calls[0] == (1 + 2 * 2 + 2 + 1,) * 2
    for mine, theirs in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(mine, theirs)  # bitwise
    assert all(r.forward_passes == r.backward_passes == 1 for r in records)


@needs_saved_tensor_watch
def test_figures_are_what_stays_on_the_device_after_the_users_hooks():
    model = mlp()
    user = HalfPrecisionActivations()
    x = torch.randn(16, 32)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        with user.hooks():
            out = model(x)
        out.sum().backward()
        record = profiler.record_stats()
    layers = record.layers
    # the profiler saw the float16 copies the user's hook made, and only them
    assert layers.total == sum(user.kept.values())
    assert layers.inputs == 0  # the input itself is not kept: its half copy is, under the first Linear
    by_module = {m: n for (m, _), n in layers.by_module.items()}
    assert by_module["1"] == by_module["3"] == 16 * 64 * 2  # ReLU's and Tanh's outputs, in float16
    assert by_module["0"] == 16 * 32 * 2  # the input, in float16
    assert by_module["2"] == 16 * 64 * 2 + 64 * 64 * 2  # the input and the weight, in float16
    # what forward left allocated: those copies and the output
    assert record.feature_maps == layers.total + 16 * 10 * 4 == layers.total + layers.unattributed


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's own ``save_on_cpu``, its calls counted."""

    def __init__(self) -> None:
        super().__init__()
        self.packs = self.unpacks = 0
        pack, unpack = self.pack_hook, self.unpack_hook

        def counted_pack(t):
            self.packs += 1
            return pack(t)

        def counted_unpack(p):
            self.unpacks += 1
            return unpack(p)

        self.pack_hook, self.unpack_hook = counted_pack, counted_unpack


def test_save_on_cpu_keeps_running_on_reported_iterations():
    def run(profiled: bool):
        model = mlp()
        opt = torch.optim.Adam(model.parameters())
        torch.manual_seed(2)
        hooks = CountingSaveOnCpu()
        profiler = MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) if profiled else None
        calls, records = [], []
        for _ in range(3):
            x = torch.randn(8, 32)
            before = (hooks.packs, hooks.unpacks)
            with hooks:
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            calls.append((hooks.packs - before[0], hooks.unpacks - before[1]))
            if profiler is not None:
                records.append(profiler.record_stats())
        if profiler is not None:
            profiler.close()
        return model, calls, records

    plain, plain_calls, _ = run(False)
    model, calls, records = run(True)
    assert calls == plain_calls and plain_calls[0] == (8, 8)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    if can_chain():
        # on CPU the copies stay on the profiled device: they are what the layers keep
        for record in records:
            assert record.layers.total > 0
            assert record.layers.total + record.layers.unattributed == record.feature_maps


def test_the_profiler_leaves_the_stack_as_it_found_it():
    model = mlp()
    user = HalfPrecisionActivations()
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        with user.hooks():
            top = saved_tensors.top_saved_tensors_hooks() if can_chain() else None
            model(torch.randn(4, 32)).sum().backward()
            if can_chain():
                assert saved_tensors.top_saved_tensors_hooks() == top
        if can_chain():
            assert saved_tensors.top_saved_tensors_hooks() is None
        profiler.record_stats()


def test_without_a_readable_stack_nothing_is_pushed(monkeypatch, caplog):
    """Torch 2.4 to 2.7 cannot tell which hooks are active: the watcher pushes nothing there."""
    monkeypatch.setattr(saved_tensors, "_TOP", None)
    assert not can_chain() and not ChainedSavedTensorsHooks(print).push()
    plain_model, plain_calls, _, _ = train(profiled=False, iterations=2)
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        model, calls, records, _ = train(profiled=True, iterations=2, by_layer=True)
    assert calls == plain_calls
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    assert all(r.layers is None and r.feature_maps > 0 for r in records)
    assert any("saved-tensor hooks" in r.getMessage() for r in caplog.records)


@needs_saved_tensor_watch
def test_a_fault_while_watching_never_reaches_the_users_forward():
    seen = []

    def broken(kept):
        seen.append(kept)
        raise RuntimeError("watcher bug")

    faults = []
    hooks = ChainedSavedTensorsHooks(broken, on_fault=faults.append)
    user = HalfPrecisionActivations()
    x = torch.randn(3, requires_grad=True)
    with user.hooks():
        assert hooks.push()
        try:
            y = x.exp()
        finally:
            hooks.pop()
    y.sum().backward()
    assert user.packs == user.unpacks == 1 and len(seen) == len(faults) == 1
    assert torch.allclose(x.grad, x.exp().half().float())


@pytest.mark.parametrize("by_layer", [False, True])
def test_a_saved_tensor_modified_in_place_still_raises(by_layer):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())  # Sigmoid saves its output
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=by_layer) as profiler:
        out = model(torch.randn(4, 8))
        out.mul_(2)  # the user's bug: autograd needs the output as it was
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        profiler.record_stats()


class OwnHooksBlock(nn.Module):
    """A block whose forward runs its layers under a pair of saved-tensor hooks of its own (as a
    model that offloads or compresses its blocks' activations does)."""

    def __init__(self, user: HalfPrecisionActivations, fail: bool = False) -> None:
        super().__init__()
        self.user = user
        self.fail = fail
        self.inner = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.user.hooks():
            y = self.inner(x)
            if self.fail:
                raise ValueError("the model's own error")
            return y


def model_with_own_hooks(user: HalfPrecisionActivations, fail: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), OwnHooksBlock(user, fail), nn.Linear(64, 10))


def _kept_by_module(user: HalfPrecisionActivations, model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """What the model's own pack hook kept, by the innermost module that saved it (a pack hook of
    the test's, run beside the model's by wrapping it: the independent count)."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = [""]
    kept: dict[str, int] = {}
    pack = user.pack

    def counting_pack(t):
        packed = pack(t)
        kept[stack[-1]] = kept.get(stack[-1], 0) + packed[1].untyped_storage().nbytes()
        return packed

    def enter(module, args):
        stack.append(names[id(module)])

    def leave(module, args, output):
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    user.pack = counting_pack
    try:
        model(x).sum().backward()
    finally:
        user.pack = pack
        for h in handles:
            h.remove()
    return kept


@needs_saved_tensor_watch
def test_a_pair_the_model_pushes_inside_its_forward_is_watched_by_layer():
    """Without the watch over it, the block's layers' tensors went to what no module saved
    (22,528 of 31,360 bytes here) and the peak's make-up counted them as other memory."""
    x = torch.randn(16, 32)
    counted = HalfPrecisionActivations()
    truth = _kept_by_module(counted, model_with_own_hooks(counted), x)
    assert set(truth) == {"2.inner.0", "2.inner.1", "2.inner.2"}

    plain_user = HalfPrecisionActivations()
    plain = model_with_own_hooks(plain_user)
    plain(x).sum().backward()

    user = HalfPrecisionActivations()
    model = model_with_own_hooks(user)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True, overhead=None) as profiler:
        out = model(x)
        assert saved_tensors.top_saved_tensors_hooks() is None  # the block's pair and the watch over it are gone
        out.sum().backward()
        record = profiler.record_stats()
    assert saved_tensors.top_saved_tensors_hooks() is None
    assert (user.packs, user.unpacks) == (plain_user.packs, plain_user.unpacks) == (5, 5)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    by_module = {m: n for (m, _), n in record.layers.by_module.items()}
    for name, nbytes in truth.items():
        assert by_module[name] == nbytes
    assert sum(by_module[name] for name in truth) == sum(user.kept.values())
    # the first Linear keeps the input, Tanh its output (outside the block's pair, in float32)
    assert by_module["(input)"] == 16 * 32 * 4 and by_module["1"] == 16 * 64 * 4
    assert record.layers.unattributed == 16 * 10 * 4  # the output alone
    assert record.layers.total + record.layers.unattributed == record.feature_maps


@needs_saved_tensor_watch
def test_an_error_inside_the_models_own_pair_leaves_the_stack_as_it_was():
    user = HalfPrecisionActivations()
    model = model_with_own_hooks(user, fail=True)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True, overhead=None) as profiler:
        with pytest.raises(ValueError, match="the model's own error"):
            model(torch.randn(4, 32))
        assert saved_tensors.top_saved_tensors_hooks() is None
        model[2].fail = False
        model(torch.randn(4, 32)).sum().backward()
        profiler.record_stats()
    assert saved_tensors.top_saved_tensors_hooks() is None
    assert not saved_tensors._PUSHED and not saved_tensors._OWN_PACKS
