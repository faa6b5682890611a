"""Losses whose CUDA kernels ATen writes as composites, for fake tensors: the temporaries they make.

``binary_cross_entropy_with_logits`` (``F.binary_cross_entropy_with_logits``,
``nn.BCEWithLogitsLoss``) is one operator to the fake mode, which makes its output and
nothing else. ATen's CUDA code (``aten/src/ATen/native/Loss.cpp``) is a composite:

- forward: ``log_sigmoid(input)`` (input-sized; its CUDA buffer is empty), with
  ``pos_weight`` the weight ``(pos_weight - 1).mul(target)`` (the first freed at once,
  the second at the end of its block), then ``(1 - target)`` (target-sized) multiplied
  and subtracted in place: the loss itself under ``reduction="none"``, else reduced into
  the output; the temporaries are freed as the function returns (the loss, then the
  log-sigmoid);
- backward (``binary_cross_entropy_with_logits_backward``): ``input.sigmoid()`` and
  in-place ``sub_``, ``mul_``, ``div_`` (one input-sized gradient); with ``pos_weight``,
  ``pos_weight.mul(target)``, its ``add(1)`` (the gradient) and a ``sigmoid`` freed at once.
  On fake tensors the backward takes its out-of-place branch (fake tensors are tensor
  subclasses: ``areAnyTensorSubclassLike``), a ``sub`` and a ``mul`` more than the GPU makes.

:class:`LossRules` (a ``TorchFunctionMode`` for the length of a CUDA estimate's step)
runs the loss as an autograd function that makes ATen's tensors, in ATen's order, with
fake tensors. Under autocast the loss runs in float32, as CUDA's autocast casts it.
``F.ctc_loss`` with a ``"mean"`` or ``"sum"`` reduction is reduced as ATen reduces it for plain
tensors (its composite takes another branch for tensor subclasses, fake ones included: a
division by the lengths where they lie, which fails for lengths kept on the host beside a CUDA
loss, where the real step runs).
What is not covered: a full reduction's own scratch (a ``mean`` of a large loss takes
two 512-byte blocks inside its kernel on an H200), a ``target`` that requires a gradient
(the operator runs as the fake mode runs it).

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), LossRules("cpu"):
    ...     logits = torch.empty(8, requires_grad=True)
    ...     loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.empty(8))
    >>> type(loss.grad_fn).__name__, tuple(loss.shape)
    ('_BCEWithLogitsBackward', ())
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LossRules"]

_NONE, _MEAN, _SUM = 0, 1, 2
_REDUCTIONS = {"none": _NONE, "mean": _MEAN, "sum": _SUM}


class _BCEWithLogits(torch.autograd.Function):
    """What ATen's ``binary_cross_entropy_with_logits`` and its backward allocate (no values computed)."""

    @staticmethod
    def forward(ctx, input, target, weight, pos_weight, reduction: int):  # type: ignore[no-untyped-def, override]
        log_sigmoid = input.new_empty(input.shape)
        if pos_weight is not None:
            shifted = pos_weight.new_empty(pos_weight.shape)  # pos_weight - 1
            log_weight = shifted.new_empty(torch.broadcast_shapes(pos_weight.shape, target.shape))  # .mul(target)
            del shifted
            del log_weight  # the end of its block, after log_sigmoid.mul_(log_weight)
        dtype = torch.result_type(target, 1)
        if reduction == _NONE:
            out = target.new_empty(target.shape, dtype=dtype)  # (1 - target), multiplied in place: the loss
        else:
            loss = target.new_empty(target.shape, dtype=dtype)
            out = loss.mean() if reduction == _MEAN else loss.sum()
            del loss
        del log_sigmoid
        ctx.save_for_backward(input, target, weight, pos_weight)
        ctx.reduction = reduction
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        input, target, _weight, pos_weight = ctx.saved_tensors
        if pos_weight is None:
            grad_input = input.new_empty(input.shape)  # input.sigmoid(), then sub_, mul_, div_ in place
        else:
            scaled = pos_weight.new_empty(torch.broadcast_shapes(pos_weight.shape, target.shape))  # pos_weight.mul(target)
            grad_input = scaled.new_empty(scaled.shape)  # .add(1), then sub_ in place
            sigmoid = input.new_empty(input.shape)  # mul_(input.sigmoid())
            del sigmoid
            del scaled
            if tuple(grad_input.shape) != tuple(input.shape):
                grad_input = grad_input.sum_to_size(input.shape)
        return grad_input, None, None, None, None


