"""The emulated CUDA step picks CUDA's attention kernel by ATen's rules and builds masks and losses as CUDA does.

Every figure below is checked against what autograd saved (a ``saved_tensors_hooks``
pack hook: the node that made each saved tensor, its dtype, its storage's bytes) or
the operators the step ran, on fake CPU tensors under :func:`cuda_rules`. The rules
were read off the op-by-op diff of ``benchmarks/estimate_paths.py`` on an NVIDIA
H100 (torch 2.11.0+cu130, transformers 5.17, 2026-11-25): there, fake CUDA ran what
these tests assert, where the emulation ran something else.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler.estimate.emulation import cuda_backend, cuda_rules
from pytorch_mem_profiler.estimate import emulation
from pytorch_mem_profiler.torch_versions import (
    CUDNN_ATTENTION_TAKES_MASK,
    SDPA_ENABLE_GQA,
    attention_softmax,
    math_attention_upcasts,
)

B, H, L, D = 2, 4, 32, 16

#: The autograd node of the math path's softmax on this torch: ``SafeSoftmaxBackward0`` from 2.5 on.
SOFTMAX_NODE = type(attention_softmax(torch.zeros(2, requires_grad=True)).grad_fn).__name__

needs_enable_gqa = pytest.mark.skipif(
    not SDPA_ENABLE_GQA, reason=f"scaled_dot_product_attention(enable_gqa=) needs torch >= 2.5, not {torch.__version__}"
)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        items = out if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket), tuple(str(t.dtype) for t in tensors), sum(t.nbytes for t in tensors)))
        return out


def _pack_into(seen: Counter[tuple[str, str]]):  # type: ignore[no-untyped-def]
    """A (pack, unpack) pair that adds each saved tensor's storage bytes to ``seen[(node that made it, dtype)]``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._is_view() and t._base is not None else t
        node = type(base.grad_fn).__name__ if base.grad_fn is not None else "leaf"
        seen[(node, str(t.dtype).replace("torch.", ""))] += t.untyped_storage().nbytes()
        return t

    return pack, lambda t: t


def _saved(run):  # type: ignore[no-untyped-def]
    """(node that made it, dtype) -> storage bytes of every tensor autograd saved while ``run`` ran."""
    seen: Counter[tuple[str, str]] = Counter()
    ops = _Ops()
    with FakeTensorMode(), cuda_rules(), torch.autograd.graph.saved_tensors_hooks(*_pack_into(seen)), ops:
        out = run()
    return seen, ops.ops, out


