"""Operators whose shapes follow a lengths tensor's values (``pytorch_mem_profiler/estimate/lengths.py``):
CTC loss, against the CPU's kernels and a measured step."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate import EstimateUnsupported
from pytorch_mem_profiler.estimate.fake import fake_mode
from tests.helpers import measured_peak

aten = torch.ops.aten
FRAMES, BATCH, CLASSES, WIDTH = 40, 3, 12, 9


def _real_and_fake(target_lengths, as_tensor: bool, fake_lengths_known: bool):
    """``_ctc_loss`` run for real on the CPU, and in the estimate's fake mode, with the same shapes."""
    log_probs = torch.randn(BATCH, FRAMES, CLASSES).log_softmax(-1).transpose(0, 1)
    targets = torch.randint(1, CLASSES, (BATCH, WIDTH))
    inputs = [FRAMES] * BATCH
    real = aten._ctc_loss(log_probs, targets, torch.tensor(inputs), torch.tensor(target_lengths)) if as_tensor else (
        aten._ctc_loss(log_probs, targets, inputs, target_lengths))
    with fake_mode():
        fake_lp = torch.empty(BATCH, FRAMES, CLASSES).transpose(0, 1)
        fake_targets = torch.empty(BATCH, WIDTH, dtype=torch.long)
        if not as_tensor:
            fake = aten._ctc_loss(fake_lp, fake_targets, inputs, target_lengths)
        elif fake_lengths_known:  # a real tensor met inside the fake mode keeps its values
            fake = aten._ctc_loss(fake_lp, fake_targets, torch.tensor(inputs), torch.tensor(target_lengths))
        else:
            lengths = torch.empty(BATCH, dtype=torch.long)  # a stand-in without values
            fake = aten._ctc_loss(fake_lp, fake_targets, lengths, lengths)
    return real, fake


@pytest.mark.parametrize("as_tensor", [False, True])
def test_ctc_losss_outputs_take_the_cpu_kernels_bytes_from_the_lengths_values(as_tensor):
    real, fake = _real_and_fake([9, 4, 7], as_tensor, fake_lengths_known=True)
    for r, f in zip(real, fake):
        assert f.shape == r.shape and f.dtype == r.dtype
        assert f.untyped_storage().nbytes() == r.untyped_storage().nbytes()
    assert real[1].untyped_storage().nbytes() == BATCH * FRAMES * (2 * 9 + 1) * 4


def test_ctc_loss_without_the_lengths_values_takes_the_padded_width():
    # exact where the longest target fills the padding, as a collate function pads
    real, fake = _real_and_fake([WIDTH, 2, 5], True, fake_lengths_known=False)
    assert [f.untyped_storage().nbytes() for f in fake] == [r.untyped_storage().nbytes() for r in real]
    # an upper bound where it does not: the kernel's log_alpha for a longest target of 5, against 9
    short, fake = _real_and_fake([5, 2, 5], True, fake_lengths_known=False)
    assert fake[1].untyped_storage().nbytes() - short[1].untyped_storage().nbytes() == BATCH * FRAMES * 2 * (WIDTH - 5) * 4


def test_ctc_loss_over_concatenated_targets_without_lengths_is_refused_naming_it():
    with fake_mode():
        log_probs = torch.empty(FRAMES, BATCH, CLASSES)
        lengths = torch.empty(BATCH, dtype=torch.long)
        with pytest.raises(Exception, match="_ctc_loss"):
            aten._ctc_loss(log_probs, torch.empty(20, dtype=torch.long), lengths, lengths)


class _Acoustic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 32, 3, padding=1)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.conv(x)).transpose(1, 2))  # (batch, frames, classes)


def _ctc(out: torch.Tensor, labels: torch.Tensor, label_lengths: torch.Tensor | None = None) -> torch.Tensor:
    log_probs = out.float().log_softmax(-1).transpose(0, 1)
    frames = torch.full((out.shape[0],), out.shape[1], dtype=torch.long)
    if label_lengths is None:  # computed in the loss: no values in the fake step
        label_lengths = torch.full((out.shape[0],), labels.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, labels, frames, label_lengths)


