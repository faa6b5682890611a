"""Operators whose output shapes follow the values of a lengths tensor, for fake tensors.

A fake tensor has no values, and torch's fake mode refuses every operator tagged
``dynamic_output_shape``. CTC loss (``F.ctc_loss``, speech recognition's loss:
Wav2Vec2, Conformer, DeepSpeech fine-tuning) is one: its kernel (``_ctc_loss``, on the
CPU and on CUDA, given lengths as tensors or as lists) returns the loss per sample and
``log_alpha``, the forward variables kept for backward, of shape ``(batch, frames,
2 * longest target + 1)``: the longest target is the largest of ``target_lengths``.
Its backward (``_ctc_loss_backward``, no fake kernel in torch) returns the gradient of
the log-probabilities, contiguous, as both kernels make it.

- Lengths with values (a list of ints, a real tensor, or a fake one whose values the
  step knows: a factory's small tensor, see :mod:`.draws`): the longest is read, and the
  shapes are the kernel's, exact.
- Lengths without values (a tensor of the batch, or one computed in the loss): with
  targets padded to a width (2-D, ``(batch, width)``) the longest target is taken as that
  width. It is an upper bound, and exact where targets are padded to the batch's longest,
  as collate functions pad them; ``log_alpha`` is ``batch * frames * (2 * width + 1)``
  elements. Concatenated targets (1-D) bound it by their total length only: refused, as
  before, naming the operator.

``_use_cudnn_ctc_loss`` (CUDA's choice of cuDNN's kernel, asked before ``_ctc_loss``)
is answered by its conditions on dtypes, devices and shapes (cuDNN takes 1-D ``int32``
targets on the CPU and a blank of 0); where those hold, its answer depends on the
lengths' values, and without them it is refused. ``_use_miopen_ctc_loss`` (ROCm's choice of
MIOpen's kernel, asked too from torch 2.10) is answered no on a CUDA build, which has no MIOpen.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> with fake_mode():
    ...     log_probs = torch.empty(2, 50, 20).transpose(0, 1)      # (frames, batch, classes)
    ...     targets = torch.empty(2, 10, dtype=torch.long)
    ...     lengths = torch.empty(2, dtype=torch.long)              # no values: the padded width
    ...     loss, log_alpha = torch.ops.aten._ctc_loss(log_probs, targets, lengths, lengths)
    ...     _, exact = torch.ops.aten._ctc_loss(log_probs, targets, [50, 50], [7, 4])
    >>> tuple(loss.shape), tuple(log_alpha.shape), tuple(exact.shape)
    ((2,), (2, 50, 21), (2, 50, 15))
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from .operator_args import bound_arguments

__all__ = ["LENGTH_RULES", "known_values", "length_rule"]

aten = torch.ops.aten


def known_values(lengths: Any) -> list[int] | None:
    """``lengths`` as ints where they are known: a list, a real tensor, or a fake tensor with values
    (lengths, ``batch_sizes``); ``None`` where they are not.

    Read with the dispatch modes off: the rules run inside the fake mode, where any operator on
    the values (a real tensor) would make a fake tensor of them, whose ``tolist()`` has no values.
    """
    if isinstance(lengths, (list, tuple)):
        return [int(v) for v in lengths]
    known = lengths.constant if isinstance(lengths, FakeTensor) else lengths
    if not isinstance(known, torch.Tensor) or known.device.type == "meta":
        return None
    with _disable_current_modes():
        return [int(v) for v in known.reshape(-1).tolist()]


def _ctc_loss(func: Any) -> Callable[[tuple, dict], Any]:
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "zero_infinity")

    def rule(args: tuple, kwargs: dict) -> Any:
        given = dict(zip(names, args))
        given.update(kwargs)
        log_probs, targets = given["log_probs"], given["targets"]
        lengths = known_values(given["target_lengths"])
        if lengths is not None:
            longest = max(lengths, default=0)
        elif targets.dim() == 2:
            longest = targets.shape[1]  # padded to the longest: the kernel's shapes
        else:
            raise DynamicOutputShapeException(func)
        frames, batch = log_probs.shape[0], log_probs.shape[1]
        return log_probs.new_empty((batch,)), log_probs.new_empty((batch, frames, 2 * longest + 1))

    return rule


def _ctc_loss_backward(args: tuple, kwargs: dict) -> Any:
    """The gradient of ``log_probs``: a contiguous tensor of its shape (both kernels make it so)."""
    log_probs = args[1] if len(args) > 1 else kwargs["log_probs"]
    return log_probs.new_empty(tuple(log_probs.shape))


def _use_cudnn_ctc_loss(func: Any) -> Callable[[tuple, dict], Any]:
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank")

    def rule(args: tuple, kwargs: dict) -> Any:
        given = dict(zip(names, args))
        given.update(kwargs)
        log_probs, targets = given["log_probs"], given["targets"]
        if not (
            torch.backends.cudnn.enabled
            and given["blank"] == 0
            and targets.dim() == 1
            and log_probs.dtype == torch.float32
            and targets.dtype == torch.int32
            and targets.device.type == "cpu"
            and log_probs.device.type == "cuda"
        ):
            return False
        inputs, target_lengths = known_values(given["input_lengths"]), known_values(given["target_lengths"])
        if inputs is None or target_lengths is None:
            raise DataDependentOutputException(func)
        return all(n == log_probs.shape[0] for n in inputs) and all(n <= 256 for n in target_lengths)

    return rule


def _use_miopen_ctc_loss(args: tuple, kwargs: dict) -> bool:
    """ROCm's choice of MIOpen's kernel: never, on a CUDA build (it has no MIOpen); a question
    that has no fake kernel, asked by ``ctc_loss`` on CUDA tensors (torch 2.10 and newer)."""
    return False


def _pack_padded_sequence(args: tuple, kwargs: dict) -> Any:
    """``pack_padded_sequence``'s kernel on the CPU: the data, ``(sum(lengths), *features)`` in the
    input's dtype, and ``batch_sizes``, the number of sequences still running at each step: a real
    int64 tensor of the host, as the kernel makes it, which the recurrent layers' kernels and
    ``pad_packed_sequence`` (see :mod:`.packed_sequences`) read. Lengths without values are refused,
    naming the operator. The kernel makes the same two on CUDA (the data on the device, ``batch_sizes``
    on the host), where the recurrent layers take cuDNN's packed kernel (:mod:`.rnn`)."""
    given = bound_arguments(aten._pack_padded_sequence.default, args, kwargs)
    lengths = known_values(given["lengths"])
    x = given["input"]
    if lengths is None:
        raise DynamicOutputShapeException(aten._pack_padded_sequence.default)
    data = x.new_empty((sum(lengths), *x.shape[2:]))
    with _disable_current_modes():
        sizes = torch.tensor([sum(1 for n in lengths if n > t) for t in range(max(lengths, default=0))], dtype=torch.int64)
    return data, sizes


