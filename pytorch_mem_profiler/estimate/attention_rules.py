"""Math attention with a mask, for fake CUDA tensors: the mask added in place, as the GPU adds it.

Where CUDA's ``scaled_dot_product_attention`` picks no fused kernel (grouped-query
attention in float32, a mask whose last dimension is strided, mixed dtypes) it runs
ATen's composite ``_scaled_dot_product_attention_math``: the scores ``q @ k.T``, the
mask added into them, ``_safe_softmax``, the product with ``v``. The composite adds
the mask with ``attn.add_(mask)`` in place, unless a tensor is "tensor-subclass-like"
(``areAnyTensorSubclassLike``), where it takes ``attn.add(mask)`` out of place. Fake
tensors are subclasses, so the fake step makes a third score-sized matrix the device
never makes, and frees the scores before the softmax's output is made. The peak can
come out the same, but the blocks lie otherwise: Qwen2 (fp32, grouped-query attention,
a float causal mask) at batch 17 on an H200, whose scores are 250 MB a layer, replayed
1.1 GB short of a fresh process's reserved.

:class:`MathAttentionRules` (a ``TorchFunctionMode`` for the length of an estimate's
step on fake CUDA tensors) runs such a call as the device runs it
(:func:`~.emulation.math_attention`, the emulation's replica of ATen's CUDA math path,
the mask added in place), where ATen's own choice of kernel for these arguments
(``torch._fused_sdp_choice``, asked of the fake tensors as the composite asks it) and the
emulation's rules for it (:func:`~.emulation.cuda_backend`) both say math. Every other
call (a fused kernel, no mask, real tensors, a question either cannot answer) runs as it
came. Without a GPU the emulation's own attention takes the same replica.

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), MathAttentionRules():   # fake CPU tensors: not this rule's, run as they came
    ...     q = torch.empty(1, 4, 8, 16)
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8))
    >>> tuple(out.shape)
    (1, 4, 8, 16)
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..torch_versions import SDPA_ENABLE_GQA
from .emulation import cuda_backend, cuda_boolean_mask, math_attention

__all__ = ["MathAttentionRules"]

#: torch's attention, whatever name stands for it during a step
_ATTENTION = torch._C._nn.scaled_dot_product_attention

_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class MathAttentionRules(TorchFunctionMode):
    """Runs CUDA's math attention with a mask on fake CUDA tensors as the device does (see the module)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is not _ATTENTION:
            return func(*args, **kwargs)
        bound = {**_DEFAULTS, **dict(zip(_NAMES, args)), **kwargs}
        query, key, value, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
        if (mask is None and not bound["is_causal"]) or not _fake_cuda(query, key, value) or query.is_nested:
            return func(*args, **kwargs)
        gqa = bool(bound["enable_gqa"]) and SDPA_ENABLE_GQA
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        if dtype is not None and any(t is not None and t.is_floating_point() and t.dtype != dtype for t in (query, key, value, mask)):
            return func(*args, **kwargs)  # autocast would cast first: its copies are its own to make
        if not _runs_math(query, key, value, mask, bound["dropout_p"], bool(bound["is_causal"]), bound["scale"], gqa):
            return func(*args, **kwargs)
        with torch.autocast("cuda", enabled=False):
            if mask is not None and mask.dtype == torch.bool:
                mask = cuda_boolean_mask(mask, query.dtype)
            return math_attention(query, key, value, mask, bound["dropout_p"], bool(bound["is_causal"]), bound["scale"], gqa)


def _fake_cuda(*tensors: Any) -> bool:
    return all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in tensors)


def _runs_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float | None, gqa: bool) -> bool:
    """Whether CUDA runs ATen's math attention for these arguments: ATen's own answer and the
    emulation's rules both say so (where they differ, or ATen cannot be asked, the call runs as it came)."""
    if cuda_backend(query, key, value, mask, gqa) != "math":
        return False
    try:
        from torch.nn.attention import SDPBackend

        extra = {"enable_gqa": True} if gqa else {}
        choice = torch._fused_sdp_choice(query, key, value, mask, dropout_p, is_causal, scale=scale, **extra)
        return int(choice) == int(SDPBackend.MATH.value)
    except Exception:  # noqa: BLE001 - no answer: the fake step's own path
        return False
