"""Recurrent layers in a CUDA estimate without a GPU: cuDNN's buffers by the rule, an error bound, no raw errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .helpers import ByteBuffers

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import block_size
from pytorch_mem_profiler.estimate.rnn import UNMEASURED_SHARE, WORKSPACE_FLOOR, cudnn_rnn_buffers, dropout_state_bytes, workspace_bound


class Tagger(nn.Module):
    def __init__(self, kind: type[nn.Module] = nn.LSTM, **kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.rnn = kind(64, 128, num_layers=2, batch_first=True, **kwargs)
        self.head = nn.Linear(128 * (2 if kwargs.get("bidirectional") else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def _estimate(kind, autocast=None, **kwargs):
    return estimate_memory(
        lambda: Tagger(kind, **kwargs), torch.zeros(8, 40, dtype=torch.long), device="cuda", emulate=True, autocast=autocast, fit=False
    )


def test_an_lstm_saves_its_output_states_and_cudnns_reserve_space_for_backward():
    est = _estimate(nn.LSTM)
    layers, directions, seq, batch, hidden = 2, 1, 40, 8, 128
    # gates, cell, output per step and layer, less the last layer's output (the output tensor), plus 256 bytes
    reserve = directions * (layers * 6 - 1) * seq * batch * hidden * 4 + 256
    assert cudnn_rnn_buffers("lstm", seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=2, directions=1, element_size=4).reserve == reserve
    output = batch * seq * hidden * 4
    states = layers * batch * hidden * 4  # h0 and c0, zeros made by nn.LSTM, saved with the input
    by_module = {m: n for (m, _), n in est.layers.by_module.items()}
    embedded = batch * seq * 64 * 4  # the layer's input: the embedding's output, first saved here
    assert by_module["rnn"] == block_size(embedded) + block_size(output) + block_size(reserve) + 2 * block_size(states)
    sizes = dict(seq_len=seq, batch=batch, hidden=hidden, input_size=64, layers=layers, directions=directions, element_size=4)
    assert est.error_bounds == {"aten._cudnn_rnn (lstm)": workspace_bound("lstm", **sizes)}
    assert "± aten._cudnn_rnn (lstm) (inside one operator)" in str(est)


def test_under_autocast_cudnn_keeps_a_half_precision_copy_of_the_weights():
    est = _estimate(nn.GRU, autocast=torch.bfloat16)
    rnn = Tagger(nn.GRU).rnn
    weight_buf = sum(p.numel() for p in rnn.parameters()) * 2
    seq, batch, hidden = 40, 8, 128
    reserve = (2 * 7 - 1) * seq * batch * hidden * 2 + 256  # a GRU: 3 + 3 gate halves and the output per layer
    saved = {m: n for (m, _), n in est.layers.by_module.items()}["rnn"]
    # the half-precision input, h0, the output, the reserve and the weight buffer
    parts = [batch * seq * 64 * 2, 2 * batch * hidden * 2, batch * seq * hidden * 2, reserve, weight_buf]
    assert saved == sum(block_size(n) for n in parts)


def test_a_plain_rnns_unmeasured_reserve_is_a_kept_bound_and_its_workspace_one_operators():
    est = _estimate(nn.RNN)
    layers, seq, batch, hidden = 2, 40, 8, 128
    buffers = cudnn_rnn_buffers("rnn_tanh", seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=layers, directions=1, element_size=4)
    bound = workspace_bound("rnn_tanh", seq_len=seq, batch=batch, hidden=hidden, input_size=hidden, layers=layers, directions=1, element_size=4)
    assert buffers.reserve_bound == -(-UNMEASURED_SHARE * buffers.reserve // 1) and buffers.bound == bound + buffers.reserve_bound
    # the layer's own input is the embedding's 64 features
    bound = workspace_bound("rnn_tanh", seq_len=seq, batch=batch, hidden=hidden, input_size=64, layers=layers, directions=1, element_size=4)
    assert est.error_bounds == {
        "aten._cudnn_rnn (rnn_tanh)": bound,
        "aten._cudnn_rnn (rnn_tanh) reserve": buffers.reserve_bound,
    }
    assert est.transient_bounds == {"aten._cudnn_rnn (rnn_tanh)"}
    # the workspace is the one operator's, the reserve is kept for backward: both can be at the peak
    assert est.error_bound == bound + buffers.reserve_bound
    assert "± aten._cudnn_rnn (rnn_tanh) reserve (kept alive)" in str(est)


def test_every_recurrent_kind_runs_bidirectional_and_projected_without_a_raw_error():
    for kind, kwargs in ((nn.RNN, {"bidirectional": True}), (nn.GRU, {"bidirectional": True}), (nn.LSTM, {})):
        est = _estimate(kind, **kwargs)
        assert est.peak > est.weights and est.error_bound > 0
    on_cpu = estimate_memory(lambda: Tagger(nn.LSTM), torch.zeros(8, 40, dtype=torch.long), device="cpu", fit=False)
    assert on_cpu.error_bounds == {}  # the CPU's own kernels: counted exactly


# cuDNN's reserve space (the uint8 tensor its forward saves) measured on an NVIDIA H100 80GB HBM3,
# torch 2.11.0+cu130, by benchmarks/rnn_rules.py (rnn_rules.json of the 2026-11-25 run):
# (mode, layers, hidden, seq, batch, directions, element size) -> bytes
MEASURED_RESERVE = {
    ("lstm", 2, 512, 128, 32, 1, 4): 92274944,
    ("lstm", 1, 512, 128, 32, 1, 4): 41943296,
    ("lstm", 3, 512, 128, 32, 1, 4): 142606592,
    ("lstm", 2, 128, 128, 32, 1, 4): 23068928,
    ("lstm", 2, 1024, 128, 32, 1, 4): 184549632,
    ("lstm", 2, 512, 16, 32, 1, 4): 11534592,
    ("lstm", 2, 512, 128, 128, 1, 4): 369099008,
    ("lstm", 2, 512, 128, 32, 2, 4): 184549632,
    ("lstm", 1, 512, 128, 32, 2, 2): 41943296,
    ("lstm", 2, 512, 128, 32, 1, 2): 46137600,
    ("gru", 2, 512, 128, 32, 1, 4): 109052160,
    ("gru", 1, 512, 128, 32, 1, 4): 50331904,
    ("gru", 1, 512, 128, 32, 2, 4): 100663552,
    ("gru", 1, 512, 128, 32, 2, 2): 50331904,
}


def test_the_reserve_rule_gives_the_measured_reserve_to_the_byte():
    for (mode, layers, hidden, seq, batch, directions, element), measured in MEASURED_RESERVE.items():
        rule = cudnn_rnn_buffers(
            mode, seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=layers, directions=directions, element_size=element
        )  # fmt: skip
        assert rule.reserve == measured, (mode, layers, hidden, seq, batch, directions, element)


# The same run's forward workspace (peak inside the forward above what it leaves), in MiB, and the
# rule's: the rule's spread around them is what the bound must cover.
MEASURED_WORKSPACE_MIB = {
    ("lstm", 2, 512, 128, 32, 1, 4): 76.0,
    ("lstm", 3, 512, 128, 32, 1, 4): 92.0,
    ("lstm", 2, 128, 128, 32, 1, 4): 64.0,
    ("lstm", 2, 1024, 128, 32, 1, 4): 154.5,
    ("lstm", 2, 512, 16, 32, 1, 4): 36.75,
    ("lstm", 2, 512, 128, 4, 1, 4): 36.0,
    ("lstm", 2, 512, 128, 128, 1, 4): 212.0,
    ("lstm", 2, 512, 128, 32, 2, 4): 188.0,
    ("lstm", 1, 512, 128, 32, 1, 2): 98.125,
    ("gru", 1, 512, 128, 32, 1, 2): 30.46875,
}


def test_the_workspace_rule_and_its_bound_cover_every_measured_workspace():
    for (mode, layers, hidden, seq, batch, directions, element), mib in MEASURED_WORKSPACE_MIB.items():
        rule = cudnn_rnn_buffers(
            mode, seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=layers, directions=directions, element_size=element
        )  # fmt: skip
        measured = int(mib * 2**20)
        assert rule.workspace >= WORKSPACE_FLOOR
        assert abs(measured - rule.workspace) <= rule.bound, (mode, layers, hidden, seq, batch, directions, element)


def test_backward_holds_the_flat_weight_gradient_beside_the_workspace_and_the_input_gradient():
    """The step's peak is in cuDNN's backward-weights pass: what ATen's _cudnn_rnn_backward holds then."""
    seq, batch, hidden, inputs = 40, 8, 128, 64
    model = nn.LSTM(inputs, hidden, num_layers=1)
    weights = sum(p.numel() for p in model.parameters()) * 4
    est = estimate_memory(
        lambda: nn.LSTM(inputs, hidden, num_layers=1), torch.zeros(seq, batch, inputs), device="cuda", emulate=True,
        loss_fn=lambda out: out[0].sum(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1), workspace=0, fit=False,
    )  # fmt: skip
    rule = cudnn_rnn_buffers("lstm", seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=1, directions=1, element_size=4)
    output, state = seq * batch * hidden * 4, batch * hidden * 4
    alive = (
        weights + seq * batch * inputs * 4  # the weights, the input
        + 2 * state + output + rule.reserve  # saved by the forward: h0, c0, the output, the reserve
        + 2 * state  # zeros for h_n's and c_n's missing gradients
        + seq * batch * inputs * 4 + 2 * state  # the input's and states' gradients
        + weights + rule.workspace  # the flat weight gradient and the workspace again
    )  # fmt: skip
    assert est.peak_phase == "backward"
    assert est.peak_allocated == pytest.approx(alive, abs=64 * 1024), (est.peak_allocated, alive)


