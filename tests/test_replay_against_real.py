"""``benchmarks/replay_against_real.py`` on a CPU: its snapshot parsing and its comparison, on synthetic
snapshots written the way torch's allocator history writes them (made here from a recorded replay,
so every figure is known), and the replay's own rules on hand-made streams."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import replay_against_real as rar  # noqa: E402

from pytorch_mem_profiler.estimate.allocator import AllocatorReplay, StepEvents, block_size, segment_size  # noqa: E402

MIB = 1 << 20
#: the libraries' workspaces before the model: two 32 MiB blocks, a segment each (as cuBLAS's on Hopper)
WORKSPACES = ((-1, 32 * MIB), (-2, 32 * MIB))
BASE_ADDRESSES = (0x7F00_0000_0000, 0x7F00_0200_0000)


def _frames(name: str) -> list[dict]:
    return [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 10, "name": name},
            {"filename": "/x/train.py", "line": 3, "name": "step"}]  # fmt: skip


def _step(batch_mib: int, extra: dict[str, list[tuple[int, int]]] | None = None) -> StepEvents:
    """Two steps of a toy model: weights (3 MiB, 600 KiB) before the steps; each step a forward
    that keeps two activations, a loss, a backward with a gradient per weight and a temporary, an
    optimizer step that makes momentum once. ``extra``: more (key, bytes) events at a phase's start."""
    events: list[tuple[int, int]] = [(0, 3 * MIB), (1, 600 << 10), (2, batch_mib * MIB)]  # weights, the batch
    marks = []
    sources = {0: "adopted before the step; other; weights", 1: "adopted before the step; other; weights", 2: "aten.randn; other; inputs"}
    key = 10
    for step in (1, 2):
        def mark(phase: str) -> None:
            marks.append((len(events), step, phase))
            for k, n in (extra or {}).get(f"step {step} {phase}", []):
                events.append((k, n))

        mark("forward")
        a, b = key, key + 1
        events += [(a, batch_mib * MIB), (b, 2 * batch_mib * MIB)]
        sources[a], sources[b] = "aten.addmm.default; forward; activations", "aten.relu.default; forward; activations"
        mark("other")
        loss = key + 2
        events.append((loss, 4))
        mark("backward")
        g0, g1, tmp = key + 3, key + 4, key + 5
        events += [(tmp, 3 * batch_mib * MIB), (g0, 3 * MIB), (tmp, -3 * batch_mib * MIB), (b, -2 * batch_mib * MIB), (g1, 600 << 10), (a, -batch_mib * MIB)]
        sources[tmp] = "aten.mm.default; backward; activation_gradients"
        mark("optimizer")
        if step == 1:
            events += [(5, 3 * MIB), (6, 600 << 10)]  # momentum, kept
        mark("other")
        events += [(g0, -3 * MIB), (g1, -(600 << 10)), (loss, -4)]
        key += 10
    return StepEvents(tuple(events), tuple(marks), sources)


def _with_workspaces(events: StepEvents) -> StepEvents:
    return StepEvents(WORKSPACES, (), {k: "cuBLAS workspace; before the steps; workspace" for k, _ in WORKSPACES}) + events


def _base_segments() -> list[dict]:
    """The real run's segments before the model: the two workspaces, and a small segment holding
    a 1 MiB block (what a library kept) with its other MiB free."""
    segs = [{"device": 0, "address": a, "total_size": 32 * MIB, "segment_type": "large", "segment_pool_id": (0, 0),
             "blocks": [{"size": 32 * MIB, "requested_size": 32 * MIB, "state": "active_allocated", "address": a}]}
            for a in BASE_ADDRESSES]  # fmt: skip
    segs.append({"device": 0, "address": 0x7F00_0400_0000, "total_size": 2 * MIB, "segment_type": "small", "segment_pool_id": (0, 0),
                 "blocks": [{"size": MIB, "state": "active_allocated"}, {"size": MIB, "state": "inactive"}]})  # fmt: skip
    return segs


