"""Kernel scratch on CUDA: the rules against the H200's measured figures, and an estimate for CUDA
taking a bias gradient's reduction buffer at its operator (CPU estimates take none)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.scratch import KernelScratch, column_reduction_scratch, embedding_backward_scratch
from pytorch_mem_profiler.estimate.step import StepPlan, run_step

SGD = functools.partial(torch.optim.SGD, lr=0.1)
MiB = 1 << 20

#: ``x.sum(0)`` of a contiguous (rows, cols) tensor on an H200 (132 multiprocessors), torch 2.11:
#: the allocator's peak inside the operator above both ends, bytes (fp32; bf16 and fp16 identical).
MEASURED_SUMS = [
    (16, 1, 0), (16, 7, 0), (16, 64, 0), (16, 256, 0), (16, 1024, 0), (16, 3072, 0), (32, 1, 0), (32, 7, 0),
    (32, 64, 0), (32, 256, 0), (32, 1024, 0), (32, 3072, 0), (64, 1, 0), (64, 7, 0), (64, 64, 0), (64, 256, 0),
    (64, 1024, 0), (64, 3072, 0), (128, 1, 0), (128, 7, 0), (128, 64, 0), (128, 256, 0), (128, 1024, 0),
    (128, 3072, 0), (256, 1, 0), (256, 7, 0), (256, 64, 0), (256, 256, 0), (256, 1024, 0), (256, 3072, 0),
    (512, 1, 0), (512, 7, 0), (512, 64, 0), (512, 256, 0), (512, 1024, 0), (512, 3072, 0), (1024, 1, 0),
    (1024, 7, 0), (1024, 64, 0), (1024, 256, 2097664), (1024, 1024, 8389120), (1024, 3072, 25166336),
    (2048, 1, 0), (2048, 7, 0), (2048, 64, 262656), (2048, 256, 4194816), (2048, 1024, 16777728),
    (2048, 3072, 50332160), (8192, 1, 0), (8192, 7, 0), (8192, 64, 1049088), (8192, 256, 16777728),
    (8192, 1024, 67109376), (8192, 3072, 138412544), (65536, 1, 0), (65536, 7, 4096), (65536, 64, 8389120),
    (65536, 256, 134218240), (65536, 1024, 138412544), (65536, 3072, 138412544),
    # in training steps: bias gradients of FeedForwardStack(512) at 8 x 256 tokens
    (2048, 2048, 33554944), (2048, 512, 8389120),
]  # fmt: skip

#: ``embedding_dense_backward`` of an (N, D) fp32 gradient, N random indices below 138,493
#: (nearly all distinct), measured the same way.
MEASURED_EMBEDDING_BACKWARD = [
    (64, 16, 0), (512, 768, 0), (4096, 16, 489984), (4096, 128, 2507776), (4096, 768, 14040576),
    (65536, 16, 7813632), (65536, 128, 40109056), (65536, 768, 224656896),
]  # fmt: skip


@pytest.mark.parametrize("rows, cols, measured", MEASURED_SUMS)
def test_the_column_reduction_rule_gives_the_measured_scratch_to_the_byte(rows, cols, measured):
    assert sum(column_reduction_scratch(rows, cols, multiprocessors=132)) == measured


def test_the_reductions_buffer_is_capped_by_the_multiprocessors():
    assert sum(column_reduction_scratch(65536, 3072, multiprocessors=132)) == 132 * MiB + 512
    # half the multiprocessors, half the thread blocks meeting in the buffer
    assert sum(column_reduction_scratch(8192, 3072, multiprocessors=66)) == 66 * MiB + 512
    # unless each thread would then add more than 256 rows
    assert sum(column_reduction_scratch(65536, 3072, multiprocessors=66)) == 65536 // 1024 * 3072 * 512 + 512
    # the semaphores are a block of their own (the small pool), the partial sums another
    assert column_reduction_scratch(2048, 2048) == (8 * 2048 * 2048, 512)


@pytest.mark.parametrize("n, d, measured", MEASURED_EMBEDDING_BACKWARD)
def test_the_embedding_backward_rule_gives_the_measured_scratch_to_the_byte(n, d, measured):
    assert sum(embedding_backward_scratch(n, d, num_weights=138_493)) == measured


def test_the_embedding_backward_rule_counts_the_copies_of_non_contiguous_arguments():
    # NeuMF at batch 65,536: a slice of a concatenation's gradient, copied before the sort (73,663,488 measured)
    neumf = sum(embedding_backward_scratch(65536, 128, num_weights=138_493, grad_contiguous=False))
    assert neumf == 73_663_488
    # GPT-2 at 8 x 512 tokens: sliced token ids (14,073,344 measured)
    gpt2 = sum(embedding_backward_scratch(4096, 768, num_weights=50_257, indices_contiguous=False))
    assert gpt2 == 14_073_344
    # up to 3072 indices the direct kernel needs nothing but the copy
    assert embedding_backward_scratch(3072, 768) == ()
    assert embedding_backward_scratch(3072, 768, grad_contiguous=False) == (3072 * 768 * 4,)


def test_the_rules_by_operator_on_shapes():
    aten = torch.ops.aten
    rules = KernelScratch(132)
    with torch.device("meta"):
        stacked = torch.empty(8, 256, 2048, dtype=torch.bfloat16)
        flat = torch.empty(2048, 2048)
        doubles = torch.empty(2048, 2048, dtype=torch.float64)
        grad, ids = torch.empty(4096, 768), torch.zeros(4096, dtype=torch.long)
    # a 3-D tensor summed over (0, 1) is the 2-D case with 8 x 256 rows; mean runs the same kernel
    assert rules(aten.sum.dim_IntList, (stacked, [0, 1]), {}) == rules(aten.sum.dim_IntList, (flat, [0], True), {})
    assert sum(rules(aten.mean.dim, (flat, [0]), {})) == 33_554_944
    assert rules(aten.sum.dim_IntList, (flat, [-1]), {}) == ()  # along the innermost dimension: none
    # a middle dimension of 256 over 16,384 outputs, and a transposed sum along its contiguous rows:
    # few inputs per thread, no split across thread blocks (tests/test_estimate_reductions.py)
    assert rules(aten.sum.dim_IntList, (stacked, [1]), {}) == ()
    assert rules(aten.sum.dim_IntList, (flat.t(), [0]), {}) == ()
    # float64's partial sums are 8 bytes each: twice float32's buffer
    assert rules(aten.sum.dim_IntList, (doubles, [0]), {})[0] == 2 * rules(aten.sum.dim_IntList, (doubles.to(torch.float32), [0]), {})[0]
    assert sum(rules(aten.embedding_dense_backward.default, (grad, ids, 50257, -1, False), {})) == sum(
        embedding_backward_scratch(4096, 768)
    )
    assert rules(aten.mm.default, (flat, flat), {}) == ()


def _bias_linear_step():
    """Linear(64, 2048) with a bias on an (8, 256, 64) batch, SGD; the loss scales the output by a
    constant, so the gradient reaching the bias is one contiguous (8, 256, 2048) tensor."""
    model = nn.Linear(64, 2048)
    batch = torch.zeros(8, 256, 64)
    loss_fn = lambda out: (out * out.new_ones(out.shape[-1])).sum()  # noqa: E731
    return model, batch, loss_fn


def test_a_cuda_estimate_takes_the_bias_gradients_reduction_buffer_at_its_operator():
    model, batch, loss_fn = _bias_linear_step()
    estimate = estimate_memory(model, batch, optimizer=SGD, loss_fn=loss_fn, device="cuda", fit=False)
    cpu = estimate_memory(model, batch, optimizer=SGD, loss_fn=loss_fn, device="cpu", fit=False)
    # alive while the bias gradient is summed over its 2048 rows, counted by hand (CUDA blocks)
    weights = 2048 * 64 * 4 + 2048 * 4
    batch_bytes = 8 * 256 * 64 * 4
    output = 8 * 256 * 2048 * 4  # kept by the step until it ends
    loss = ones = 512  # the scalar loss and its gradient, one block each
    output_grad = 8 * 256 * 2048 * 4
    weight_grad, bias_grad = 2048 * 64 * 4, 2048 * 4
    alive = weights + batch_bytes + output + loss + ones + output_grad + weight_grad + bias_grad
    scratch = 8 * 2048 * 2048 + 512  # measured on the H200 for a (2048, 2048) column sum
    assert estimate.kernel_scratch == scratch
    assert estimate.phases["backward"] == estimate.peak == alive + scratch
    assert sum(estimate.peak_breakdown.values()) == estimate.peak
    # the CPU's estimate takes none: the same step, its scalars 4 bytes instead of a block
    assert cpu.kernel_scratch == 0
    assert cpu.phases["backward"] == alive - 2 * (512 - 4)


def test_the_allocator_replay_takes_and_gives_back_the_scratch_around_its_operator():
    model, batch, loss_fn = _bias_linear_step()
    plan = StepPlan(model=model, example_inputs=batch, optimizer=SGD, device=torch.device("cuda"), loss_fn=loss_fn,
                    run_device=torch.device("cpu"))  # fmt: skip
    events = list(run_step(plan, 8).events)
    partials = [i for i, (_, n) in enumerate(events) if n == 8 * 2048 * 2048]
    assert len(partials) == 2  # one in each of the two steps
    for i in partials:
        key = events[i][0]
        # taken with its semaphores and given back before anything else happens
        assert events[i + 1][1] == 512 and events[i + 2] == (key, -8 * 2048 * 2048) and events[i + 3][1] == -512
    cpu_plan = StepPlan(model=model, example_inputs=batch, optimizer=SGD, device=torch.device("cpu"), loss_fn=loss_fn)
    assert not run_step(cpu_plan, 8).events  # no replay off CUDA


def _aligned(n: int) -> int:
    return -(-n // 512) * 512


class _TwoEmbeddings(nn.Module):
    """A table whose output is used whole (a contiguous gradient) and one concatenated (a slice of the
    concatenation's gradient: not contiguous), as NeuMF's embeddings are."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.whole = nn.Embedding(rows, dim)
        self.sliced = nn.Embedding(rows, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mixed = torch.cat([self.sliced(ids), self.whole(ids) * 2.0], dim=1)
        return mixed.sum(1)


def test_a_cuda_estimate_takes_the_embedding_backwards_buffers_in_atens_order_around_its_gradient():
    n, rows, dim = 5000, 700, 16  # above the direct kernel's 3072 indices; fewer rows than indices
    model = _TwoEmbeddings(rows, dim)
    ids = torch.zeros(n, dtype=torch.long)
    plan = StepPlan(model=model, example_inputs=ids, optimizer=SGD, device=torch.device("cuda"),
                    loss_fn=lambda out: out.sum(), run_device=torch.device("cpu"))  # fmt: skip
    step = run_step(plan, n)
    events = list(step.step_events.events)
    sources = step.step_events.sources
    # ATen's embedding_dense_backward_cuda and embedding_backward_cuda_kernel (torch 2.11), by hand:
    # M = min(N, rows) segments at most, P = N // 10 + M partial sums of 10 rows at most
    m, p = min(n, rows), n // 10 + min(n, rows)
    idx = _aligned(8 * n)
    # CUB's radix sort of N (int64, int64) pairs: 8 passes' histograms, a 1 KiB look-back per 4608-item
    # tile, the alternate keys and values, the counters (each part aligned to 256) and 255 bytes of slack
    sort = _aligned(16_384 + 1024 * -(-n // 4608) + 2 * (-(-8 * n // 256) * 256) + 256 + 255)
    expected_sizes = [
        idx, idx, idx, sort, -sort, -idx,  # sorted indices, positions, arange; the sort's storage
        _aligned(rows * dim * 4),  # the operator's output: the weight's gradient
        idx, 512, idx, 1536, -1536, -idx,  # segment offsets, their count, CUB's unique-by-key
        _aligned(8 * m), _aligned(8 * m), 1536, -1536,  # partial counts, their offsets, CUB's scan
        512, _aligned(8 * p), _aligned(4 * p * dim),  # partial count, offsets, float partial sums
        -_aligned(4 * p * dim), -_aligned(8 * p), -512, -_aligned(8 * m), -_aligned(8 * m), -512, -idx,
        -idx, -idx,  # positions, sorted indices
    ]
    made_by = [i for i, (key, size) in enumerate(events) if size > 0 and "embedding_dense_backward" in sources.get(key, "")]
    # two tables in each of two steps; the sliced table's gradient is first copied contiguous
    copies = [i for i in made_by if events[i][1] == _aligned(n * dim * 4)]
    assert len(copies) == 2
    for start in copies:
        sizes = [size for _, size in events[start + 1 : start + 1 + len(expected_sizes)]]
        assert sizes == expected_sizes
        assert events[start + 1 + len(expected_sizes)] == (events[start][0], -_aligned(n * dim * 4))
    # the table used whole (its gradient the multiplication's, contiguous) takes the same, uncopied
    firsts = [i for i in made_by if [size for _, size in events[i : i + 4]] == [idx, idx, idx, sort]]
    assert len(firsts) == 4 and [i - 1 for i in firsts if i - 1 in copies] == copies
    for start in firsts:
        assert [size for _, size in events[start : start + len(expected_sizes)]] == expected_sizes


#: cuDNN's attention backward on an H100 (torch 2.11, bf16): the one block it takes inside the
#: operator, from the allocator's history; the same with and without dropout and a causal mask.
CUDNN_ATTENTION_BACKWARD = [
    ((8, 4, 128, 64), 1_065_216),
    ((8, 12, 512, 128), 25_362_688),
    ((64, 4, 1024, 64), 68_157_696),
    ((64, 12, 512, 64), 102_236_416),
    ((160, 4, 512, 64), 85_197_056),
    ((160, 12, 128, 64), 63_897_856),  # the 12 requests of 63,898,112 B (its block) ELECTRA's backward makes at batch 160
    ((160, 12, 1024, 128), 1_014_497_536),
]


@pytest.mark.parametrize("query, measured", CUDNN_ATTENTION_BACKWARD)
def test_cudnn_attention_backward_takes_the_measured_block(query, measured):
    from pytorch_mem_profiler.estimate.scratch import cudnn_attention_backward_scratch

    assert cudnn_attention_backward_scratch(query) == (measured,)
    rules = KernelScratch(132)
    with torch.device("meta"):
        q = torch.empty(query, dtype=torch.bfloat16)
    op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    assert rules(op, (q, q, q, q, q), {}) == (measured,)


class _Attention(nn.Module):
    def __init__(self, heads: int = 4, dim: int = 256, masked: bool = False) -> None:
        super().__init__()
        self.heads, self.masked = heads, masked
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.masked else None
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("masked", [True, False], ids=["cudnn", "flash standing in for cudnn"])
def test_an_emulated_cuda_estimate_takes_the_attention_backward_block(masked):
    """Half precision on an H100: cuDNN's attention (a mask), or flash attention standing in for it in
    the emulation (no mask): after the query's, key's and value's gradients the backward takes its
    block, and gives it back at its return."""
    batch = torch.zeros(8, 512, 256)
    est = estimate_memory(
        _Attention(masked=masked), batch, optimizer=SGD, device="cuda", emulate=True, fit=False,
        autocast=torch.bfloat16,
    )  # fmt: skip
    events = est.step_events
    backward = [(key, n) for i, (key, n) in enumerate(events.events) if events.phase_at(i) == (2, "backward")]
    attention = [(key, n) for key, n in backward if "_attention_backward" in events.sources.get(key, "")]
    gradient = 8 * 4 * 512 * 64 * 2  # each of dq, dk, dv in bf16
    block = 4 * 8 * 4 * 512 * 64 + 4 * 8 * 4 * 512 + 256  # measured layout (the table above)
    from pytorch_mem_profiler.torch_versions import CUDNN_ATTENTION_TAKES_MASK

    if masked and not CUDNN_ATTENTION_TAKES_MASK:  # torch 2.4: a mask sends it to the efficient kernel, not measured
        assert all("efficient" in events.sources[key] for key, _ in attention) and block not in [n for _, n in attention]
    else:
        assert [n for _, n in attention][:5] == [gradient, gradient, gradient, block, -block]


#: cuDNN's attention backward with grouped-query attention on an H100 (torch 2.11, bf16; the
#: allocator's history of transformers' Qwen2 with 14 query and 2 key-value heads, batch 16, 512
#: positions, head dim 64): one block per layer, the rule's plus the key's and value's gradients at
#: every query head.
QWEN2_GQA_BLOCK = 59_179_520


def test_grouped_query_attention_backward_takes_the_key_and_value_gradients_at_every_query_head():
    from pytorch_mem_profiler.estimate.allocator import block_size
    from pytorch_mem_profiler.estimate.scratch import grouped_query_gradients

    rules = KernelScratch(132)
    with torch.device("meta"):
        q = torch.empty(16, 14, 512, 64, dtype=torch.bfloat16)
        kv = torch.empty(16, 2, 512, 64, dtype=torch.bfloat16)
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    (block,) = rules(cudnn, (q, q, kv, kv, q), {})
    assert block_size(block) == QWEN2_GQA_BLOCK
    assert grouped_query_gradients(q, kv, kv) == (14_680_064, 14_680_064)  # (16, 14, 512, 64) in bf16 each
    assert rules(cudnn, (q, q, q, q, q), {}) == (QWEN2_GQA_BLOCK - 2 * 14_680_064 - 256,)  # one head group each
    # flash's backward: dq_accum and softmax_d as before, then dk_expanded and dv_expanded
    flash = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    assert rules(flash, (q, q, kv, kv, q), {}) == rules(flash, (q, q, q, q, q), {}) + (14_680_064, 14_680_064)


#: A softmax's backward on an H100 (torch 2.11): ``softmax_backward_cuda_out`` computes
#: ``grad * output`` first, a temporary of the gradient's size (one block of 268,435,456 bytes for the
#: (16 x 16, 512, 512) fp32 attention weights of ``nn.MultiheadAttention`` in the allocator's history).
SOFTMAX_PRODUCT = 268_435_456


def test_a_softmax_backward_takes_its_product_and_the_copies_of_what_is_not_contiguous():
    rules = KernelScratch(132)
    backward = torch.ops.aten._softmax_backward_data.default
    log_backward = torch.ops.aten._log_softmax_backward_data.default
    with torch.device("meta"):
        dense = torch.empty(256, 512, 512)
        permuted = torch.empty(16, 512, 512, 16).permute(0, 3, 1, 2).reshape(256, 512, 512)  # a copy: dense again
        strided = torch.empty(512, 256, 512).transpose(0, 1)  # not contiguous, dense
        half = torch.empty(256, 512, 512, dtype=torch.bfloat16)
    assert permuted.is_contiguous() and not strided.is_contiguous()
    assert rules(backward, (dense, dense, -1, torch.float32), {}) == (SOFTMAX_PRODUCT,)
    # the product follows the gradient's layout, and host_softmax_backward copies it to contiguous
    assert rules(backward, (strided, dense, -1, torch.float32), {}) == (SOFTMAX_PRODUCT, SOFTMAX_PRODUCT)
    # a contiguous gradient decides the product's layout; the output is copied
    assert rules(backward, (dense, strided, -1, torch.float32), {}) == (SOFTMAX_PRODUCT, SOFTMAX_PRODUCT)
    assert rules(backward, (half, half, -1, torch.bfloat16), {}) == (SOFTMAX_PRODUCT // 2,)
    # log-softmax's backward computes no product: only the copies
    assert rules(log_backward, (dense, dense, -1, torch.float32), {}) == ()
    assert rules(log_backward, (strided, dense, -1, torch.float32), {}) == (SOFTMAX_PRODUCT,)
    # the forward reads a contiguous input
    softmax = torch.ops.aten._softmax.default
    assert rules(softmax, (dense, -1, False), {}) == () and rules(softmax, (strided, -1, False), {}) == (SOFTMAX_PRODUCT,)


class _ExplicitAttention(nn.Module):
    """Attention written out: scores, softmax, weights times values (no fused kernel)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5).softmax(-1)
        return (weights @ v).transpose(1, 2).reshape(b, s, d)


def test_an_estimate_for_cuda_takes_the_softmax_backwards_product_beside_its_gradient():
    """Each step's softmax backward: the input's gradient it returns and the product it takes and
    gives back, both of the attention weights' size."""
    weights = 8 * 4 * 128 * 128 * 4
    est = estimate_memory(_ExplicitAttention(), torch.zeros(8, 128, 64), optimizer=SGD, device="cuda", emulate=True, fit=False)
    events = est.step_events
    made = [(n, events.sources[key].split("; ")[2]) for key, n in events.events
            if n > 0 and events.sources.get(key, "").startswith("aten._softmax_backward_data")]  # fmt: skip
    assert made == [(weights, "activation_gradients"), (weights, "other")] * 2, made


def test_safe_softmax_takes_a_bool_of_its_input_one_of_its_rows_and_a_zero_on_cuda():
    from pytorch_mem_profiler.estimate.allocator import block_size
    from pytorch_mem_profiler.estimate.scratch import KernelScratch

    if not hasattr(torch.ops.aten, "_safe_softmax"):
        pytest.skip(f"torch {torch.__version__} has no _safe_softmax")
    scores = torch.empty(3, 5, 64, 48, device="meta")
    taken = KernelScratch()(torch.ops.aten._safe_softmax.default, (scores, -1), {})
    # the -inf entries (a bool each), the rows all -inf (a bool each, the last dimension kept), a 0-dim zero
    assert taken == (block_size(scores.numel()), block_size(scores.numel() // 48), block_size(4))
    half = KernelScratch()(torch.ops.aten._safe_softmax.default, (scores.half(), 2, torch.float32), {})
    assert half == (block_size(scores.numel()), block_size(scores.numel() // 64), block_size(4))
