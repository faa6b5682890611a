"""The allocator replay (``estimate/allocator.py``) and what it is fed, on a CPU: the caching allocator's
rules on hand-made streams, the step's events in the order the device would see them, and the largest
batch verified with the estimate's stated error left free."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import (
    LAYOUT_ALLOWANCE,
    AllocatorReplay,
    StepEvents,
    block_size,
    simulate_reserved,
    workspaces_at_first_use,
)
from pytorch_mem_profiler.estimate.result import BatchFit, MemoryEstimate
from pytorch_mem_profiler.estimate.step import StepPlan, moved_order, run_step
from pytorch_mem_profiler.stats import LayerFeatureMaps

MIB = 1 << 20


# -- the rules -------------------------------------------------------------------------------
def test_among_free_blocks_of_one_size_the_lowest_address_is_taken():
    # two 20 MiB segments, each holding 9 and 7 MiB with 4 MiB free at its end
    events = [(1, 9 * MIB), (2, 7 * MIB), (3, 9 * MIB), (4, 7 * MIB), (5, 4 * MIB)]
    by_creation = AllocatorReplay(record=True).run(events)
    by_address = AllocatorReplay(record=True, addresses=[0x2000_0000, 0x1000_0000]).run(events)
    taken = lambda replay: [e.address for e in replay.trace if e.action == "alloc" and e.key == 5][0]  # noqa: E731
    made = [e.address for e in by_creation.trace if e.action == "segment_alloc"]
    assert len(made) == 2 and by_creation.reserved == 40 * MIB
    # made-up addresses go down, as cudaMalloc's were seen to: the newer segment's block is taken
    assert made[1] < made[0] and taken(by_creation) == made[1] + 16 * MIB
    assert taken(by_address) == 0x1000_0000 + 16 * MIB  # the lower address: the newer segment's
    by_rising = AllocatorReplay(record=True, addresses=[0x1000_0000, 0x2000_0000]).run(events)
    assert taken(by_rising) == 0x1000_0000 + 16 * MIB  # the older one's, where it lies lower


def test_made_up_addresses_lie_below_every_segment_given_or_made():
    replay = AllocatorReplay(record=True)
    replay.add_segment(20 * MIB, [(20 * MIB, None)], small=False, address=0x7F00_0000_0000)
    replay.run([(1, 30 * MIB), (2, 1000), (3, 40 * MIB), (1, -30 * MIB)])
    replay.release_cached()
    replay.run([(4, 50 * MIB)])
    made = [e.address for e in replay.trace if e.action == "segment_alloc"]
    # the given segment first, then the four made, each below all before it (the 30 MiB one given back too)
    assert made[0] == 0x7F00_0000_0000 and len(made) == 5 and made == sorted(made, reverse=True)


def test_under_a_limit_where_a_block_lands_decides_whether_a_segment_can_be_given_back():
    # Segment A (20 MiB) keeps an 8 MiB block and has a free 12 MiB one; segment B (12 MiB), made
    # later, is wholly free. A 12 MiB request ties between them and takes the lower address. If it
    # takes A's block, B can be given back for the next segment under the limit; if it takes B,
    # nothing can, and the step runs out of memory.
    events = [
        (1, 8 * MIB),    # A: a 20 MiB segment, its rest split off
        (5, 12 * MIB),   # A's free 12 MiB
        (2, 12 * MIB),   # B: a 12 MiB segment
        (5, -12 * MIB), (2, -12 * MIB),
        (3, 12 * MIB),   # the tie
        (4, 20 * MIB),   # a new 20 MiB segment: 32 + 20 > 40, B must go
    ]  # fmt: skip
    limit = 40 * MIB
    # where cudaMalloc gave B the lower address, the allocator takes B: out of memory
    real = AllocatorReplay(limit=limit, addresses=[0x2000_0000, 0x1000_0000]).run(events)
    assert real.oom == (6, 20 * MIB) and real.releases == 1
    # where it gave A the lower one, A's block is taken and B is given back
    assert AllocatorReplay(limit=limit, addresses=[0x1000_0000, 0x2000_0000]).run(events).oom is None
    # the replay's own addresses go down, as cudaMalloc's were seen to: B lies lower
    assert simulate_reserved(events, limit=limit) is None


def test_a_release_gives_back_only_wholly_free_segments_of_both_pools():
    replay = AllocatorReplay(record=True)
    replay.run([(1, 1000), (3, 12 * MIB), (2, 3 * MIB), (4, 2000), (1, -1000), (3, -12 * MIB), (4, -2000)])
    # the small segment is wholly free again, the 12 MiB one is free, the 20 MiB one holds key 2
    assert replay.release_cached() == 2 * MIB + 12 * MIB
    assert [(size, small, blocks) for _, size, small, blocks in replay.segments] == [(20 * MIB, False, [(3 * MIB, 2), (17 * MIB, None)])]
    assert [e.action for e in replay.trace[-2:]] == ["segment_free", "segment_free"]
    assert replay.reserved == 20 * MIB and replay.allocated == 3 * MIB


def test_a_segment_given_before_the_events_is_used_and_checked():
    replay = AllocatorReplay()
    replay.add_segment(2 * MIB, [(MIB, -7), (MIB, None)], small=True, address=0x10)
    replay.run([(1, 600 << 10), (-7, -MIB)])
    assert replay.reserved == 2 * MIB and replay.allocated == block_size(600 << 10)
    try:
        AllocatorReplay().add_segment(2 * MIB, [(MIB, None)], small=True)
    except ValueError as err:
        assert "add up to 1048576" in str(err)
    else:
        raise AssertionError("a segment whose blocks do not fill it was accepted")


# -- the step's events -------------------------------------------------------------------------
class Scaled(nn.Module):
    """A top-level parameter beside children, and batch norm buffers: ``parameters()`` lists
    ``scale`` first and the buffers last; ``model.to(device)`` copies them in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3000))
        self.body = nn.Sequential(nn.Linear(64, 3000), nn.BatchNorm1d(3000), nn.ReLU())
        self.head = nn.Linear(3000, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * self.scale)