#: The rules by operator (the fake mode looks them up with the others of its kind).
LENGTH_RULES: dict[Any, Callable[[tuple, dict], Any]] = {
    aten._ctc_loss.default: _ctc_loss(aten._ctc_loss.default),
    aten._ctc_loss.Tensor: _ctc_loss(aten._ctc_loss.Tensor),
    aten._ctc_loss_backward.default: _ctc_loss_backward,
    aten._ctc_loss_backward.Tensor: _ctc_loss_backward,
    aten._use_cudnn_ctc_loss.default: _use_cudnn_ctc_loss(aten._use_cudnn_ctc_loss.default),
    aten._use_cudnn_ctc_loss.Tensor: _use_cudnn_ctc_loss(aten._use_cudnn_ctc_loss.Tensor),
    aten._pack_padded_sequence.default: _pack_padded_sequence,
}
if torch.version.hip is None and hasattr(aten, "_use_miopen_ctc_loss"):
    # (on ROCm the question stays unanswered: a refusal naming it, rather than a guess)
    for _overload in aten._use_miopen_ctc_loss.overloads():
        LENGTH_RULES[getattr(aten._use_miopen_ctc_loss, _overload)] = _use_miopen_ctc_loss


def length_rule(func: Any) -> Callable[[tuple, dict], Any] | None:
    """The rule for ``func`` (an operator whose shapes follow a lengths tensor's values), or
    ``None``. Call it inside the fake mode."""
    return LENGTH_RULES.get(func)