# -- outside the calls: the flat weight buffer, the dropout state ------------------------------------
class Recurrent(nn.Module):
    """An embedding, a recurrent layer, a head: the zoo's language models, small."""

    def __init__(self, kind: type[nn.Module] = nn.GRU, dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 24)
        self.rnn = kind(24, 40, num_layers=2, batch_first=True, **kwargs)
        self.head = nn.Linear(40, 100)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x).to(self.head.weight.dtype))[0])


def _events(build, **kwargs):
    est = estimate_memory(build, torch.zeros(4, 12, dtype=torch.long), device="cuda", emulate=True, fit=False, **kwargs)
    return est, est.step_events


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_weights_come_as_model_to_cuda_leaves_a_recurrent_layer_copied_then_flattened(kind):
    model = Recurrent(kind)
    # what model.to("cuda") asks the allocator for, from the module itself: the copies in _apply's
    # order, and after the recurrent layer's own copies one buffer of its weights, the copies freed
    copies: list[torch.Tensor] = []
    model._apply(lambda t: copies.append(t) or t)
    rnn_weights = list(model.rnn.parameters())
    expected: list[int] = []
    for t in copies:
        expected.append(block_size(t.untyped_storage().nbytes()))
        if t is rnn_weights[-1]:  # the layer's last copy: flatten_parameters runs next
            expected.append(block_size(sum(w.numel() * w.element_size() for w in rnn_weights)))
            expected += [-block_size(w.untyped_storage().nbytes()) for w in rnn_weights]
    est, events = _events(lambda: Recurrent(kind))
    before = [n for key, n in events.events[: events.marks[0][0]] if key >= 0]  # past the cuBLAS workspaces
    assert before[: len(expected)] == expected
    # the weights are one storage per module: the layer's weights are views of its flat buffer
    separate = sum(block_size(p.untyped_storage().nbytes()) for p in model.parameters() if not any(p is w for w in rnn_weights))
    assert est.weights == separate + block_size(sum(w.untyped_storage().nbytes() for w in rnn_weights))