def _plan(model: nn.Module) -> StepPlan:
    return StepPlan(model=model, example_inputs=torch.zeros(8, 64), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                    device=torch.device("cuda"), run_device=torch.device("cpu"))  # fmt: skip


def test_the_weights_come_in_the_order_model_to_device_copies_them():
    model = Scaled()
    copied: list[int] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        copied.append(block_size(t.untyped_storage().nbytes()))
        return t

    model._apply(record)  # what model.to(device) runs: the order its copies are made in
    listed = [block_size(t.untyped_storage().nbytes()) for t in [*model.parameters(), *model.buffers()]]
    assert copied != listed  # the order differs for this model
    step = run_step(_plan(Scaled()), 8)
    before = step.step_events.events[: step.step_events.marks[0][0]]
    assert [n for _, n in before][: len(copied)] == copied
    assert [block_size(t.untyped_storage().nbytes()) for t in moved_order(model)] == copied


def test_the_events_mark_each_phase_of_each_step_and_name_what_made_each_storage():
    step = run_step(_plan(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))), 8)
    events = step.step_events
    assert [(s, p) for _, s, p in events.marks] == [(s, p) for s in (1, 2) for p in ("forward", "other", "backward", "optimizer", "other")]
    # before the steps: two weights and two biases, then the batch
    before = events.events[: events.marks[0][0]]
    assert [n for _, n in before] == [block_size(n) for n in (256 * 64 * 4, 256 * 4, 10 * 256 * 4, 10 * 4, 8 * 64 * 4)]
    assert all(n > 0 for _, n in before)
    # the first forward's first storage is the first Linear's output, made by addmm, an activation
    start = events.marks[0][0]
    key, nbytes = events.events[start]
    assert nbytes == block_size(8 * 256 * 4) and events.phase_at(start) == (1, "forward")
    assert events.sources[key] == "aten.addmm.default; forward; other"  # ReLU keeps its own output, not this
    assert events.sources[events.events[start + 1][0]] == "aten.relu.default; forward; activations"
    assert events.sources[before[0][0]] == "adopted before the step; other; weights"
    # the replay of the events is the step's reserved
    assert simulate_reserved(events.events) == step.reserved