def _recorded(events: StepEvents, base: list[dict], *, limit: int | None = None, names: dict[int, str] | None = None):
    """A snapshot, its base and its phase marks as ``real_run`` returns them, made by replaying
    ``events`` (from ``base``) and writing down what the replay did as torch's history does (a
    workspace of ``events.fallback`` refused: an ``oom`` entry, the run going on)."""
    replay = AllocatorReplay(limit=limit, record=True, fallback=events.fallback)
    for address, size, small, blocks in rar.parse_base(base):
        replay.add_segment(size, blocks, small=small, address=address)
    replay.run(events.events)
    requested = dict(enumerate(n for _, n in events.events))
    trace, allocs, frees = [], 0, 0
    counts_at: dict[int, tuple[int, int]] = {}
    for entry in replay.trace:
        if entry.index < 0:
            continue
        counts_at.setdefault(entry.index, (allocs, frees))
        if entry.action == "segment_alloc":
            trace.append({"action": "segment_alloc", "addr": entry.address, "size": entry.size, "stream": 0, "frames": []})
        elif entry.action == "alloc":
            name = (names or {}).get(entry.key, "linear")
            trace.append({"action": "alloc", "addr": entry.address, "size": requested[entry.index], "stream": 0, "frames": _frames(name)})
            allocs += 1
        elif entry.action == "free":
            size = -requested[entry.index]
            trace.append({"action": "free_requested", "addr": entry.address, "size": size, "stream": 0, "frames": []})
            trace.append({"action": "free_completed", "addr": entry.address, "size": size, "stream": 0, "frames": []})
            frees += 1
        elif entry.action == "segment_free":
            trace.append({"action": "segment_free", "addr": entry.address, "size": entry.size, "stream": 0, "frames": []})
        elif entry.action in ("oom", "fallback"):
            trace.append({"action": "oom", "size": block_size(entry.size), "device_free": 0, "stream": 0, "frames": _frames("linear")})
    ran = replay.oom[0] if replay.oom else len(events.events)
    stats = lambda a, f: {"allocation.all.allocated": 100 + a, "allocation.all.freed": 50 + f}  # noqa: E731
    marks = [{"step": 0, "phase": "before", **stats(0, 0)}]
    for index, step, phase in events.marks:
        if index > ran:
            break
        a, f = counts_at.get(index, (allocs, frees))
        marks.append({"step": step, "phase": phase, **stats(a, f)})
    snapshot = {"segments": [], "device_traces": [trace]}
    return snapshot, stats(0, 0), marks, (allocs, frees)


def _compare(real_events: StepEvents, estimate_events: StepEvents, *, limit: int | None = None, names=None):
    base = _base_segments()
    snapshot, start, marks, counts = _recorded(real_events, base, limit=limit, names=names)
    trace = rar.parse_real(snapshot, base, counts=counts)
    phases = rar.real_phases(trace, marks, start)
    return trace, phases, rar.compare(trace, phases, _with_workspaces(estimate_events), limit)


def test_a_real_run_that_is_the_estimates_step_parts_nowhere():
    step = _step(4)
    trace, phases, result = _compare(step, step)
    assert not trace.truncated
    assert trace.base_reserved == 66 * MIB and trace.base_allocated == 65 * MIB and trace.base_segments == 3
    assert [p.label for p in phases] == ["step 0 before"] + [
        f"step {s} {p}" for s in (1, 2) for p in ("forward", "other", "backward", "optimizer", "other #2")
    ]
    allocations = sum(1 for _, n in step.events if n > 0)
    for name in ("estimate", "estimate on the real base"):
        part = result[name]
        assert part["paired"] == allocations, name
        assert part["real_only"] == [] and part["replay_only"] == [], name
        assert part["first"]["requests"] is None, name
    # from the same base the replay is the real run, segment by segment
    on_base = result["estimate on the real base"]["first"]
    assert on_base["segment"] is None and on_base["reserved"] is None
    assert result["estimate on the real base"]["peak_reserved_above_base"] == result["real"]["peak_reserved_above_base"]
    # from its own base (the two workspaces only) the 600 KiB weight takes a 2 MiB segment of its own,
    # where the real allocator put it in the free MiB of the small segment its base held
    first = result["estimate"]["first"]["segment"]
    assert first["real"]["allocation"] == first["estimate"]["allocation"] == 1
    assert first["real"]["size"] == block_size(600 << 10)
    assert (first["real"]["made_segment"], first["estimate"]["made_segment"]) == (False, True)
    assert first["estimate"]["reserved_above_base"] - first["real"]["reserved_above_base"] == 2 * MIB
    assert [check["exact"] for check in result["rules"]] == [True, True]
    # phase by phase, the replay from the real base is the real run: allocations, bytes, peaks, segments
    assert all(row[1] == row[3] for row in result["phases"]), result["phases"]


