"""Recurrent layers in a CUDA estimate without a GPU: cuDNN's buffers by the rule, an error bound, no raw errors."""

from __future__ import annotations

import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import block_size
from pytorch_mem_profiler.estimate.rnn import UNMEASURED_SHARE, cudnn_rnn_buffers


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
    reserve = layers * directions * seq * batch * (4 * hidden + hidden + hidden) * 4  # gates, cell, output per step
    assert cudnn_rnn_buffers("lstm", seq_len=seq, batch=batch, hidden=hidden, proj=hidden, layers=2, directions=1, element_size=4).reserve == reserve
    output = batch * seq * hidden * 4
    states = layers * batch * hidden * 4  # h0 and c0, zeros made by nn.LSTM, saved with the input
    by_module = {m: n for (m, _), n in est.layers.by_module.items()}
    embedded = batch * seq * 64 * 4  # the layer's input: the embedding's output, first saved here
    assert by_module["rnn"] == block_size(embedded) + block_size(output) + block_size(reserve) + 2 * block_size(states)
    workspace = seq * batch * 4 * hidden * 4
    assert est.error_bounds == {"aten._cudnn_rnn (lstm)": int(UNMEASURED_SHARE * (reserve + workspace))}
    assert "± aten._cudnn_rnn (lstm) (rule not measured)" in str(est)


def test_under_autocast_cudnn_keeps_a_half_precision_copy_of_the_weights():
    est = _estimate(nn.GRU, autocast=torch.bfloat16)
    rnn = Tagger(nn.GRU).rnn
    weight_buf = sum(p.numel() for p in rnn.parameters()) * 2
    seq, batch, hidden = 40, 8, 128
    reserve = 2 * seq * batch * (3 * hidden + 2 * hidden) * 2
    saved = {m: n for (m, _), n in est.layers.by_module.items()}["rnn"]
    # the half-precision input, h0, the output, the reserve and the weight buffer
    parts = [batch * seq * 64 * 2, 2 * batch * hidden * 2, batch * seq * hidden * 2, reserve, weight_buf]
    assert saved == sum(block_size(n) for n in parts)


def test_every_recurrent_kind_runs_bidirectional_and_projected_without_a_raw_error():
    for kind, kwargs in ((nn.RNN, {"bidirectional": True}), (nn.GRU, {"bidirectional": True}), (nn.LSTM, {})):
        est = _estimate(kind, **kwargs)
        assert est.peak > est.weights and est.error_bound > 0
    on_cpu = estimate_memory(lambda: Tagger(nn.LSTM), torch.zeros(8, 40, dtype=torch.long), device="cpu", fit=False)
    assert on_cpu.error_bounds == {}  # the CPU's own kernels: counted exactly