def test_a_cuda_estimate_hands_its_events_to_the_replay_with_the_workspaces_first():
    est = estimate_memory(nn.Linear(64, 64), torch.zeros(8, 64), device="cuda", emulate=True, fit=False)
    events = est.step_events
    assert events.events[:2] == ((-1, 32 * MIB), (-2, 32 * MIB))
    assert events.sources[-1].startswith("cuBLAS workspace")
    assert events.marks[0][0] == 2 + 3  # the workspaces, the weight, the bias, the batch
    assert simulate_reserved(events.events) == est.reserved
    assert estimate_memory(nn.Linear(4, 4), torch.zeros(2, 4), device="cpu", fit=False).step_events is None


def test_step_events_join_with_their_marks_shifted():
    a = StepEvents(((1, 512),), ((0, 1, "forward"),), {1: "x"})
    b = StepEvents(((2, 512), (2, -512)), ((1, 1, "backward"),), {2: "y"})
    joined = a + b
    assert joined.events == ((1, 512), (2, 512), (2, -512)) and joined.marks == ((0, 1, "forward"), (2, 1, "backward"))
    assert joined.phase_at(1) == (1, "forward") and joined.phase_at(2) == (1, "backward") and dict(joined.sources) == {1: "x", 2: "y"}


# -- the largest batch -------------------------------------------------------------------------
def _estimate(**kwargs) -> MemoryEstimate:
    fit = BatchFit({"backward": (0.0, 100.0)}, (1, 2), None, None)
    base = dict(device="cuda", batch_size=1, peak=100, peak_phase="backward", phases={}, peak_breakdown={}, peak_layers={},
                layers=LayerFeatureMaps({}, {}, 0, 0, 0), weights=0, buffers=0, gradients=0, optimizer_state=0, inputs=0, fit=fit)  # fmt: skip
    return MemoryEstimate(**{**base, **kwargs})


def test_the_largest_batch_leaves_the_stated_bound_free_at_each_batch_tried():
    # the replay needs 100 bytes a sample; the estimate says it may be off by 10 a sample
    replay = lambda batch, limit, process=None: 100 * batch if 100 * batch <= limit else None  # noqa: E731
    plain = _estimate(reserved=100, reserved_at=replay)
    assert plain.batch_search(1006, margin=0, outside=0).largest == 10  # 0.5% of 1006 (6) left for the layout
    bounded = _estimate(reserved=100, reserved_at=replay, error_bounds={"conv": 10}, transient_bounds=frozenset({"conv"}),
                        search_bound_at=lambda batch: 10 * batch)  # fmt: skip
    search = bounded.batch_search(1000, margin=0, outside=0)
    assert search.largest == 9 and search.bound == 90 and search.layout == 5  # 9 * 110 + 5 <= 1000 < 10 * 110
    assert bounded.max_batch_size(1000, margin=0, outside=0) == 9
    # off CUDA the peak and the bound: the same rule
    on_cpu = _estimate(device="cpu", peak_at=lambda batch: (100 * batch, "backward"), search_bound_at=lambda batch: 10 * batch,
                       error_bounds={"x": 10})  # fmt: skip
    assert on_cpu.batch_search(1000, margin=0, outside=0).largest == 9