def test_the_phase_table_counts_allocations_bytes_and_segments_per_phase():
    step = _step(4)
    _, _, result = _compare(step, step)
    rows = {row[0]: [cell.split(" / ") for cell in row[1:]] for row in result["phases"]}
    real = {label: cells[0] for label, cells in rows.items()}
    # before the steps: the 3 MiB weight takes a 20 MiB segment (under 10 MiB: kLargeBuffer), the
    # 600 KiB one the base's small segment's free MiB, the 4 MiB batch the 17 MiB left of the first
    assert segment_size(3 * MIB) == 20 * MIB
    assert real["step 0 before"] == [f"{3:,}", f"{3 * MIB + block_size(600 << 10) + 4 * MIB:,}", f"{3 * MIB + block_size(600 << 10) + 4 * MIB:,}", f"{20 * MIB:,}", "+1 -0"]
    # the forward's 4 and 8 MiB take the 13 MiB left: the 1 MiB after the 8 is not split off (large pool: only more than 1 MiB)
    assert real["step 1 forward"][:2] == ["2", f"{12 * MIB:,}"] and real["step 1 forward"][4] == "+0 -0"
    # the first backward: the 12 MiB temporary a segment of its size, the 3 MiB gradient a new 20 MiB one,
    # the 600 KiB one a new small segment (the base's small one is full)
    assert real["step 1 backward"][0] == "3" and real["step 1 backward"][4] == "+3 -0"
    assert real["step 1 backward"][3] == f"{20 * MIB + 12 * MIB + 20 * MIB + 2 * MIB:,}"
    # the second step reuses what the first freed: no new segment
    assert all(real[f"step 2 {p}"][4] == "+0 -0" for p in ("forward", "other", "backward"))
    # per step: the first's 8 allocations (2 + the loss + 3 + momentum's 2) and 3 segments; its peak reserved the backward's
    assert real["step 1 (all)"][0] == "8" and real["step 1 (all)"][4] == "+3 -0"
    assert real["step 1 (all)"][3] == real["step 1 backward"][3]
    assert real["step 2 (all)"][0] == "6" and real["step 2 (all)"][4] == "+0 -0"
    assert list(rows)[:3] == ["step 0 (all)", "step 1 (all)", "step 2 (all)"]


def test_a_real_allocation_the_estimate_does_not_make_is_listed_by_size_and_frames():
    step = _step(4)
    # the real backward takes a library's 6 MiB workspace at its start and gives it back at once
    real = _step(4, extra={"step 1 backward": [(900, 6 * MIB), (900, -6 * MIB)], "step 2 backward": [(901, 6 * MIB), (901, -6 * MIB)]})
    trace, _, result = _compare(real, step, names={900: "cudnn_workspace", 901: "cudnn_workspace"})
    part = result["estimate on the real base"]
    assert part["real_only"] == [{
        "size": 6 * MIB, "from": "torch/nn/functional.py:10(cudnn_workspace) < /x/train.py:3(step)", "count": 2, "bytes": 12 * MIB,
        "transient": 2, "phases": ["step 1 backward", "step 2 backward"],
    }]  # fmt: skip
    assert part["replay_only"] == []
    first = part["first"]["requests"]
    assert first["phase"] == "step 1 backward" and first["real_count"] == 1 and first["estimate on the real base_count"] == 0
    assert first["real"][0]["size"] == 6 * MIB and "cudnn_workspace" in first["real"][0]["from"]
    # the rules replay the real requests exactly: the difference is the estimate's requests
    assert all(check["exact"] for check in result["rules"])