def test_a_recurrent_layer_in_bfloat16_is_not_flattened():
    # cuDNN's flatten_parameters takes half, float and double weights only
    _, events = _events(lambda: Recurrent(nn.GRU, torch.bfloat16))
    before = [n for key, n in events.events[: events.marks[0][0]] if key >= 0]
    assert all(n > 0 for n in before)
    assert len(before) == len([*Recurrent().parameters()]) + 1  # every weight, the batch


def test_dropout_in_training_makes_cudnn_s_dropout_state_once_in_the_first_forward():
    est, events = _events(lambda: Recurrent(nn.GRU, dropout=0.1))
    state = 6_488_064  # measured on an H200 (132 multiprocessors): what a card-less estimate assumes
    made = [(i, key) for i, (key, n) in enumerate(events.events) if n == state]
    assert len(made) == 1  # kept for the process: the second step takes none
    at, key = made[0]
    assert events.phase_at(at) == (1, "forward")
    assert all(k != key for k, n in events.events[at + 1 :])  # never freed
    # the seed before it: an int64 scalar on the device, freed at once
    seed = events.events[at - 2 : at]
    assert [n for _, n in seed] == [512, -512] and seed[0][0] == seed[1][0]
    # its size per multiprocessor is measured on one card: without the card its own size is its bound
    assert est.error_bounds["cuDNN dropout state"] == state
    # without dropout there is none, and no bound
    plain, plain_events = _events(lambda: Recurrent(nn.GRU))
    assert all(n != state for _, n in plain_events.events) and "cuDNN dropout state" not in plain.error_bounds
    assert est.peak_allocated - plain.peak_allocated == state


