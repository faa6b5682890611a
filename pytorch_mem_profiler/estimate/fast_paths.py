"""``torch.nn``'s fused fast paths in the fake step, taken where the real step takes them, with what
their CUDA kernels allocate inside.

An ``nn.TransformerEncoderLayer`` or ``nn.MultiheadAttention`` in eval mode without gradients (a
frozen teacher, an encoder run for features, a distillation target) runs one fused operator on the
device: ``aten._transformer_encoder_layer_fwd`` or ``aten._native_multi_head_attention``. Whether it
does is decided in Python, and one condition is that no ``__torch_function__`` handler is active
(``torch.overrides.has_torch_function``). The estimate's step runs under function modes of its own
(its rules for linear layers, attention, recurrent layers, losses): seen by those checks, they sent
the fake step down the modules' slow path, whose requests differ from the fused kernel's (an
out-of-place ReLU and two contiguous copies per layer more: 704 + 528 + 176 MB per layer of a
768-wide encoder at batch 112, where the fused kernel makes one ReLU inside its matmul). The peak
came out right; the blocks, and so the reserved memory and the largest batch, did not (the
held-back ``frozen_fastpath``: the predicted 112 ran out of memory on an H200).

- :func:`fast_paths_kept` (a context for the length of the step) answers those checks as they would
  be answered without the estimate's own function modes: a mode of the user's, or a tensor subclass,
  still sends the module down its slow path, as it does on the device.
- :class:`FusedFastPaths` (a ``TorchFunctionMode`` for the length of a CUDA estimate's step) runs
  the two fused operators as ATen's CUDA code runs them (``transformer.cpp``'s ``transformer_encoder_layer_forward``; ``attention.cu``'s
  ``native_multi_head_attention_cuda``), operator by operator, so that every block the kernel asks
  for is asked: the packed projection, the attention kernel's output, the output projection, each
  layer norm, the feed-forward's inner activation (ReLU or GELU fused into its matmul). It stands in
  where the module calls the operator, above the dispatch modes, so that the step's counter sees
  each of those operators (a rule inside the fake mode would show it the outputs alone). torch
  2.4-2.12 give these operators no fake kernel (the step was refused, naming them); 2.13's gives
  the outputs alone. A CPU estimate keeps torch's fake kernel where there is one (the CPU's kernels
  choose their attention otherwise); nested inputs too.

Example::

    >>> import torch
    >>> from torch.overrides import TorchFunctionMode
    >>> class OwnMode(TorchFunctionMode):
    ...     def __torch_function__(self, func, types, args=(), kwargs=None):
    ...         return func(*args, **(kwargs or {}))
    >>> x = torch.ones(2)
    >>> with OwnMode(), fast_paths_kept((OwnMode,)):
    ...     torch.overrides.has_torch_function((x,))   # asked from elsewhere: the mode is seen
    True
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily

from .emulation import cuda_backend
from .operator_args import bound_arguments

__all__ = ["FAST_PATH_CHECKERS", "FusedFastPaths", "fast_paths_kept"]

aten = torch.ops.aten

#: The modules whose forward asks ``torch.overrides.has_torch_function`` to choose a fused fast path
#: (``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer``; ``nn.MultiheadAttention``).
FAST_PATH_CHECKERS = frozenset({"torch.nn.modules.transformer", "torch.nn.modules.activation"})


def _without_own_modes(real: Callable[[Any], bool], args: Any, own: tuple[type, ...]) -> bool:
    """``real(args)`` with the estimate's own function modes popped off the top of the stack; any
    other mode under them answers True, as it would on the device."""
    stack = _get_current_function_mode_stack()
    ours = 0
    for mode in reversed(stack):
        if not isinstance(mode, own):
            break
        ours += 1
    if ours < len(stack):
        return True  # a mode of the user's (or a library's): the device's step sees it too
    with contextlib.ExitStack() as popped:
        for _ in range(ours):
            popped.enter_context(_pop_mode_temporarily())
        return bool(real(args))


@contextlib.contextmanager
def fast_paths_kept(own: tuple[type, ...]) -> Iterator[None]:
    """For the block, ``torch.overrides.has_torch_function`` asked from :data:`FAST_PATH_CHECKERS`
    does not see the function modes of the types in ``own`` (the estimate's rules); asked from
    anywhere else it answers as torch does."""
    real = torch.overrides.has_torch_function

    def has_torch_function(args: Any) -> bool:
        if sys._getframe(1).f_globals.get("__name__") in FAST_PATH_CHECKERS:
            return _without_own_modes(real, args, own)
        return real(args)

    torch.overrides.has_torch_function = has_torch_function  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.overrides.has_torch_function = real  # type: ignore[assignment]


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    # ``at::layer_norm``: ``native_layer_norm``'s mean and rstd are made and dropped
    return aten.layer_norm.default(x, [x.size(-1)], weight, bias, eps, True)


def _ffn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, gelu: bool) -> torch.Tensor:
    # ``ffn``'s two ``linear_for_ffn``: the activation fused into the first matmul (no tensor of its own)
    rows = x.size(0) * x.size(1)
    inner = aten._addmm_activation.default(b1, x.view(rows, x.size(2)), w1.t(), beta=1, alpha=1, use_gelu=gelu)
    inner = inner.view(x.size(0), x.size(1), -1)
    out = aten.addmm.default(b2, inner.view(rows, inner.size(2)), w2.t())
    return out.view(x.size(0), x.size(1), -1)


def _native_multi_head_attention(args: tuple, kwargs: dict) -> Any:
    """``native_multi_head_attention_cuda``, dense self-attention: with no mask and no weights asked
    for, and a flash or efficient kernel for its heads, one packed projection, the attention kernel,
    the output projection; otherwise the projection without its bias, ``_transform_bias_rescale_qkv``'s
    three heads-first tensors, the scores, their softmax (a new matrix under a mask, in place without),
    the context written over the queries, and ``transform0213_gemm_nt_bias``'s copy and projection."""
    given = bound_arguments(aten._native_multi_head_attention.default, args, kwargs)
    query, key, value = given["query"], given["key"], given["value"]
    if any(t.is_nested for t in (query, key, value)) or not (query is key and key is value):
        return NotImplemented  # torch's fake kernel, or the operator named where there is none
    embed, heads = int(given["embed_dim"]), int(given["num_head"])
    head = embed // heads
    batch = query.size(0)
    mask, need_weights = given["mask"], bool(given["need_weights"])
    if head % 8 == 0 and not need_weights and mask is None:
        q = query.view(batch, -1, heads, head).transpose(1, 2)
        if cuda_backend(q, q, q) in ("flash", "efficient"):
            packed = aten.linear.default(query, given["qkv_weight"], given["qkv_bias"])
            chunks = [c.view(batch, -1, heads, head).transpose(1, 2) for c in packed.chunk(3, -1)]
            # the attention kernel CUDA picks, as the step's own attention calls get it
            attended = F.scaled_dot_product_attention(*chunks)
            context = attended.transpose(1, 2).reshape(batch, -1, embed)
            # the projection is made while the packed projection and the attention's output are
            # alive (ATen's locals, given back when it returns)
            return aten.linear.default(context, given["proj_weight"], given["proj_bias"]), None
    length = query.size(1)
    rows = batch * length
    packed = aten.mm.default(query.reshape(rows, embed), given["qkv_weight"].t()).view(batch, length, 3 * embed)
    q_k_v = query.new_empty((3, batch, heads, length, head))
    del packed
    q, k, v = (q_k_v[i] for i in range(3))
    scores = aten.bmm.default(q.reshape(batch * heads, length, head), k.reshape(batch * heads, length, head).transpose(1, 2))
    scores = scores.view(batch, heads, length, length)
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask.to(torch.bool)
        scores = scores.new_empty(scores.shape)  # ``_masked_softmax``: a new matrix
    weights = scores if need_weights else None
    del scores, mask
    # the context is written over the queries' storage (``bmm_nn``): nothing new
    context = q_k_v.new_empty((batch, length, embed))  # ``transform_0213``'s contiguous copy
    out = aten.linear.default(context, given["proj_weight"], given["proj_bias"])
    del context, q_k_v, q, k, v
    if weights is not None and bool(given["average_attn_weights"]):
        weights = weights.sum(1)
        weights.div_(heads)
    return out, weights


def _transformer_encoder_layer_fwd(args: tuple, kwargs: dict) -> Any:
    """``transformer_encoder_layer_forward`` for a dense input: attention (the operator above), the
    residual added in place, the norms, the feed-forward, the residual added in place."""
    given = bound_arguments(aten._transformer_encoder_layer_fwd.default, args, kwargs)
    src = given["src"]
    if src.is_nested:
        return NotImplemented
    if src.numel() == 0:
        return src.clone()
    eps, norm_first = float(given["eps"]), bool(given["norm_first"])
    x = src
    if norm_first:
        x = _layer_norm(x, given["norm_weight_1"], given["norm_bias_1"], eps)
    attention = (x, x, x, given["embed_dim"], given["num_heads"], given["qkv_weight"], given["qkv_bias"],
                 given["proj_weight"], given["proj_bias"], given["mask"], False, True, given["mask_type"])  # fmt: skip
    out = _native_multi_head_attention(attention, {})
    x = (aten._native_multi_head_attention.default(*attention) if out is NotImplemented else out)[0]
    del attention, out
    x.add_(src)
    if not norm_first:
        x = _layer_norm(x, given["norm_weight_1"], given["norm_bias_1"], eps)
    before_ffn = x
    if norm_first:
        x = _layer_norm(x, given["norm_weight_2"], given["norm_bias_2"], eps)
    x = _ffn(x, given["ffn_weight_1"], given["ffn_bias_1"], given["ffn_weight_2"], given["ffn_bias_2"], bool(given["use_gelu"]))
    x.add_(before_ffn)
    if not norm_first:  # made while the residual is alive (ATen's ``pre_ffn_res``, given back at the return)
        x = _layer_norm(x, given["norm_weight_2"], given["norm_bias_2"], eps)
    return x


class FusedFastPaths(TorchFunctionMode):
    """Runs ``torch._transformer_encoder_layer_fwd`` and ``torch._native_multi_head_attention`` as
    ATen's CUDA code runs them (see the module); a nested input, or attention that is not
    self-attention, is left to torch's fake kernel (or named as unsupported where it has none)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            out = rule(args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


#: The rules by the ``torch`` function the modules call.
_RULES: dict[Any, Callable[[tuple, dict], Any]] = {}
if hasattr(torch, "_native_multi_head_attention"):
    _RULES[torch._native_multi_head_attention] = _native_multi_head_attention
if hasattr(torch, "_transformer_encoder_layer_fwd"):
    _RULES[torch._transformer_encoder_layer_fwd] = _transformer_encoder_layer_fwd