def test_an_estimate_allocation_the_real_run_does_not_make_is_listed_by_its_operator():
    real = _step(4)
    est = _step(4, extra={"step 1 forward": [(950, 5 * MIB), (950, -5 * MIB)]})
    est.sources[950] = "aten.sum.dim_IntList; forward; scratch"  # type: ignore[index]
    _, _, result = _compare(real, est)
    only = result["estimate on the real base"]["replay_only"]
    assert only == [{"size": 5 * MIB, "from": "aten.sum.dim_IntList; forward; scratch", "count": 1, "bytes": 5 * MIB,
                     "transient": 1, "phases": ["step 1 forward"]}]  # fmt: skip


def test_under_a_limit_the_real_run_out_of_memory_is_placed_and_the_estimate_that_fits_is_told_apart():
    # both make and drop a 15 MiB temporary in the forward: a segment of its own, wholly free after
    scratch = {"step 1 forward": [(800, 15 * MIB), (800, -15 * MIB)]}
    step = _step(4, extra=scratch)
    # a real temporary the estimate misses: 200 MiB at the first backward's start
    real = _step(4, extra={**scratch, "step 1 backward": [(900, 200 * MIB), (900, -200 * MIB)]})
    unlimited = AllocatorReplay().run(_with_workspaces(step).events).peak_reserved
    limit = 66 * MIB + (unlimited - 64 * MIB) + 20 * MIB  # the real base, the step, 20 MiB spare: not 200
    trace, phases, result = _compare(real, step, limit=limit)
    assert result["real"]["oom"]["phase"] == "step 1 backward" and result["real"]["oom"]["requested"] == 200 * MIB
    assert result["estimate on the real base"]["oom"] is None and result["estimate"]["oom"] is None
    # the real allocator gave back its wholly free segment (the temporary's 16 MiB) before it gave up,
    # and so does the rule check's replay
    assert result["real"]["releases"] == 1
    assert all(check["exact"] and check["real_oom"] and check["replay_oom"] for check in result["rules"])
    assert result["estimate on the real base"]["first"]["oom"] == {"real": result["real"]["oom"], "estimate on the real base": None}


def test_a_workspace_refused_where_the_run_went_on_is_no_out_of_memory_and_the_replays_do_without_it():
    # cuDNN asks 200 MiB for a workspace at the first backward's start; under the limit it is refused
    # (the history records an oom) and the run goes on with another plan
    scratch = {"step 1 backward": [(900, 200 * MIB), (900, -200 * MIB)]}
    plain = _step(4, extra=scratch)
    step = StepEvents(plain.events, plain.marks, plain.sources, fallback=frozenset({900}))
    unlimited = AllocatorReplay().run(_with_workspaces(_step(4)).events).peak_reserved
    limit = 66 * MIB + (unlimited - 64 * MIB) + 20 * MIB  # the real base, the step, 20 MiB spare: not 200
    trace, phases, result = _compare(step, step, limit=limit)
    assert len(trace.refused) == 1 and trace.refused_keys  # the refused request, keyed for the rule check
    assert result["real"]["oom"] is None
    assert result["estimate"]["oom"] is None and result["estimate on the real base"]["oom"] is None
    assert all(check["exact"] and not check["real_oom"] and check["real_refused"] == 1 for check in result["rules"])
    # without the fallback the estimate runs out where the real run refused the workspace
    _, _, strict = _compare(step, plain, limit=limit)
    assert strict["estimate on the real base"]["oom"]["requested"] == 200 * MIB


def test_the_rule_check_finds_where_a_real_allocator_parts_from_the_rules():
    step = _step(4)
    base = _base_segments()
    snapshot, start, marks, counts = _recorded(step, base)
    entries = snapshot["device_traces"][0]
    # as if the real allocator had made a new segment for the step's 3 MiB weight instead of ... it did:
    # make it take a 4 MiB block of a 20 MiB segment split differently: drop its segment_alloc
    first_alloc = next(i for i, e in enumerate(entries) if e["action"] == "alloc")
    assert entries[first_alloc - 1]["action"] == "segment_alloc"
    del entries[first_alloc - 1]
    trace = rar.parse_real(snapshot, base, counts=counts)
    check = rar.rule_check(trace, None)
    assert not check["exact"]
    assert check["first_difference"]["allocation"] == 0
    assert "segment made: real False, replay True" in check["first_difference"]["what"]