@pytest.mark.parametrize("lengths", ["in the loss", "with the batch"])
def test_a_ctc_training_step_is_estimated_to_the_byte_on_the_cpu(lengths):
    torch.manual_seed(0)
    batch = 4

    def make_targets():
        labels = torch.randint(1, CLASSES, (batch, WIDTH))
        if lengths == "in the loss":
            return labels
        return labels, torch.tensor([WIDTH, 3, 6, WIDTH])  # padded to the longest

    optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    measured = measured_peak(_Acoustic, lambda: torch.randn(batch, 8, FRAMES), optimizer, loss_fn=_ctc,
                             make_targets=make_targets)
    estimate = estimate_memory(_Acoustic, lambda b: torch.randn(b, 8, FRAMES), targets=lambda b: make_targets(),
                               loss_fn=_ctc, optimizer=optimizer, batch_size=batch, device="cpu", fit=False)
    assert estimate.peak == measured


def test_the_emulated_cuda_estimate_of_ctc_does_not_refuse_it():
    try:
        estimate = estimate_memory(_Acoustic, lambda b: torch.randn(b, 8, FRAMES), targets=lambda b: torch.randint(1, CLASSES, (b, WIDTH)),
                                   loss_fn=_ctc, batch_size=4, device="cuda", fit=False)
    except EstimateUnsupported as err:  # pragma: no cover - the failure this guards against
        pytest.fail(str(err))
    assert sum(estimate.peak_breakdown.values()) == estimate.peak


def test_rocms_kernel_question_is_answered_no_on_a_cuda_build():
    """``ctc_loss`` on CUDA tensors asks ``_use_miopen_ctc_loss`` (torch 2.10 and newer), which has no
    fake kernel: on a build without MIOpen the answer is no, whatever the tensors."""
    from pytorch_mem_profiler.estimate.lengths import length_rule

    ask = getattr(torch.ops.aten, "_use_miopen_ctc_loss", None)
    if ask is None:
        pytest.skip(f"torch {torch.__version__} does not ask it")
    if torch.version.hip is not None:
        assert length_rule(ask.default) is None  # left unanswered on ROCm: refused, naming it
        return
    log_probs, targets = torch.randn(30, 2, 5).log_softmax(2), torch.randint(1, 5, (2, 10))
    for overload in ask.overloads():
        rule = length_rule(getattr(ask, overload))
        assert rule is not None and rule((log_probs, targets, [30, 30], [10, 10], 0), {}) is False


def test_lengths_whose_values_the_fake_mode_holds_are_read_inside_it():
    """On fake CUDA tensors a factory's small tensor (``torch.full((batch,), frames)``) carries its
    values as a real tensor (the fake tensor's ``constant``); the rule runs inside the fake mode, where
    reading them with tensor operators would make fake tensors of them, without values."""
    log_probs = torch.randn(BATCH, FRAMES, CLASSES).log_softmax(-1).transpose(0, 1)
    targets = torch.randint(1, CLASSES, (BATCH, WIDTH))
    lengths = [WIDTH - 2, WIDTH - 4, WIDTH - 3]
    real = aten._ctc_loss(log_probs, targets, [FRAMES] * BATCH, lengths)
    mode = fake_mode()
    known = mode.fake_tensor_converter.from_real_tensor(mode, torch.tensor(lengths), make_constant=True)
    frames = mode.fake_tensor_converter.from_real_tensor(mode, torch.full((BATCH,), FRAMES), make_constant=True)
    assert known.constant is not None
    with mode:
        log_probs, padded = torch.empty(BATCH, FRAMES, CLASSES).transpose(0, 1), torch.empty(BATCH, WIDTH, dtype=torch.long)
        fake = aten._ctc_loss(log_probs, padded, frames, known)
    # log_alpha follows the longest target's value, not the padded width
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]
    assert fake[1].shape[-1] == 2 * max(lengths) + 1 != 2 * WIDTH + 1