class LossRules(TorchFunctionMode):
    """Runs ``binary_cross_entropy_with_logits`` as ATen's CUDA code allocates, on fake tensors (see the module).

    Args:
        autocast_device: the device type whose autocast state says whether the
            step runs under autocast (``"cpu"`` where fake CPU tensors stand in for CUDA).
    """

    def __init__(self, autocast_device: str) -> None:
        super().__init__()
        self.autocast_device = autocast_device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.ctc_loss:
            return _ctc_loss_reduced(args, kwargs)
        parsed = None
        if func is F.binary_cross_entropy_with_logits:
            parsed = _functional_args(args, kwargs)
        elif func is torch.binary_cross_entropy_with_logits:
            parsed = _aten_args(args, kwargs)
        if parsed is None or not _covered(*parsed[:4]):
            return func(*args, **kwargs)
        input, target, weight, pos_weight, reduction = parsed
        if torch.is_autocast_enabled(self.autocast_device):
            # autocast runs the loss in float32: its casts are the autocast's, recorded by autograd
            input, target, weight, pos_weight = (
                t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t
                for t in (input, target, weight, pos_weight)
            )
        with torch.autocast(self.autocast_device, enabled=False):
            return _BCEWithLogits.apply(input, target, weight, pos_weight, reduction)


def _ctc_loss_reduced(args: tuple, kwargs: dict) -> Any:
    """``F.ctc_loss`` as ATen reduces it for tensors that are not subclasses: the lengths read on the
    host and the mean taken over the per-sequence losses divided by ``target_lengths`` made anew on
    the loss's device (``at::tensor(target_lengths, res.options())``). Fake tensors are subclasses,
    for which ATen divides by ``target_lengths`` where it lies: lengths kept on the host beside a
    CUDA loss made the fake step fail where the real one runs."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")
    bound = {"blank": 0, "reduction": "mean", "zero_infinity": False, **dict(zip(names, args)), **kwargs}
    log_probs, target_lengths, reduction = bound.get("log_probs"), bound.get("target_lengths"), bound["reduction"]
    if reduction not in ("mean", "sum") or not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 3:
        return F.ctc_loss(*args, **kwargs)
    losses = F.ctc_loss(**{**bound, "reduction": "none"})
    if reduction == "sum":
        return losses.sum()
    if isinstance(target_lengths, torch.Tensor):
        divisor = target_lengths.to(losses.device, torch.long, copy=True)
    else:
        divisor = torch.tensor(list(target_lengths), dtype=torch.long, device=losses.device)
    return (losses / divisor.clamp_min(1)).mean()


def _functional_args(args: tuple, kwargs: dict) -> tuple | None:
    names = ("input", "target", "weight", "size_average", "reduce", "reduction", "pos_weight")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        return None  # the legacy arguments: as torch runs them
    reduction = _REDUCTIONS.get(bound.get("reduction", "mean"))
    if reduction is None or "input" not in bound or "target" not in bound:
        return None
    return bound["input"], bound["target"], bound.get("weight"), bound.get("pos_weight"), reduction


def _aten_args(args: tuple, kwargs: dict) -> tuple | None:
    names = ("input", "target", "weight", "pos_weight", "reduction")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    reduction = bound.get("reduction", _MEAN)
    if reduction not in (_NONE, _MEAN, _SUM) or "input" not in bound or "target" not in bound:
        return None
    return bound["input"], bound["target"], bound.get("weight"), bound.get("pos_weight"), reduction


def _covered(input: Any, target: Any, weight: Any, pos_weight: Any) -> bool:
    """Fake floating tensors of one shape whose only gradient is the input's; anything else runs as torch runs it."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(input, FakeTensor) or not isinstance(target, FakeTensor) or input.shape != target.shape:
        return False
    if not input.is_floating_point() or not target.is_floating_point():
        return False
    for extra in (weight, pos_weight):
        if extra is not None and (not isinstance(extra, FakeTensor) or extra.requires_grad):
            return False
    return not target.requires_grad
