"""CUDA's sum and mean on the GPU: what each asks of the caching allocator beside its output, from the
allocator's history, against ``estimate.reductions.reduction_scratch``, on layouts the rule was not
read from (middle and trailing dimensions, transposed, channels_last, sliced, full sums, bf16 and fp16).

    PYTHONPATH=. python3 -m pytest tests/test_estimate_reductions_cuda.py -m cuda -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


def _layout(shape: tuple[int, ...], how: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if how == "transposed":  # the last two dimensions swapped in memory
        return torch.randn(*shape[:-2], shape[-1], shape[-2], device=device, dtype=dtype).transpose(-1, -2)
    if how == "channels_last":
        return torch.randn(shape, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    if how == "sliced":  # a part of a wider tensor, starting at an odd element
        wide = torch.randn(*shape[:-1], shape[-1] * 2 + 1, device=device, dtype=dtype)
        return wide[..., 1 : shape[-1] + 1]
    return torch.randn(shape, device=device, dtype=dtype)


def _blocks_of(run, device: torch.device) -> tuple[torch.Tensor, list[int], tuple[int, ...]]:
    """``run()``'s output, the blocks it kept and those it gave back before returning (each rounded
    as the allocator does), from the allocator's history of a second call (nothing first-call)."""
    from pytorch_mem_profiler.estimate.allocator import block_size

    run()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10_000)
    try:
        out = run()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    given = {entry["addr"] for entry in trace if entry["action"] == "free_completed"}
    taken = [entry for entry in trace if entry["action"] == "alloc"]
    kept = [block_size(entry["size"]) for entry in taken if entry["addr"] not in given]
    return out, kept, tuple(block_size(entry["size"]) for entry in taken if entry["addr"] in given)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "shape, dims, how, dtype, op",
    [
        ((8, 512, 128, 16), (0, 2), "contiguous", torch.float32, "sum"),
        ((16, 1024, 64, 8), (0, 2), "contiguous", torch.bfloat16, "sum"),
        ((8, 128, 512), (0, 1), "transposed", torch.float32, "sum"),
        ((4, 2048, 256), (0, 1), "transposed", torch.float16, "mean"),
        ((64, 64, 56, 56), (0, 2, 3), "channels_last", torch.float32, "sum"),
        ((32, 256, 28, 28), (0, 2, 3), "contiguous", torch.bfloat16, "sum"),
        ((64, 512, 768), (0, 1), "sliced", torch.float32, "sum"),
        ((4096, 3072), (0,), "contiguous", torch.float32, "mean"),
        ((8, 4096, 1024), None, "contiguous", torch.float32, "sum"),
        ((2, 8, 4096, 64), (1,), "contiguous", torch.float32, "sum"),
        ((256, 65536), (1,), "contiguous", torch.bfloat16, "sum"),
        ((16, 4096, 64), (2,), "transposed", torch.float32, "sum"),
    ],
)
def test_a_reduction_takes_the_rules_blocks_beside_its_output(shape, dims, how, dtype, op):
    from pytorch_mem_profiler.estimate.allocator import block_size
    from pytorch_mem_profiler.estimate.reductions import reduction_scratch

    device = torch.device("cuda", torch.cuda.current_device())
    x = _layout(shape, how, dtype, device)
    reduce = getattr(torch, op)
    run = (lambda: reduce(x)) if dims is None else (lambda: reduce(x, dim=dims))
    out, kept, transient = _blocks_of(run, device)
    assert kept == [block_size(out.untyped_storage().nbytes())]
    rule = reduction_scratch(tuple(x.shape), tuple(x.stride()), dims, x.element_size(), storage_offset=x.storage_offset(),
                             multiprocessors=torch.cuda.get_device_properties(device).multi_processor_count,
                             threads_per_multiprocessor=getattr(torch.cuda.get_device_properties(device), "max_threads_per_multi_processor", 2048))  # fmt: skip
    assert transient == rule, (transient, rule)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "make, dims, dtype",
    [
        (lambda d: torch.randn(64, 1024, 512, device=d) > 0, [-1], None),  # amax's backward: the mask's int64 copy
        (lambda d: torch.randint(0, 9, (4096, 512), device=d, dtype=torch.int32), [0], None),
        (lambda d: torch.randn(8, 512, 128, 16, device=d), [0, 2], torch.float64),
        (lambda d: torch.randn(16, 1024, 64, 8, device=d, dtype=torch.bfloat16), [0, 2], torch.float32),  # read as it is
        (lambda d: torch.randn(8, 128, 512, device=d).transpose(1, 2), [0, 1], torch.bfloat16),  # the copy, then its sums
    ],
    ids=["bool-mask", "int32", "to-float64", "bf16-to-float32", "transposed-to-bf16"],
)
def test_a_sum_to_another_dtype_takes_the_rules_copy_and_partial_sums(make, dims, dtype):
    from pytorch_mem_profiler.estimate.allocator import block_size
    from pytorch_mem_profiler.estimate.scratch import KernelScratch

    device = torch.device("cuda", torch.cuda.current_device())
    x = make(device)
    kwargs = {} if dtype is None else {"dtype": dtype}
    run = lambda: torch.sum(x, dims, keepdim=True, **kwargs)  # noqa: E731
    out, kept, transient = _blocks_of(run, device)
    assert kept == [block_size(out.untyped_storage().nbytes())]
    props = torch.cuda.get_device_properties(device)
    rules = KernelScratch(props.multi_processor_count, getattr(props, "max_threads_per_multi_processor", 2048))
    assert transient == rules(torch.ops.aten.sum.dim_IntList, (x, dims, True), kwargs), transient
