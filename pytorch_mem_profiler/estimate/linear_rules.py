"""A linear layer over a non-contiguous input, for fake tensors: the bias added in place, as the GPU adds it.

``F.linear`` with a bias over an input of three or more dimensions that is not
contiguous (a ``batch_first`` LSTM's output, a transposed or permuted activation) runs
``matmul(input, weight.t())`` and adds the bias into its result
(``aten/src/ATen/native/Linear.cpp``): ``output.add_(bias)`` in place, unless the bias is
"tensor-subclass-like", where it takes ``at::add`` out of place. Every tensor is
subclass-like while a dispatch mode is on (``isTensorSubclassLike``), so under the fake
mode the estimate's step makes a second output-sized tensor the real step does not make:
on a language model's vocabulary head (a 2-layer LSTM, batch 98, 128 steps, 10,000
words) a 502 MB transient and a segment of its own, which put the estimate's reserved
9.8% above the H100's and its largest batch out of memory.

:class:`LinearBiasRules` (a ``TorchFunctionMode`` for the length of a CUDA estimate's
step) runs those calls as the device runs them: the ``matmul``, then the bias added in
place; under autocast with the input, the weight and the bias cast to autocast's dtype
first, as autocast casts a linear layer's arguments. Contiguous inputs (ATen flattens
them into one ``addmm``) and 2-D ones are left to the fake mode, which counts them as the
device does.

A mode sees only the calls made outside its own handler: torch's Python composites
(``F.multi_head_attention_forward``, which every ``nn.MultiheadAttention`` and
``nn.Transformer*Layer`` runs in training) reach the mode once, for themselves, and
their own ``linear`` calls (the query, key and value projections, over the transposed
``batch_first`` input) run beneath it unseen. So for the block the rule also stands in
for ``torch.nn.functional.linear``, the name those composites (and ``nn.Linear``) call
it by, as the emulation stands in for ``F.scaled_dot_product_attention``; a call on
real tensors (another thread's) goes to the function it replaced, untouched.

CPU estimates keep the fake mode's out-of-place add: the CPU counter they are checked
against runs under a dispatch mode too, and takes that branch.

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), LinearBiasRules("cpu"):
    ...     x = torch.empty(8, 4, 16).transpose(0, 1)  # not contiguous
    ...     out = torch.nn.functional.linear(x, torch.empty(32, 16), torch.empty(32))
    >>> tuple(out.shape), out.is_contiguous()
    ((4, 8, 32), True)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

__all__ = ["LinearBiasRules"]

#: torch's own ``linear`` (``torch._C._nn.linear``), whatever name stands for it during a step
_LINEAR = torch._C._nn.linear


class LinearBiasRules(TorchFunctionMode):
    """Runs ``F.linear`` over a non-contiguous input with its bias added in place (see the module).

    Args:
        autocast_device: the device type whose autocast state says whether the
            step runs under autocast (``"cpu"`` where fake CPU tensors stand in for CUDA).
    """

    def __init__(self, autocast_device: str) -> None:
        super().__init__()
        self.autocast_device = autocast_device
        self._replaced: list[Any] = []

    def __enter__(self) -> LinearBiasRules:
        super().__enter__()
        # composites look ``linear`` up in torch.nn.functional at each call: stand in there too
        self._replaced.append(F.linear)
        F.linear = self._linear_by_name
        return self

    def __exit__(self, *exc: object) -> None:
        F.linear = self._replaced.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is not _LINEAR:
            return func(*args, **kwargs)
        return self._linear(func, args, kwargs)

    def _linear_by_name(self, *args: Any, **kwargs: Any) -> Any:
        replaced = self._replaced[-1]
        if not isinstance(_arguments(args, kwargs)[0], FakeTensor):
            return replaced(*args, **kwargs)
        return self._linear(replaced, args, kwargs)

    def _linear(self, func: Any, args: tuple, kwargs: dict) -> Any:
        input, weight, bias = _arguments(args, kwargs)
        if not _adds_in_place(input, weight, bias):
            return func(*args, **kwargs)
        if torch.is_autocast_enabled(self.autocast_device) and input.is_floating_point():
            # autocast casts a linear layer's input, weight and bias to its dtype before the call
            dtype = torch.get_autocast_dtype(self.autocast_device)
            input, weight, bias = (t.to(dtype) for t in (input, weight, bias))
        with torch.autocast(self.autocast_device, enabled=False):
            output = torch.matmul(input, weight.t())
            output.add_(bias)
        return output


def _arguments(args: tuple, kwargs: dict) -> tuple:
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    return bound.get("input"), bound.get("weight"), bound.get("bias")


def _adds_in_place(input: Any, weight: Any, bias: Any) -> bool:
    """Whether ATen's ``linear`` takes its ``matmul`` and ``add_`` branch for these arguments."""
    tensors = (input, weight, bias)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if input.dim() < 3 or input.is_contiguous() or weight.dim() != 2 or bias.dim() != 1:
        return False
    if any(t.layout != torch.strided for t in tensors):
        return False
    # TORCH_LINEAR_FLATTEN_3D makes a 3-D input contiguous and flattens it (one addmm)
    return not (input.dim() == 3 and os.environ.get("TORCH_LINEAR_FLATTEN_3D", "") not in ("", "0"))