def test_any_batch_can_be_asked_whether_it_fits_where_the_allocators_answer_is_not_monotonic():
    # near a limit a larger batch can lay its blocks out so that it fits where a smaller one ran out
    # (Llama-style decoder under 12 GiB on an H200: 19 fits, 20 runs out, 21 and 22 fit, the replay the same)
    fitting = {*range(1, 20), 21, 22}
    est = _estimate(reserved=100, reserved_at=lambda batch, limit, process=None: 100 if batch in fitting else None)
    largest = est.batch_search(10_000, margin=0, outside=0).largest  # a batch that fits, the next one up not
    assert largest in (19, 22) and est.batch_fits(largest, 10_000, outside=0) and not est.batch_fits(largest + 1, 10_000, outside=0)
    assert [b for b in range(18, 25) if est.batch_fits(b, 10_000, outside=0)] == [18, 19, 21, 22]
    # the stated bound is left free as the search leaves it
    bounded = _estimate(reserved=100, reserved_at=lambda batch, limit, process=None: 100 * batch if 100 * batch <= limit else None,
                        error_bounds={"conv": 10}, search_bound_at=lambda batch: 10 * batch)  # fmt: skip
    assert bounded.batch_fits(9, 1000, outside=0) and not bounded.batch_fits(10, 1000, outside=0)
    # 9 * (100 + 10) = 990, and 0.5% of what is left after outside= for the layout: 5 of 995, 5 of 994
    assert bounded.batch_fits(9, 1000, outside=5) and not bounded.batch_fits(9, 1000, outside=6)
    on_cpu = _estimate(device="cpu", peak_at=lambda batch: (100 * batch, "backward"))
    assert on_cpu.batch_fits(10, 1000, outside=0) and not on_cpu.batch_fits(11, 1000, outside=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch"):
            est.batch_fits(bad, 1000)
    with pytest.raises(ValueError, match="fit=True"):
        _estimate().batch_fits(2, 1000)


def test_whether_a_batch_fits_is_the_replay_of_that_batchs_own_estimate():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    est = estimate_memory(model, torch.zeros(4, 256), device="cuda", emulate=True)
    limit = 160 * MIB
    for batch in (64, 5000, 20_000, 40_000):
        own = estimate_memory(model, torch.zeros(batch, 256), device="cuda", emulate=True, fit=False)
        # under the limit, and under the limit less the layout allowance (0.5%)
        under = [AllocatorReplay(limit=lim).run(own.step_events.events) for lim in (limit, limit - math.ceil(LAYOUT_ALLOWANCE * limit))]
        assert est.batch_fits(batch, limit, outside=0, process="warmed") == all(replay.oom is None for replay in under), batch
    largest = est.batch_search(limit, margin=0, outside=0).largest
    assert est.batch_fits(largest, limit, outside=0) and not est.batch_fits(largest + max(1, largest // 50), limit, outside=0)


def test_a_batch_that_fits_the_replay_by_a_sliver_is_not_the_answer():
    # H200s ran out of memory at three predicted batches that fit the replay with 0.05-0.26% of the
    # limit left: the search leaves LAYOUT_ALLOWANCE of it free, on top of the stated bound
    needs = lambda batch: 1_000_000 * batch + 3_000  # noqa: E731  bytes the replay reserves at a batch
    est = _estimate(reserved=1_000_000, reserved_at=lambda batch, limit, process=None: needs(batch) if needs(batch) <= limit else None)
    limit = needs(100) + 4_000  # 100 fits the replay with 0.004% left
    search = est.batch_search(limit, margin=0, outside=0)
    assert search.layout == math.ceil(LAYOUT_ALLOWANCE * limit) and search.largest == 99
    assert needs(99) + search.layout <= limit < needs(100) + search.layout
    assert not est.batch_fits(100, limit, outside=0) and est.batch_fits(100, limit + search.layout, outside=0)
    # with less room the allocator gives its free segments back sooner, which can fit a batch that
    # the limit itself does not (a replay of FeedForwardStack under 256 MiB does that at batch 13)
    sooner = _estimate(reserved=1, reserved_at=lambda batch, limit, process=None: limit if limit < 1000 else None)
    assert not sooner.batch_fits(1, 1000, outside=0)
    # off CUDA no allocator lays blocks out: the peak decides, with nothing left for a layout
    on_cpu = _estimate(device="cpu", peak_at=lambda batch: (needs(batch), "backward"))
    found = on_cpu.batch_search(limit, margin=0, outside=0)
    assert (found.largest, found.layout) == (100, 0)


def test_the_replay_places_cublas_workspaces_as_a_warmed_a_fresh_or_either_process_has_them():
    # A fresh process makes cuBLAS's workspace at each thread's first matrix product, amid the step's
    # blocks; a process that ran a step before has them already (Qwen2 at 17 on an H200: 1.08 GB apart)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    est = estimate_memory(model, torch.zeros(4, 256), device="cuda", emulate=True)
    own = estimate_memory(model, torch.zeros(3000, 256), device="cuda", emulate=True, fit=False)
    events = own.step_events
    workspaces = [(key, n) for key, n in events.events if key < 0]
    assert len(workspaces) == 2 and len(events.blas_first) == 2  # the script's thread and autograd's
    # each first use is just after a matrix product's output, the forward's then the backward's (the
    # kernel asks for the workspace when it calls cuBLAS, its output made: an H200's allocator trace)
    first_ops = [events.sources[events.events[i - 1][0]] for i in events.blas_first]
    assert first_ops[0].startswith("aten.addmm") and "; forward;" in first_ops[0], first_ops
    assert "; backward;" in first_ops[1] and first_ops[1].split(".")[1] in ("mm", "addmm"), first_ops
    # each placement replayed independently here
    step = [event for event in events.events if event[0] >= 0]
    first_use = [i - len(workspaces) for i in events.blas_first]
    placed = {"warmed": [*workspaces, *step], "fresh": workspaces_at_first_use(workspaces, step, first_use)}
    warm, fresh = (AllocatorReplay().run(placed[p]).peak_reserved for p in ("warmed", "fresh"))
    assert warm == own.reserved == est.reserved_at(3000, None) == est.reserved_at(3000, None, "warmed")
    assert est.reserved_at(3000, None, "fresh") == fresh and est.reserved_at(3000, None, "either") == max(warm, fresh)
    # under a limit: out of memory where that placement runs out ("either": where one does)
    for limit in (min(warm, fresh) - 1, max(warm, fresh) - 1, max(warm, fresh)):
        runs = {p: AllocatorReplay(limit=limit).run(placed[p]).oom is None for p in placed}
        assert (est.reserved_at(3000, limit, "fresh") is not None) == runs["fresh"], limit
        assert (est.reserved_at(3000, limit, "either") is not None) == (runs["warmed"] and runs["fresh"]), limit


def test_the_batch_search_asks_the_replay_for_the_process_given():
    asked = []

    def replay(batch, limit, process="warmed"):
        asked.append(process)
        need = 100 * batch + (50 if process in ("fresh", "either") else 0)
        return need if need <= limit else None

    est = _estimate(reserved=100, reserved_at=replay)
    warmed, fresh = (est.batch_search(1006, margin=0, outside=0, process=p) for p in ("warmed", "fresh"))
    assert (warmed.largest, warmed.process, fresh.largest, fresh.process) == (10, "warmed", 9, "fresh")
    assert est.max_batch_size(1006, margin=0, outside=0, process="either") == 9 and "either" in asked
    assert est.batch_fits(10, 1006, outside=0, process="warmed") and not est.batch_fits(10, 1006, outside=0, process="fresh")
    # by default a user's run: a new process, its workspaces made at the first matrix products
    asked.clear()
    assert est.batch_search(1006, margin=0, outside=0) == fresh and not est.batch_fits(10, 1006, outside=0)
    assert set(asked) == {"fresh"}
    for call in (lambda: est.batch_search(1000, process="cold"), lambda: est.batch_fits(2, 1000, process=None)):
        with pytest.raises(ValueError, match="process must be one of"):
            call()


def test_the_stated_bound_counts_one_operators_buffers_once():
    est = _estimate(error_bounds={"conv": 300, "conv backward": 500, "kept": 40}, transient_bounds=frozenset({"conv", "conv backward"}))
    assert est.error_bound == 540
    assert "± conv backward (inside one operator)" in str(est) and "± kept (kept alive)" in str(est)


_RECURRENT = (
    "import torch\nfrom torch import nn\nbatch_size = 4\n"
    "class Recurrent(nn.Module):\n"
    "    def __init__(self):\n        super().__init__()\n        self.gru = nn.GRU(16, 64, batch_first=True)\n        self.head = nn.Linear(64, 4)\n"
    "    def forward(self, x):\n        return self.head(self.gru(x)[0])\n"
    "def build_model():\n    return Recurrent()\n"
    "def example_inputs(batch_size):\n    return torch.randn(batch_size, 32, 16)\n"
)
_CONVOLUTIONAL = (
    "import torch\nfrom torch import nn\nbatch_size = 4\n"
    "def build_model():\n    return nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, 4))\n"
    "def example_inputs(batch_size):\n    return torch.randn(batch_size, 16, 32, 32)\n"
)


def _script(tmp_path, text):
    path = tmp_path / "model.py"
    path.write_text(text)
    namespace: dict = {}
    exec(compile(text, str(path), "exec"), namespace)  # the same model for the estimate made here
    return path, namespace


def test_the_command_says_what_it_left_free_for_the_stated_bound(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main
    from pytorch_mem_profiler.units import format_amount

    path, script = _script(tmp_path, _RECURRENT)
    memory = 1500 * 10**6  # the default 1 GiB outside PyTorch taken off
    assert main(["estimate", str(path), "--device", "cuda", "--memory", "1500MB", "--margin", "0"]) == 0
    out = capsys.readouterr().out
    est = estimate_memory(script["build_model"], script["example_inputs"], batch_size=4, device="cuda", emulate=True)
    search = est.batch_search(memory, margin=0)
    # cuDNN's recurrent workspace does not give way under a limit: its bound is left free
    assert est.search_bound == est.error_bound > 0 and search.bound > est.error_bound  # the bound at the answer, a larger batch
    assert f"Largest batch on a device of 1,500 MB: {search.batch_size} (" in out
    assert f"; {format_amount(search.bound, 'MB', digits=3)} left free for the stated ±;" in out
    assert "give way" not in out  # no convolution


def test_the_convolutions_bound_is_not_left_free_since_cudnn_falls_back(tmp_path, capsys):
    # cuDNN runs another plan when the allocator refuses a plan's workspace: a workspace larger than
    # the rule's that does not fit is done without, so the search leaves no room for the bound
    from pytorch_mem_profiler.analysis.cli import main

    path, script = _script(tmp_path, _CONVOLUTIONAL)
    assert main(["estimate", str(path), "--device", "cuda", "--memory", "1500MB", "--margin", "0"]) == 0
    out = capsys.readouterr().out
    est = estimate_memory(script["build_model"], script["example_inputs"], batch_size=4, device="cuda", emulate=True)
    assert est.error_bound > 0 and est.search_bound == 0
    assert est.fallback_bounds == set(est.error_bounds)
    search = est.batch_search(1500 * 10**6, margin=0)
    assert search.bound == 0 and "left free for the stated" not in out
    assert "cuDNN's convolution workspaces give way where they do not fit (cuDNN runs another plan), their ± not left free" in out
    assert f"Largest batch on a device of 1,500 MB: {search.batch_size} (" in out


def test_the_command_answers_for_the_process_asked(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom torch import nn\nbatch_size = 4\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 256)\n"
    )
    est = estimate_memory(lambda: nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)),
                          lambda b: torch.zeros(b, 256), batch_size=4, device="cuda", emulate=True)  # fmt: skip
    memory = 1200 * 10**6
    for process, said in (("warmed", "a warmed process's workspaces"), ("either", "fits a fresh and a warmed process"), (None, "")):
        asked = ["--process", process] if process else []  # the default: a fresh process, said by nothing
        assert main(["estimate", str(path), "--device", "cuda", "--memory", "1200MB", "--margin", "0", *asked]) == 0
        out = capsys.readouterr().out
        expected = est.batch_search(memory, margin=0, process=process or "fresh").batch_size
        assert f"Largest batch on a device of 1,200 MB: {expected} (" in out and said in out
        assert process or "process" not in out
    with pytest.raises(SystemExit):
        main(["estimate", str(path), "--device", "cuda", "--memory", "1200MB", "--process", "cold"])


def test_the_peak_counts_the_allocator_s_whole_blocks():
    """An 11 MiB weight takes a new 12 MiB segment (a request of 10 MiB or more: its size rounded up
    to 2 MiB), and the 1 MiB left is not split off (the large pool splits only where more than 1 MiB
    would remain): ``torch.cuda.memory_allocated()`` counts the whole 12 MiB. So does its gradient's
    block. At the backward's peak, weight and gradient alive, the peak is the requests' plus 2 MiB,
    counted in ``other`` beside the rest, and the breakdown still sums to the peak; on the CPU,
    which has no such allocator, nothing is added. (On the GPU: ``tests/test_estimate_cuda.py``.)"""
    build = lambda: nn.Linear(1408, 2048, bias=False)  # noqa: E731 - 1,408 x 2,048 x 4 B = 11 MiB
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    assert 1408 * 2048 * 4 == 11 * MIB
    est = estimate_memory(build, torch.zeros(8, 1408), optimizer=sgd, device="cuda", emulate=True, fit=False)
    assert est.peak_phase == "backward"
    assert est.whole_blocks == 2 * MIB
    assert sum(est.peak_breakdown.values()) == est.peak
    assert est.peak_breakdown["weights"] == est.peak_breakdown["gradients"] == 11 * MIB
    assert max(est.phases.values()) == est.peak
    assert "(of other: the allocator's blocks beyond the requests)" in str(est)
    on_cpu = estimate_memory(build, torch.zeros(8, 1408), optimizer=sgd, device="cpu", fit=False)
    assert on_cpu.whole_blocks == 0


def test_whole_blocks_after_each_event_follow_the_allocator_s_rules():
    """``replay_whole_blocks``: 1 MiB of a request up to 1 MiB less than its block stays in it (large
    pool), 512 bytes split off in the small pool; the workspaces' blocks are left out."""
    from pytorch_mem_profiler.estimate.allocator import replay_whole_blocks

    events = [(1, 11 * MIB), (2, 19 * MIB), (3, 700), (2, -19 * MIB), (4, 18 * MIB)]
    reserved, whole = replay_whole_blocks([(-1, 32 * MIB)], events, at=[1, 2, 3, 4, 5])
    assert whole[1] == 12 * MIB  # a new 12 MiB segment, 1 MiB not split off
    assert whole[2] == 12 * MIB + 20 * MIB  # 19 MiB: a new 20 MiB segment, 1 MiB not split off either
    assert whole[3] == whole[2] + 1024  # 700 B: a 1,024 B block of the small pool's 2 MiB segment
    assert whole[4] == 12 * MIB + 1024
    assert whole[5] == 12 * MIB + 1024 + 18 * MIB  # 18 MiB from the free 20 MiB block: the 2 MiB left is split off
    assert reserved == 32 * MIB + 12 * MIB + 20 * MIB + 2 * MIB