def test_a_trace_that_lost_its_first_entries_is_flagged():
    step = _step(4)
    base = _base_segments()
    snapshot, start, marks, counts = _recorded(step, base)
    assert not rar.parse_real(snapshot, base, counts=counts).truncated
    snapshot["device_traces"][0] = snapshot["device_traces"][0][5:]
    assert rar.parse_real(snapshot, base, counts=counts).truncated


def test_the_base_is_read_from_the_snapshot_segments_with_their_blocks():
    segs = _base_segments() + [
        {"device": 1, "address": 1, "total_size": 2 * MIB, "segment_type": "small", "blocks": []},  # another device
        {"device": 0, "address": 5, "total_size": 2 * MIB, "segment_type": "small", "segment_pool_id": (1, 0), "blocks": []},  # a graph's pool
    ]
    base = rar.parse_base(segs)
    assert [(a, size, small) for a, size, small, _ in base] == [
        (BASE_ADDRESSES[0], 32 * MIB, False), (BASE_ADDRESSES[1], 32 * MIB, False), (0x7F00_0400_0000, 2 * MIB, True)
    ]  # fmt: skip
    assert base[2][3] == [(MIB, -(0x7F00_0400_0000 + 1)), (MIB, None)]
    # a base block freed during the run is matched by its address
    snapshot = {"device_traces": [[
        {"action": "free_requested", "addr": 0x7F00_0400_0000, "size": MIB},
        {"action": "free_completed", "addr": 0x7F00_0400_0000, "size": MIB},
    ]]}  # fmt: skip
    trace = rar.parse_real(snapshot, _base_segments())
    assert trace.events == [(-(0x7F00_0400_0000 + 1), -MIB)] and trace.allocated[-1] == 64 * MIB


def test_the_base_report_lists_the_blocks_held_before_the_model_with_their_frames():
    segs = _base_segments()
    segs[2]["blocks"][0]["frames"] = [{"filename": "/x/site-packages/torch/nn/modules/rnn.py", "line": 1126, "name": "forward"}]
    segs[2]["blocks"][0]["requested_size"] = 1_000_000
    report = rar.base_report(segs)
    assert [(b["size"], b["requested"], b["segment"], b["pool"]) for b in report] == [
        (32 * MIB, 32 * MIB, 32 * MIB, "large"), (32 * MIB, 32 * MIB, 32 * MIB, "large"), (MIB, 1_000_000, 2 * MIB, "small")
    ]  # fmt: skip
    assert report[2]["from"] == "torch/nn/modules/rnn.py:1126(forward)"


def test_phases_are_placed_by_the_allocators_counts_with_a_frees_completion_kept_with_it():
    entries = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MIB},
        {"action": "alloc", "addr": 0, "size": 100},
        {"action": "free_requested", "addr": 0, "size": 100},
        {"action": "free_completed", "addr": 0, "size": 100},
        {"action": "alloc", "addr": 512, "size": 100},
    ]
    trace = rar.parse_real({"device_traces": [entries]}, [])
    start = {"allocation.all.allocated": 7, "allocation.all.freed": 3}
    marks = [{"step": 1, "phase": "forward", **start},
             {"step": 1, "phase": "backward", "allocation.all.allocated": 8, "allocation.all.freed": 4}]  # fmt: skip
    phases = rar.real_phases(trace, marks, start)
    assert [(p.label, p.start, p.end) for p in phases] == [("step 1 forward", 0, 4), ("step 1 backward", 4, 5)]