@needs_enable_gqa
def test_grouped_query_attention_in_float32_runs_the_math_path_with_the_whole_matrix():
    # llama-gqa-fp32 on the H100: enable_gqa=True and is_causal without a mask; flash and cuDNN want half
    # precision and torch 2.11's efficient kernel no grouped heads, so CUDA ran the math path: _safe_softmax
    # and bmm, the float32 matrix saved twice per call (by the softmax and by the second matmul: 16 saves of
    # 100,663,296 B over 8 calls) and key and value repeated to every head (CloneBackward0). The emulation ran
    # the CPU's fused kernel and came out 502 MB (16%) low.
    def run():  # type: ignore[no-untyped-def]
        # as Llama lays them out: (batch, sequence, heads, head size) seen through a transpose
        q, k, v = (torch.empty(B, L, h, D, requires_grad=True).transpose(1, 2) for h in (H, 1, 1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    saved, ops, out = _saved(run)
    # per call on the H100: the (8, 12, 512, 512) float32 matrix twice, and three head-wide (8, 12, 512, 64)
    # float32 operands of the two matmuls (the scaled query, key and value repeated to all 12 heads)
    assert saved[("SafeSoftmaxBackward0", "float32")] == 2 * B * H * L * L * 4, saved
    head_wide = sum(n for (node, _), n in saved.items() if node != "SafeSoftmaxBackward0")
    assert head_wide == 3 * B * H * L * D * 4, saved
    names = [name for name, _, _ in ops]
    assert "aten._safe_softmax" in names and not any("flash" in n or "efficient" in n for n in names)
    # the causal mask built as CUDA's math path builds it: ones, tril, and one where into float32
    assert ("aten.where", ("torch.float32",), L * L * 4) in ops
    assert out.shape == (B, H, L, D)


def test_a_strided_mask_that_needs_gradients_runs_the_math_path_with_cudas_fused_dropout():
    # t5-fp32 and t5-bf16 on the H100: T5's self-attention passed its position bias (permuted, so its last
    # dimension is strided, and learned, so it needs gradients) as the mask; the fused kernels want a
    # contiguous last dimension, so CUDA ran the math path (16 calls of 24), in float32 under bf16, and its
    # dropout through the fused kernel: per call the softmax's float32 result, a bool mask and the float32
    # dropped matrix saved. The emulation ran the efficient kernel: 1.27 GB (fp32) and 1.50 GB (bf16) low.
    for autocast in (None, torch.bfloat16):

        def run():  # type: ignore[no-untyped-def]
            q = torch.empty(B, H, L, D, requires_grad=True)
            bias = torch.empty(L, L, H, requires_grad=True).permute(2, 0, 1).unsqueeze(0)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias, dropout_p=0.1)

        saved, ops, out = _saved(run)
        matrix = B * H * L * L
        # torch 2.4's math path computes bf16 in bf16, with softmax (no float32 copies, no _safe_softmax)
        wide = autocast is None or math_attention_upcasts()
        dtype, size = ("float32", 4) if wide else ("bfloat16", 2)
        assert saved[(SOFTMAX_NODE, dtype)] == matrix * size, (autocast, saved)
        assert saved[("NativeDropoutBackward0", dtype)] == matrix * size, (autocast, saved)
        assert saved[("leaf", "bool")] == matrix, (autocast, saved)  # the fused kernel's mask
        assert not any("bernoulli" in name for name, _, _ in ops)
        assert out.dtype == (autocast or torch.float32)


def test_a_bool_mask_becomes_an_additive_mask_with_one_where():
    # bert-fp32 and bert-bf16 on the H100: CUDA turned the bool padding mask into the query's dtype with one
    # where (8 x 4 MB in bf16); the emulation ran zeros, bitwise_not and masked_fill (34-35 MB more).
    for dtype in (torch.float32, torch.bfloat16):

        def run():  # type: ignore[no-untyped-def]
            q = torch.empty(B, H, L, D, dtype=dtype, requires_grad=True)
            mask = torch.ones(B, 1, L, L, dtype=torch.bool)
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)

        saved, ops, out = _saved(run)
        names = [name for name, _, _ in ops]
        assert not {"aten.zeros", "aten.masked_fill", "aten.bitwise_not"} & set(names), names
        wheres = [(d, n) for name, d, n in ops if name == "aten.where"]
        assert wheres == [((str(dtype),), B * L * L * torch.finfo(dtype).bits // 8)], wheres
        # in half precision with a mask, Hopper runs cuDNN's attention where it takes a mask
        cudnn = dtype == torch.bfloat16 and CUDNN_ATTENTION_TAKES_MASK
        node = "ScaledDotProductCudnnAttentionBackward0" if cudnn else "ScaledDotProductEfficientAttentionBackward0"
        assert type(out.grad_fn).__name__ == node


def test_cudas_backend_rules():
    f32 = torch.empty(B, H, L, D)
    bf16 = f32.bfloat16()
    kv = torch.empty(B, 1, L, D)
    assert cuda_backend(f32, f32, f32) == "efficient"
    assert cuda_backend(bf16, bf16, bf16) == "flash"
    mask = torch.zeros(1, 1, L, L, dtype=torch.bfloat16)
    assert cuda_backend(bf16, bf16, bf16, mask) == ("cudnn" if CUDNN_ATTENTION_TAKES_MASK else "efficient")
    # a learned bias (T5's): cuDNN gives the mask no gradient, so the efficient kernel runs
    assert cuda_backend(bf16, bf16, bf16, mask.clone().requires_grad_()) == "efficient"
    wide = torch.empty(B, H, L, 160, dtype=torch.bfloat16)  # past cuDNN's 128
    assert cuda_backend(wide, wide, wide, mask) == "efficient"
    assert cuda_backend(bf16, kv.bfloat16(), kv.bfloat16(), enable_gqa=True) == "flash"
    assert cuda_backend(f32, kv, kv, enable_gqa=True) == "math"
    assert cuda_backend(f32, f32, f32, torch.zeros(L, L, H).permute(2, 0, 1)) == "math"  # strided mask
    assert cuda_backend(torch.empty(B, H, L, 6), torch.empty(B, H, L, 6), torch.empty(B, H, L, 6)) == "math"
    assert cuda_backend(f32[0], f32[0], f32[0]) == "math"  # 3-d inputs
    assert cuda_backend(bf16, bf16, bf16[..., :8]) == "efficient"  # unequal head sizes: no flash


def test_cross_entropy_under_autocast_runs_cudas_log_softmax_in_half_precision():
    # t5-bf16 on the H100: cross_entropy ran _log_softmax in bf16 (saved: 262,144,000 B per step) and copied
    # the result to float32 for nll_loss; the emulation (CPU autocast lists cross_entropy_loss in float32)
    # copied the logits to float32 first and saved a float32 log-softmax.
    N, V = 64, 1000

    def run():  # type: ignore[no-untyped-def]
        logits = torch.empty(N, V, dtype=torch.bfloat16, requires_grad=True)
        target = torch.zeros(N, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.CrossEntropyLoss()(logits, target)

    saved, ops, loss = _saved(run)
    assert saved[("LogSoftmaxBackward0", "bfloat16")] == N * V * 2, saved
    assert saved[("ToCopyBackward0", "float32")] == N * V * 4, saved
    assert ("aten._log_softmax", ("torch.bfloat16",), N * V * 2) in ops
    assert loss.dtype == torch.float32


def test_real_tensors_keep_torchs_own_path():
    torch.manual_seed(0)
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    expected = nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    with cuda_rules():
        got = nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    assert torch.equal(got, expected)


@needs_enable_gqa
def test_real_tensors_keep_torchs_own_grouped_query_attention():
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D)
    kv = torch.randn(B, 1, L, D)
    expected = nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    with cuda_rules():
        got = nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    assert torch.equal(got, expected)


@pytest.mark.skipif(SDPA_ENABLE_GQA, reason="this torch has scaled_dot_product_attention(enable_gqa=)")
def test_grouped_query_attention_on_a_torch_without_it_is_refused_by_name():
    # as torch 2.4 refuses the argument itself: the emulation does not make up a kernel it lacks
    q, kv = torch.empty(B, H, L, D), torch.empty(B, 1, L, D)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enable_gqa'"):
        nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    for fake in (False, True):
        with FakeTensorMode() if fake else contextlib.nullcontext(), cuda_rules():
            q, kv = torch.empty(B, H, L, D), torch.empty(B, 1, L, D)
            with pytest.raises(TypeError, match=r"enable_gqa=True\) needs torch 2\.5 or later \(this is torch 2\.4"):
                nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        # and without the argument, the emulation runs as before
        with FakeTensorMode() if fake else contextlib.nullcontext(), cuda_rules():
            q = torch.empty(B, H, L, D)
            assert nn.functional.scaled_dot_product_attention(q, q, q).shape == (B, H, L, D)


def test_the_math_path_saves_what_atens_math_attention_saves_on_this_torch():
    # Without dropout (whose mask the composite draws by the CPU's route) the emulated math path is
    # ATen's composite step by step: the same tensors saved, by the same nodes, in the same dtypes, on
    # every supported torch (float32 copies and _safe_softmax from 2.5 on, neither in 2.4).
    for dtype in (torch.float32, torch.bfloat16):

        def emulated():  # type: ignore[no-untyped-def]
            q = torch.empty(B, H, L, D, dtype=dtype, requires_grad=True)
            bias = torch.empty(L, L, H, dtype=dtype, requires_grad=True).permute(2, 0, 1).unsqueeze(0)
            assert cuda_backend(q, q, q, bias) == "math"  # the strided mask
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias)

        def composite():  # type: ignore[no-untyped-def]
            q = torch.empty(B, H, L, D, dtype=dtype, requires_grad=True)
            bias = torch.empty(L, L, H, dtype=dtype, requires_grad=True).permute(2, 0, 1).unsqueeze(0)
            return torch.ops.aten._scaled_dot_product_attention_math(q, q, q, bias, 0.0, False)[0]

        saved, _, out = _saved(emulated)
        with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(*_pack_into(expected := Counter())):
            reference = composite()
        assert saved == expected, (dtype, saved, expected)
        assert sum(saved.values()) >= 2 * B * H * L * L * torch.finfo(dtype).bits // 8
        assert out.dtype == reference.dtype == dtype


def _encoder_layer_step(cudnn_takes_mask: bool, monkeypatch) -> tuple[Counter[tuple[str, str]], list]:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(emulation, "CUDNN_ATTENTION_TAKES_MASK", cudnn_takes_mask)
    S, N, E = 16, 2, 64  # nn.MultiheadAttention lays heads out (sequence, batch x heads, head size)

    def run():  # type: ignore[no-untyped-def]
        layer = nn.TransformerEncoderLayer(E, 4, 128, dropout=0.0)
        padding = torch.zeros(N, S, dtype=torch.bool)
        padding[:, -3:] = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(torch.empty(S, N, E), src_key_padding_mask=padding)
        out.float().sum().backward()
        return out

    saved, ops, _ = _saved(run)
    return saved, ops


@pytest.mark.skipif(not CUDNN_ATTENTION_TAKES_MASK, reason=f"torch {torch.__version__}'s cuDNN attention takes no mask")
def test_masked_half_precision_attention_keeps_the_querys_layout_as_cudnn_does(monkeypatch):
    # nn.TransformerEncoder in bf16 with a padding mask on the H100 (torch 2.11): cuDNN's attention laid its
    # output out as the query (sequence, batch, heads, head size), so MultiheadAttention's
    # permute(2, 0, 1, 3).contiguous() copied nothing; the emulation's efficient kernel laid it out (batch,
    # sequence, heads, head size) and copied it in every layer (+3.16% of the step's peak at 12 layers).
    saved, ops = _encoder_layer_step(True, monkeypatch)
    assert ("ScaledDotProductCudnnAttentionBackward0", "bfloat16") in saved
    attention_output = 16 * 2 * 64 * 2  # S x N x E in bf16
    copies = [n for name, dtypes, n in ops if name == "aten.clone" and dtypes == ("torch.bfloat16",) and n == attention_output]
    assert copies == [], copies
    # where cuDNN takes no mask (torch 2.4), the efficient kernel runs: its output, and in backward what
    # its layout asks for, are copied
    saved, ops = _encoder_layer_step(False, monkeypatch)
    assert ("ScaledDotProductEfficientAttentionBackward0", "bfloat16") in saved
    copies = [n for name, dtypes, n in ops if name == "aten.clone" and dtypes == ("torch.bfloat16",) and n == attention_output]
    assert copies and set(copies) == {attention_output}, copies


@needs_enable_gqa
def test_the_math_path_adds_its_mask_in_place_as_the_device_does():
    # Qwen2 (float32, grouped-query attention, a float mask) on an H200: the allocator's history shows the
    # scores and the softmax's output as the only matrices each call makes; ATen's composite adds the mask
    # in place there, and out of place (a third matrix) only for tensor subclasses such as fake tensors
    def run():  # type: ignore[no-untyped-def]
        q, k, v = (torch.empty(B, h, L, D, requires_grad=True) for h in (H, 1, 1))
        mask = torch.empty(L, L)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    _, ops, out = _saved(run)
    matrix = B * H * L * L * 4
    views = {"aten.view", "aten._unsafe_view", "aten.expand", "aten.reshape", "aten.transpose", "aten.detach", "aten.alias"}
    made = [name for name, _, nbytes in ops if nbytes == matrix and not name.endswith("_") and name not in views]
    assert made == ["aten.bmm", "aten._safe_softmax"], [op for op in ops if op[2] == matrix]
    assert ("aten.add_", ("torch.float32",), matrix) in ops
    assert out.shape == (B, H, L, D)