def test_the_dropout_state_is_sized_by_the_card_s_multiprocessors():
    assert dropout_state_bytes((132, 2048)) == (6_488_064, 0)  # the H200 measured (and an H100 SXM, alike)
    size, bound = dropout_state_bytes((108, 2048))  # an A100: by the same rule, with its own size as the bound
    assert size == 108 * 49_152 and bound == size


def _uint8_buffers(layer: nn.Module, x: torch.Tensor, rules) -> list[int]:
    """The uint8 buffers (reserve, workspaces) the rules make for one training forward and backward
    of ``layer`` on fake tensors, in bytes, in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorded = ByteBuffers()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_layer = type(layer)(layer.input_size, layer.hidden_size, num_layers=layer.num_layers, batch_first=layer.batch_first)
        fake_x = mode.from_tensor(x)
        with rules, recorded:
            fake_layer(fake_x)[0].sum().backward()
    return recorded.sizes


@pytest.mark.parametrize("batch_first", [False, True])
def test_a_measured_workspace_replaces_the_rule_and_its_bound(batch_first):
    from pytorch_mem_profiler.estimate.kernel_probe import MEASURED, recurrent_key
    from pytorch_mem_profiler.estimate.rnn import CudnnRNNRules

    layer = nn.LSTM(32, 64, num_layers=2, batch_first=batch_first)
    seq, batch = 12, 5
    x = torch.randn((batch, seq, 32) if batch_first else (seq, batch, 32))
    rule = cudnn_rnn_buffers("lstm", seq_len=seq, batch=batch, hidden=64, proj=64, layers=2, directions=1, element_size=4)
    pending: set[tuple] = set()
    rules = CudnnRNNRules("cpu", pending=pending)
    # not measured yet: the rule's workspace (forward, backward data, backward weights) and its bound; the call pending
    assert _uint8_buffers(layer, x, rules) == [rule.workspace, rule.reserve, rule.workspace, rule.workspace]  # ATen's order
    key = recurrent_key("lstm", seq_len=seq, batch=batch, input_size=32, hidden=64, proj=64, layers=2, directions=1,
                        bias=True, batch_first=batch_first, dtype=torch.float32, dropout=0.0, train=True)  # fmt: skip
    assert pending == {key} and rules.bounds == {"aten._cudnn_rnn (lstm)": rule.bound}
    # measured: the probe's peak above what the forward leaves, less the input's transposed copy beside it
    transposed = block_size(x.numel() * 4) if batch_first else 0
    MEASURED[key] = 3 * 2**20 + transposed
    try:
        pending.clear()
        rules = CudnnRNNRules("cpu", pending=pending)
        assert _uint8_buffers(layer, x, rules) == [3 * 2**20, rule.reserve, 3 * 2**20, 3 * 2**20]
        assert not pending and rules.bounds == {}
    finally:
        del MEASURED[key]


def test_without_measuring_no_call_is_pending_and_the_rule_stands():
    from pytorch_mem_profiler.estimate.rnn import CudnnRNNRules

    rules = CudnnRNNRules("cpu")
    x = torch.randn(7, 3, 16)
    rule = cudnn_rnn_buffers("gru", seq_len=7, batch=3, hidden=24, proj=24, layers=1, directions=1, element_size=4)
    assert _uint8_buffers(nn.GRU(16, 24), x, rules) == [rule.workspace, rule.reserve, rule.workspace, rule.workspace]
    assert rules.pending is None


@pytest.mark.skipif(
    not torch.cuda.is_available() and (not torch.backends.cuda.is_built() or torch.torch_version.TorchVersion(torch.__version__) < "2.5"),
    reason="without a GPU, torch's CPU-only build refuses building a fake CUDA layer, and torch 2.4's fake initialization starts CUDA",
)
@pytest.mark.parametrize("exact", [True, False, "autocast"])
def test_on_fake_cuda_tensors_cudnn_s_own_sizes_replace_the_rule(monkeypatch, exact):
    """Where the estimate's tensors are fake CUDA ones (a GPU here), each training call asks cuDNN its
    workspaces and reserve (``measure.cudnn_sizes.rnn_temp_sizes``, exact on the GPU) with the call's
    own sizes and dropout, and leaves no bound; ``exact=False`` (emulated, no GPU) and a call under
    autocast keep the rule."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytorch_mem_profiler.estimate.rnn import CudnnRNNRules
    from pytorch_mem_profiler.measure import cudnn_sizes

    asked: list[tuple] = []

    def answer(device, mode, **sizes):
        asked.append((device.type, mode, sizes))
        return cudnn_sizes.RNNTempSizes(forward_workspace=111 * 512, backward_workspace=222 * 512, reserve=333 * 512)

    monkeypatch.setattr(cudnn_sizes, "rnn_temp_sizes", answer)
    recorded = ByteBuffers()
    # the autocast state is read on the device type the rules are given (the CPU's here: no CUDA needed)
    rules = CudnnRNNRules("cpu", exact=bool(exact))
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = nn.GRU(16, 24, num_layers=2, batch_first=True, dropout=0.25, device="cuda")
        x = torch.empty(5, 7, 16, device="cuda")
        with rules, recorded, torch.autocast("cpu", dtype=torch.bfloat16, enabled=exact == "autocast"):
            layer(x)  # the forward: fake CUDA tensors run backward only where a GPU is (the CUDA tests)
    element = 2 if exact == "autocast" else 4
    rule = cudnn_rnn_buffers("gru", seq_len=7, batch=5, hidden=24, proj=24, layers=2, directions=1, element_size=element)
    sizes = recorded.sizes
    buffers = [s for s in sizes if s != rules.dropout_state.numel()] if rules.dropout_state is not None else sizes
    if exact is True:
        assert buffers == [111 * 512, 333 * 512]  # the forward's workspace, then the reserve
        assert asked == [("cuda", "gru", {"input_size": 16, "hidden": 24, "proj": 0, "layers": 2, "bidirectional": False,
                                          "seq_len": 7, "batch": 5, "dtype": torch.float32, "dropout": 0.25, "lengths": None})]  # fmt: skip
        assert rules.bounds == {} and rules.reserve_bounds == {}
    else:
        weight_buf = [sum(p.numel() for p in layer.parameters()) * 2] if exact == "autocast" else []
        assert buffers == weight_buf + [rule.workspace, rule.reserve] and asked == []
        assert rules.bounds == {"aten._cudnn_rnn (gru)": rule.bound - rule.reserve_bound}