def test_frames_are_shown_innermost_first_and_paths_cut():
    frames = [{"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
              {"filename": str(rar.ROOT / "benchmarks" / "zoo" / "training.py"), "line": 140, "name": "step"}]  # fmt: skip
    assert rar.frames_text(frames) == "torch/nn/modules/linear.py:125(forward) < benchmarks/zoo/training.py:140(step)"
    assert rar.frames_text([]) == "(no frames recorded)"


def test_cpp_frames_of_the_recording_and_the_allocator_are_left_out():
    # with --stacks all every allocation begins with the same frames of the history's own recording
    recording = [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
                 {"filename": "??", "line": 0, "name": "torch::CapturedTraceback::gather(bool, bool, bool)"},
                 {"filename": "memory_snapshot.cpp", "line": 0, "name": "torch::cuda::(anonymous namespace)::gather_with_cpp()"},
                 {"filename": "CUDACachingAllocator.cpp", "line": 0,
                  "name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)"}]  # fmt: skip
    kernel = {"filename": "Conv_v8.cpp", "line": 0, "name": "at::native::run_single_conv(...)"}
    assert rar.frames_text(recording + [kernel], most=2) == "Conv_v8.cpp:0(at::native::run_single_conv(...))"


def test_the_frames_every_allocation_passes_are_left_out_and_the_models_line_follows():
    # --stacks all: the empty-tensor factories and the dispatcher's wrappers say nothing of who asked;
    # the innermost Python frame (the model's line) is shown after the kernel's frames
    generic = [{"filename": "??", "line": 0, "name": "at::detail::empty_strided_generic(c10::ArrayRef<long>)"},
               {"filename": "??", "line": 0, "name": "at::native::empty_strided_cuda(c10::ArrayRef<long>)"},
               {"filename": "RegisterCUDA_0.cpp", "line": 0, "name": "c10::impl::wrap_kernel_functor_unboxed_<...>::call()"},
               {"filename": "??", "line": 0, "name": "at::_ops::empty_strided::redispatch()"}]  # fmt: skip
    kernel = [{"filename": "??", "line": 0, "name": "at::native::batch_norm_backward_cuda(...)"},
              {"filename": "??", "line": 0, "name": "torch::autograd::generated::NativeBatchNormBackward0::apply()"},
              {"filename": "??", "line": 0, "name": "torch::autograd::Engine::evaluate_function()"}]  # fmt: skip
    model = [{"filename": "/x/site-packages/torch/autograd/graph.py", "line": 829, "name": "_engine_run_backward"},
             {"filename": "/x/train.py", "line": 3, "name": "step"}]  # fmt: skip
    assert rar.frames_text(generic + kernel + model, most=2) == (
        "??:0(at::native::batch_norm_backward_cuda(...)) < ??:0(torch::autograd::generated::NativeBatchNormBackward0::apply())"
        " < ... torch/autograd/graph.py:829(_engine_run_backward)"
    )
    # a Python frame among those shown: nothing follows
    assert rar.frames_text(generic + model, most=2) == "torch/autograd/graph.py:829(_engine_run_backward) < /x/train.py:3(step)"


def test_the_report_names_each_point_with_its_figures(tmp_path):
    step = _step(4)
    real = _step(4, extra={"step 1 backward": [(900, 6 * MIB), (900, -6 * MIB)]})
    _, _, result = _compare(real, step, names={900: "cudnn_workspace"})
    payload = {"environment": "Device: test", "rows": [{"name": "toy", "batch": 4, "card": 2**30,
               "estimate": {"peak": 1, "workspace": 2, "reserved": 3, "error_bound": 0}, "runs": {"no limit": result}}]}  # fmt: skip
    text = rar.render(payload)
    assert "## toy at batch 4, card 1 GiB" in text
    assert "rule check (real requests replayed, addresses real): exact" in text
    assert f"| {6 * MIB:,} | 1 | {6 * MIB:,} | 1 | step 1 backward | torch/nn/functional.py:10(cudnn_workspace)" in text
    assert "- first requests: phase: step 1 backward; real: allocation 6, phase step 1 backward, size 6,291,456" in text


@pytest.mark.parametrize("batch_mib", [1, 4, 9, 30])
def test_a_real_run_of_the_same_step_pairs_every_allocation_at_any_size(batch_mib):
    step = _step(batch_mib)
    _, _, result = _compare(step, step)
    part = result["estimate on the real base"]
    assert part["paired"] == sum(1 for _, n in step.events if n > 0)
    assert part["first"]["reserved"] is None and part["first"]["segment"] is None


def test_any_registry_s_model_can_be_compared_and_the_zoo_s_name_wins():
    from benchmarks.zoo import registries

    known = rar.models()
    everything = registries()
    assert known["googlenet"] is everything["holdout_vision"]["googlenet"]
    assert known["electra"] is everything["holdout_text"]["electra"]
    for name, entry in everything["zoo"].items():
        assert known[name] is entry
    assert set(known) == {name for registry in everything.values() for name in registry}
