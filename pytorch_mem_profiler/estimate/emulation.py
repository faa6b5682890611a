"""CUDA's choices, made for fake CPU tensors that stand in for CUDA ones on a machine without a GPU.

Autograd cannot run on fake CUDA tensors where CUDA's runtime is missing, so an
estimate for CUDA runs on fake CPU tensors there. Sizes are the same; what
differs is where an operator picks its algorithm or its precision by device,
and two such places hold most of a transformer's memory:

- attention: ``scaled_dot_product_attention`` on the CPU falls back to the math
  path (which keeps the whole attention matrix for backward) where CUDA runs
  flash attention (half precision, no mask) or memory-efficient attention
  (otherwise); here it runs CUDA's choice, as the composite CUDA code calls it;
- dropout: CUDA runs one fused kernel (``native_dropout``) that saves a ``bool``
  mask, where the CPU draws a mask in the input's dtype (``bernoulli_``, ``div_``,
  ``mul``) and saves it: four times the bytes in float32 (the GPU diff of
  ``benchmarks/estimate_paths.py`` showed it in every transformer measured);
- autocast: CUDA runs ``layer_norm``, ``group_norm`` in float32 and gives
  ``softmax``/``log_softmax`` a float32 result, where the CPU's autocast keeps
  half precision.

:func:`cuda_rules` puts these in place for the length of a step (module
attributes of ``torch.nn.functional``, for fake tensors only; real tensors take
the original path), and takes them away after.

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), cuda_rules():
    ...     q = torch.empty(2, 4, 256, 64, requires_grad=True)
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    >>> type(out.grad_fn).__name__
    'ScaledDotProductEfficientAttentionBackward0'
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["cuda_rules"]

#: Head sizes flash attention takes on CUDA (sm80 and newer).
FLASH_MAX_HEAD_DIM = 256

_HALF = (torch.float16, torch.bfloat16)


def _fake(*values: Any) -> bool:
    return any(isinstance(v, FakeTensor) for v in values)


def _autocast_dtype() -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def _attention(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if not _fake(query, key, value) or enable_gqa or query.dim() != 4:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        dtype = _autocast_dtype()
        with torch.autocast("cpu", enabled=False):
            if dtype is not None:  # attention is on autocast's half-precision list on CUDA
                query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
            if query.dtype in _HALF and attn_mask is None and query.shape[-1] <= FLASH_MAX_HEAD_DIM:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale
                )[0]
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(~bias, float("-inf"))
            elif bias is not None:
                bias = bias.to(query.dtype)
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, grad, dropout_p, is_causal, scale=scale
            )[0]

    return attention


def _in_float32(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``layer_norm``, ``group_norm``: CUDA's autocast runs them on float32 copies."""

    @functools.wraps(original)
    def in_float32(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _autocast_dtype() is None or not _fake(*args, *kwargs.values()):
            return original(*args, **kwargs)
        cast = lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in _HALF else v  # noqa: E731
        return original(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})

    return in_float32


def _float32_result(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``softmax``, ``log_softmax``: CUDA's autocast asks them for a float32 result."""

    @functools.wraps(original)
    def float32_result(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (
            _autocast_dtype() is not None
            and isinstance(input, FakeTensor)
            and input.dtype in _HALF
            and kwargs.get("dtype") is None
            and len(args) < 3
        ):
            kwargs["dtype"] = torch.float32
        return original(input, *args, **kwargs)

    return float32_result


def _fused_dropout(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``dropout``: CUDA's fused kernel (a bool mask saved), as ATen picks it for a CUDA input."""

    @functools.wraps(original)
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        # ATen's dropout takes the fused kernel for a CUDA input with 0 < p < 1 that is not in place
        if not isinstance(input, FakeTensor) or inplace or not training or not 0 < p < 1 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    return dropout


@contextlib.contextmanager
def cuda_rules() -> Iterator[None]:
    """CUDA's attention kernels and autocast precisions for fake CPU tensors, for the block."""
    patches = {
        "scaled_dot_product_attention": _attention,
        "dropout": _fused_dropout,
        "layer_norm": _in_float32,
        "group_norm": _in_float32,
        "softmax": _float32_result,
        "log_softmax": _float32_result,
    }
    originals = {name: getattr(F, name) for name in patches}
    try:
        for name, wrap in patches.items():
            setattr(F, name, wrap(originals[name]))
        yield
    finally:
        for name, original in originals.items():
            setattr(F, name, original)
