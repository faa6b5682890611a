"""``measure.cudnn_sizes``: ATen's choice of cuDNN's RNN algorithm (which decides the workspace), and
that where cuDNN cannot be asked the estimate keeps its rule. The answers themselves are checked
against the GPU in ``tests/test_rnn_cudnn_sizes_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from pytorch_mem_profiler.measure.cudnn_sizes import rnn_algorithm, rnn_temp_sizes

STANDARD, PERSIST_STATIC, SMALL_H = 0, 1, 3
H100, V100, T4, A40 = (9, 0, 132), (7, 0, 80), (7, 5, 40), (8, 6, 84)
BASE = dict(proj=0, layers=1, bidirectional=False, seq_len=64, batch=32, input_size=256, half=False, double=False)


@pytest.mark.parametrize(
    "mode, hidden, forward, expected",
    [
        ("lstm", 192, True, SMALL_H), ("lstm", 193, True, STANDARD), ("lstm", 128, False, SMALL_H), ("lstm", 160, False, STANDARD),
        ("gru", 192, True, SMALL_H), ("rnn_tanh", 384, True, SMALL_H), ("rnn_tanh", 385, True, STANDARD),
        ("rnn_relu", 256, False, SMALL_H), ("rnn_relu", 320, False, STANDARD),
    ],
)  # fmt: skip
def test_small_hidden_sizes_take_the_persistent_kernel_forward_and_backward_apart(mode, hidden, forward, expected):
    assert rnn_algorithm(mode, hidden=hidden, forward=forward, device_properties=H100, **BASE) == expected


def test_projections_and_double_precision_keep_the_standard_algorithm():
    assert rnn_algorithm("lstm", hidden=128, forward=True, device_properties=H100, **{**BASE, "proj": 64}) == STANDARD
    assert rnn_algorithm("lstm", hidden=128, forward=True, device_properties=H100, **{**BASE, "double": True}) == STANDARD


@pytest.mark.parametrize(
    "mode, card, changes, expected",
    [
        ("lstm", H100, {}, PERSIST_STATIC),
        ("lstm", H100, {"batch": 136}, STANDARD),  # over 128
        ("lstm", H100, {"batch": 36}, STANDARD),  # not a multiple of 8
        ("gru", H100, {}, STANDARD),  # persistent GRUs are left out
        ("rnn_tanh", H100, {"batch": 96}, PERSIST_STATIC),  # hidden under 896
        ("lstm", H100, {"layers": 2}, STANDARD),
        ("lstm", H100, {"bidirectional": True}, STANDARD),
        ("lstm", H100, {"input_size": 200}, STANDARD),  # not a multiple of 128
        ("lstm", A40, {}, STANDARD),  # sm_86
        ("lstm", T4, {}, STANDARD),  # Turing
        ("lstm", V100, {"batch": 32, "seq_len": 40}, PERSIST_STATIC),
        ("lstm", V100, {"batch": 80, "seq_len": 40}, STANDARD),
    ],
)  # fmt: skip
def test_half_precision_layers_take_the_persistent_static_kernel_where_aten_chooses_it(mode, card, changes, expected):
    args = {**BASE, "half": True, **changes}
    assert rnn_algorithm(mode, hidden=512, forward=True, device_properties=card, **args) == expected


@pytest.mark.parametrize(
    "device, dtype",
    [(torch.device("cpu"), torch.float32), (torch.device("meta"), torch.float32), (torch.device("cuda"), torch.bfloat16)],
)
def test_where_cudnn_cannot_be_asked_there_is_no_answer(device, dtype):
    """A CPU or meta device, a dtype cuDNN's RNN does not take (bfloat16: autocast runs it in half
    precision), or no GPU here: ``None``, and the estimate keeps its rule and bound."""
    if device.type == "cuda" and torch.cuda.is_available() and dtype is not torch.bfloat16:
        pytest.skip("a GPU is here: cuDNN answers")
    assert rnn_temp_sizes(device, "lstm", input_size=8, hidden=8, proj=0, layers=1, bidirectional=False, seq_len=4, batch=2,
                          dtype=dtype, dropout=0.0) is None  # fmt: skip


def test_without_a_gpu_nothing_starts_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert rnn_temp_sizes(torch.device("cuda"), "gru", input_size=8, hidden=8, proj=0, layers=1, bidirectional=False,
                          seq_len=4, batch=2, dtype=torch.float32, dropout=0.0) is None  # fmt: skip
    assert not torch.cuda.is_initialized()