class _PackedTagger(nn.Module):
    """An LSTM over ``pack_padded_sequence`` (sorted or not), padded back with or without a total
    length, and a per-token head: the packed rows follow the lengths' values."""

    def __init__(self, batch_first: bool, enforce_sorted: bool, total: bool, bidirectional: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
        self.head = nn.Linear(32 if bidirectional else 16, 5)
        self.batch_first, self.enforce_sorted, self.total = batch_first, enforce_sorted, total

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        ids, lengths = batch  # a list: one argument, for the estimate and the measurement alike
        x = self.embed(ids if self.batch_first else ids.t())
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=self.enforce_sorted)
        out, _ = self.lstm(packed)
        total = ids.shape[1] if self.total else None
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=self.batch_first, total_length=total)
        return self.head(padded)


def _packed_inputs(batch: int, enforce_sorted: bool) -> list[torch.Tensor]:
    lengths = torch.tensor([12 - (i * 5) % 9 for i in range(batch)])
    if enforce_sorted:
        lengths = lengths.sort(descending=True).values
    return [torch.randint(0, 50, (batch, 12)), lengths]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch_first, enforce_sorted, total, bidirectional",
    [(True, False, True, True), (False, True, False, False), (True, True, False, True)],
    ids=["batch-first-unsorted-total", "time-first-sorted", "batch-first-sorted"],
)
def test_a_packed_lstm_is_estimated_to_the_byte_on_the_cpu(batch_first, enforce_sorted, total, bidirectional, autocast):
    """The lengths the inputs give keep their values, so the packed rows and ``batch_sizes`` are
    the real step's (``aten._pack_padded_sequence``, refused before); padding back runs ATen's own
    steps (``estimate.packed_sequences``)."""
    build = functools.partial(_PackedTagger, batch_first, enforce_sorted, total, bidirectional)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    measured = measured_peak(build, lambda: _packed_inputs(6, enforce_sorted), sgd, autocast=autocast)
    estimate = estimate_memory(build, lambda b: _packed_inputs(b, enforce_sorted), optimizer=sgd, autocast=autocast, batch_size=6, device="cpu", fit=False)
    assert estimate.peak == measured


def test_a_packed_lstm_for_cuda_is_estimated_with_its_kernel_s_bound_stated():
    """For CUDA without a GPU (emulated) the packed LSTM runs cuDNN's packed kernel by the recurrent
    rules: the packed rows make the reserve, and the workspace, which no rule holds, is stated as the
    operation's bound (on a GPU the fake CUDA step asks cuDNN instead: ``test_rnn_cudnn_sizes_cuda``)."""
    build = functools.partial(_PackedTagger, True, False, True, True)
    for_cuda = estimate_memory(build, lambda b: _packed_inputs(b, False), batch_size=6, device="cuda", fit=False, emulate=True)
    assert set(for_cuda.error_bounds) == {"aten._cudnn_rnn (lstm)"}
    assert for_cuda.error_bound > 0


#: Recurrent layers over packed batches measured on an H200 (torch 2.11, cuDNN 9; ``benchmarks/rnn_rules.py
#: --packed 60``, seed 0: these are its rows 1, 3, 6 and 9, without dropout masks between layers): the
#: reserve the real layer saved, in bytes.
PACKED_RESERVES_H200 = {1: 2_089_216, 3: 11_428_096, 6: 4_075_776, 9: 2_793_728}


@pytest.mark.parametrize("row", sorted(PACKED_RESERVES_H200))
def test_the_emulated_reserve_of_a_packed_batch_is_the_one_measured_on_a_gpu(row):
    """The reserve the emulation gives a packed batch (the recurrent rule over the packed rows as one
    step, as ``CudnnRNNRules`` asks it) against what the layer saved on a GPU, to the byte."""
    import sys
    from pathlib import Path

    from pytorch_mem_profiler.estimate.rnn import cudnn_rnn_buffers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from rnn_rules import packed_configurations

    c = packed_configurations(60, seed=0)[row]
    buffers = cudnn_rnn_buffers(c["mode"], seq_len=1, batch=sum(c["lengths"]), hidden=c["hidden"], proj=c["hidden"],
                                layers=c["layers"], directions=2 if c["bidirectional"] else 1,
                                element_size=torch.empty((), dtype=c["dtype"]).element_size(), input_size=c["input"])  # fmt: skip
    assert buffers.reserve == PACKED_RESERVES_H200[row], c
