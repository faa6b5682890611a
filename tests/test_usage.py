"""memory_usage, print_cuda_memory_usage and memory_stats on CPU, through the core's CPU counter."""

from __future__ import annotations

import io

import pytest
import torch

from pytorch_mem_profiler import (
    MemoryProfiler,
    memory_stats,
    memory_usage,
    print_cuda_memory_usage,
)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_block_usage_numbers_are_the_tensors_bytes(stream):
    with memory_usage("block", device="cpu", stream=stream) as usage:
        kept_a = torch.ones(1000)  # float32
        kept_b = torch.ones(300, dtype=torch.float64)
        temp = torch.zeros(5000, dtype=torch.int16)
        peak = nbytes(kept_a) + nbytes(kept_b) + nbytes(temp)
        del temp
    assert usage.allocated_before == 0
    assert usage.added == nbytes(kept_a) + nbytes(kept_b) == 4000 + 2400
    assert usage.peak_above_start == peak == 6400 + 10_000
    assert usage.raised is False
    assert stream.getvalue() == "CPU memory usage [block]: 0.00 GB (peak 0.00 GB above start)\n"
    assert usage.text == stream.getvalue().rstrip("\n")


def test_gb_with_two_decimals(stream):
    with memory_usage(device="cpu", stream=stream) as usage:
        x = torch.empty(37_000_000, dtype=torch.uint8)
        y = torch.empty(15_000_000, dtype=torch.uint8)
        del y
    assert usage.added == nbytes(x) == 37_000_000
    assert usage.peak_above_start == 52_000_000
    assert stream.getvalue() == "CPU memory usage: 0.04 GB (peak 0.05 GB above start)\n"


def test_views_and_in_place_ops_of_older_tensors_count_nothing(stream):
    older = torch.ones(1000)
    with memory_usage(device="cpu", stream=stream) as usage:
        view = older.t()
        older.add_(1)
        detached = older.detach()
        literal = torch.tensor([1.0, 2.0, 3.0])  # made outside dispatch, then lifted: new memory
    assert view.data_ptr() == detached.data_ptr() == older.data_ptr()
    assert usage.added == nbytes(literal) == 12


def test_nested_blocks_indent_and_add_up(stream):
    with memory_usage("outer", "cpu", stream=stream) as outer:
        a = torch.zeros(250)
        with memory_usage("inner", "cpu", stream=stream) as inner:
            b = torch.zeros(100, dtype=torch.float64)
            with memory_usage("innermost", "cpu", stream=stream) as innermost:
                c = torch.zeros(10, dtype=torch.uint8)
    assert innermost.added == nbytes(c)
    assert inner.added == nbytes(b) + nbytes(c)
    assert outer.added == nbytes(a) + nbytes(b) + nbytes(c)
    lines = stream.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "    CPU memory usage [innermost]",
        "  CPU memory usage [inner]",
        "CPU memory usage [outer]",
    ]


def test_prints_when_the_block_raises_and_the_exception_propagates(stream):
    with pytest.raises(ValueError, match="bad batch"):
        with memory_usage("step", "cpu", stream=stream) as usage:
            x = torch.ones(256)
            raise ValueError("bad batch")
    assert usage.raised is True
    assert usage.added == nbytes(x)
    assert stream.getvalue().endswith("; the block raised ValueError\n")
    # The block after it is not indented: nesting depth was restored.
    with memory_usage("next", "cpu", stream=stream):
        pass
    assert stream.getvalue().splitlines()[-1].startswith("CPU memory usage [next]")


def test_counter_is_removed_after_the_block(stream):
    with memory_usage(device="cpu", stream=stream) as usage:
        pass
    after = torch.ones(1000)  # made after the block: not counted
    assert usage.added == 0 and usage.peak_above_start == 0
    assert nbytes(after) == 4000


def test_a_block_whose_counter_failed_says_n_a_not_frozen_figures(stream, caplog):
    """A fault that stops the CPU counter inside the block (here: where it counts a new storage)
    leaves its figures frozen: the block gives n/a, and the next block counts again."""
    from pytorch_mem_profiler.measure.storage_counting import shared_registry

    registry = shared_registry()

    def fails(*args, **kwargs):
        raise RuntimeError("injected")

    with memory_usage("failed", device="cpu", stream=stream) as usage:
        registry.add = fails
        try:
            kept = torch.ones(1000)
        finally:
            del registry.add
    assert "CPU storage counter failed" in caplog.text
    assert usage.added is None and usage.peak_above_start is None
    assert stream.getvalue() == "CPU memory usage [failed]: n/a\n"
    with memory_usage(device="cpu", stream=io.StringIO()) as again:
        kept = torch.ones(1000)
    assert again.added == nbytes(kept) == 4000


def test_reusable_but_not_reentrant(stream):
    usage = memory_usage("twice", "cpu", stream=stream)
    with usage:
        first = torch.ones(10)
    assert usage.added == 40
    with usage:
        second = torch.ones(20)
        with pytest.raises(RuntimeError, match="already running"):
            usage.__enter__()
    assert usage.added == 80
    assert nbytes(first) + nbytes(second) == 120


def test_inside_a_profiler_it_leaves_the_record_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(16, 32)
    records, usages = [], []
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True) as profiler:
        for wrapped in (False, True, False, True):
            if wrapped:
                with memory_usage("forward", "cpu", stream=io.StringIO()) as usage:
                    out = model(batch)
                usages.append(usage)
            else:
                out = model(batch)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            del out
            records.append(profiler.record_stats())
    plain, wrapped = records[2], records[3]
    assert wrapped.feature_maps == plain.feature_maps > 0
    assert wrapped.iteration_peak_allocated == plain.iteration_peak_allocated
    assert wrapped.gradients == plain.gradients
    # What the block kept is what the profiler calls the forward's feature maps.
    assert usages[1].added == wrapped.feature_maps


def test_bad_arguments():
    with pytest.raises(ValueError, match="device='nonsense'"):
        memory_usage(device="nonsense")
    with pytest.raises(TypeError, match="label must be a str or None, got int"):
        memory_usage(3)
    with pytest.raises(TypeError, match="stream must have a write"):
        memory_usage(stream=object())


def test_cuda_asked_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        memory_usage(device="cuda:0")


def test_print_cuda_memory_usage_without_cuda_warns_and_measures_cpu(monkeypatch, stream):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="measures the CPU instead") as warned:
        with print_cuda_memory_usage(stream=stream) as usage:
            x = torch.empty(10_000_000, dtype=torch.uint8)
    assert len(warned) == 1
    assert usage.device == torch.device("cpu")
    assert usage.added == nbytes(x)
    assert stream.getvalue() == "CPU memory usage: 0.01 GB (peak 0.01 GB above start)\n"


def test_memory_stats_on_cpu_says_unknown():
    stats = memory_stats("cpu")
    assert stats == {"allocated_gb": None, "reserved_gb": None, "peak_allocated_gb": None}
