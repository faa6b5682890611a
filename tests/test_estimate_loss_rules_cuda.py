"""On a GPU: binary_cross_entropy_with_logits's temporaries, real against the estimate's rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pytorch_mem_profiler.estimate.allocator import block_size

pytestmark = pytest.mark.cuda

N = 329_065
#: a full reduction's own blocks inside its kernel (the buffer of partial sums and the semaphores), not in the rule
REDUCTION_SCRATCH = 2 * 512


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_s_forward_and_backward_peak_as_the_rule_says(reduction):
    logits = torch.zeros(N, device="cuda", requires_grad=True)
    target = torch.zeros(N, device="cuda")
    full = block_size(N * 4)
    # once before measuring: what a process's first call of these kernels takes once is not the rule's
    # (seen as a 1,015,296-byte forward excess in one test session, the first of the three reductions)
    F.binary_cross_entropy_with_logits(logits, target, reduction=reduction).sum().backward()
    logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction=reduction)
    forward_peak = torch.cuda.max_memory_allocated() - base
    kept = torch.cuda.memory_allocated() - base
    # the rule: the log-sigmoid and (1 - target) alive together, with the reduced output where reduced
    rule = 2 * full + (512 if reduction != "none" else 0)
    assert rule <= forward_peak <= rule + REDUCTION_SCRATCH, (forward_peak, rule)
    assert kept == (512 if reduction != "none" else full)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss.sum().backward() if reduction == "none" else loss.backward()
    backward_peak = torch.cuda.max_memory_allocated() - before
    # one input-sized gradient (it becomes logits.grad), beside the loss's own gradient and a reduction's
    # blocks: never two input-sized blocks together, as the out-of-place branch (sigmoid, sub, mul) holds
    assert full <= backward_peak <= full + 2048, backward_peak
    assert torch.cuda.memory_allocated() - before == full  # logits.grad
