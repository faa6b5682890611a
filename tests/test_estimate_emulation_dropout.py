"""The emulated CUDA step runs dropout as CUDA does: the fused kernel, a bool mask saved for backward."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from pytorch_mem_profiler.estimate.emulation import cuda_rules


def _saved(p: float, dtype: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    seen: list[tuple[str, torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append((str(t.dtype), t.dtype, t.untyped_storage().nbytes()))
        return t

    with FakeTensorMode(), cuda_rules(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = torch.empty(8, 512, 768, dtype=dtype, requires_grad=True)
        y = nn.functional.dropout(x, p, training=True)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
    return seen


def test_dropout_saves_a_bool_mask_as_cudas_fused_kernel_does():
    # Measured on an NVIDIA H100 (torch 2.11.0+cu130, benchmarks/estimate_paths.py, bert-fp32 and gpt2-fp32,
    # 2026-11-25): fake CUDA ran aten.native_dropout (float32/bool), and autograd saved for
    # NativeDropoutBackward0 a bool mask of one byte per element, where the emulation saved a float32
    # mask (MulBackward0: 4 bytes per element) from bernoulli_/div_.
    for dtype in (torch.float32, torch.bfloat16):
        saved = _saved(0.1, dtype)
        assert [(d, n) for d, _, n in saved] == [("torch.bool", 8 * 512 * 768)], saved


def test_dropout_outside_the_fused_kernels_reach_keeps_the_composite_path():
    with FakeTensorMode(), cuda_rules():
        x = torch.empty(4, 4, requires_grad=True)
        assert nn.functional.dropout(x, 0.5, training=False) is x
    real = torch.ones(4, 4)
    with cuda_rules():  # real tensors take the original path
        torch.manual_seed(0)
        a = nn.functional.dropout(real, 0.5)
    torch.manual_seed(0)
    assert torch.equal(a, nn.functional.dropout(real, 0.5))


def test_a_cuda_estimate_makes_dropouts_mask_before_its_output_as_the_fused_kernel_does():
    """CUDA's ``dropout_cuda`` allocates the bool mask, then the output (the H100's allocator history of
    ``nn.MultiheadAttention``); the fake kernel returns ``(output, mask)``. The CUDA estimate hands them
    to the replay in the device's order; the CPU estimate has no replay and its counter's order stays."""
    from pytorch_mem_profiler import estimate_memory

    model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.1), nn.Linear(256, 4))
    est = estimate_memory(model, torch.zeros(32, 64), device="cuda", emulate=True, fit=False)
    events = est.step_events
    made = [n for key, n in events.events if n > 0 and events.sources.get(key, "").startswith("aten.native_dropout.default;")]
    mask, output = 32 * 256, 32 * 256 * 4  # one byte an element; float32
    assert made == [mask, output] * 2, made  # two steps


def test_a_cuda_estimate_leaves_the_efficient_attention_kernels_seed_and_offset_in_host_memory():
    """CUDA's efficient attention kernel allocates its output and log-sum-exp on the device and keeps
    its dropout seed and offset in host memory (the fake kernel puts them on the device: two 512-byte
    blocks per call the H200's allocator history did not have). Float32 attention takes that kernel
    on CUDA; the estimate's requests from it are the output's and the log-sum-exp's, per step."""
    from benchmarks.workloads import CausalSelfAttention
    from pytorch_mem_profiler import estimate_memory
    from pytorch_mem_profiler.estimate.allocator import block_size

    batch, length, width, heads = 8, 40, 64, 4
    model = CausalSelfAttention(width, heads)
    est = estimate_memory(model, torch.zeros(batch, length, width), device="cuda", emulate=True, fit=False)
    events = est.step_events
    source = "aten._scaled_dot_product_efficient_attention.default;"
    made = [n for key, n in events.events if n > 0 and events.sources.get(key, "").startswith(source)]
    output = batch * length * width * 4
    logsumexp = batch * heads * 64 * 4  # positions padded to the kernel's 32
    forward = [block_size(output), block_size(logsumexp)]
    assert made == forward * 2, made  # two steps; no seed or offset