#: Layers drawn by ``benchmarks/rnn_rules.py --grid`` on an H200 (torch 2.11, cuDNN 9.19) where cuDNN's
#: own workspace (the larger of the forward's and the backward's) lay furthest above the projections'
#: rule, beyond its old spread (all six): (mode, layers, hidden, input, steps, batch, bidirectional, element size) -> bytes.
CUDNN_WORKSPACE_FAR_FROM_THE_RULE = {
    ("lstm", 3, 2048, 1024, 512, 64, True, 4): 4756 * 2**20,
    ("rnn_tanh", 2, 2048, 512, 512, 128, True, 4): 6596 * 2**20,
    ("rnn_tanh", 2, 768, 128, 512, 256, True, 4): 4807.75 * 2**20,
    ("rnn_tanh", 4, 64, 1024, 512, 256, True, 4): 3684.31 * 2**20,
    ("gru", 4, 2048, 1024, 8, 1, True, 2): 568.63 * 2**20,
    ("lstm", 3, 2048, 1024, 8, 1, False, 4): 376.58 * 2**20,
}


@pytest.mark.parametrize("layer, measured", CUDNN_WORKSPACE_FAR_FROM_THE_RULE.items(), ids=lambda v: str(v))
def test_the_stated_workspace_bound_covers_cudnns_workspace_far_from_the_fitted_sizes(layer, measured):
    mode, layers, hidden, input_size, seq, batch, bidirectional, element = layer
    buffers = cudnn_rnn_buffers(mode, seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=layers,
                                directions=2 if bidirectional else 1, element_size=element, input_size=input_size)  # fmt: skip
    assert abs(measured - buffers.workspace) <= buffers.bound - buffers.reserve_bound
