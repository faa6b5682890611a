"""The estimate's allocator replay against the real CUDA caching allocator, allocation by allocation.

    PYTHONPATH=. python3 benchmarks/replay_against_real.py --out $OUT      # six zoo models, about 4 minutes on an H200
    PYTHONPATH=. python3 benchmarks/replay_against_real.py --only neumf --batch 329065 --card-gib 2.25 --out $OUT
    PYTHONPATH=. python3 benchmarks/replay_against_real.py --only vit --batch predicted --out $OUT  # the estimate's answer now
    PYTHONPATH=. python3 benchmarks/replay_against_real.py --only googlenet --batch 64 --card-gib 8 --out $OUT  # a held-back model

Per model of the zoo or a held-back set (``benchmarks/zoo``) at a batch (by default the largest batch
the estimate predicted under the card of the conformance run, where the real run ran out of memory:
:data:`CASES`), twice:
without a limit, and under ``torch.cuda.set_per_process_memory_fraction`` of the card:

- **the real run**, as ``benchmarks/zoo_conformance.py`` measures it: a warm-up step at its
  ``WARM_BATCH`` (two: a BatchNorm after global pooling refuses one in training; the libraries'
  workspaces stay), the cache emptied, then a freshly built model's two training steps,
  with the allocator's history recorded (``torch.cuda.memory._record_memory_history``,
  ``--max-entries``, Python stacks) from before the model; ``memory_stats()`` read at each phase's
  start (its allocation and free counts place the phase in the trace); ``torch.cuda.memory._snapshot()``
  at the end, or after catching the ``OutOfMemoryError`` (the trace then holds the segments given back
  and the request that failed);
- **the estimate** at that batch (``estimate_memory(..., fit=False)`` on fake CUDA tensors) and its
  replay (:class:`~pytorch_mem_profiler.estimate.allocator.AllocatorReplay`) of its two steps'
  allocations and frees (``estimate.step_events``), with and without the limit, every action
  recorded; and the same events replayed from the real run's own segments before the model (its base:
  the libraries' workspaces), so that the base's share of a difference shows apart;
- **the rule check**: the real run's own requests replayed through the same rules, from its base and
  with its segments' addresses. Where this replay parts from the real allocator, the replay's *rules*
  differ from the allocator's; where only the estimate's replay does, the estimate's *requests* do.

Written into ``--out`` (default ``$OUT``): ``replay_against_real.json`` (everything, bytes) and
``replay_against_real.md``: per model and limit, the first points where the real allocator and each
replay part (the request sizes; a segment made by one and not the other; the reserved bytes above the
base; the first segments given back; the out-of-memory), a table per step and phase (allocations,
bytes, peak allocated and reserved, segments made and given back), the real allocations the estimate
does not make grouped by size and by the Python frames the history recorded, and the estimate's
allocations the real run does not make, by the operator that made them. ``--snapshots`` also writes
each real run's snapshot as a pickle (for https://pytorch.org/memory_viz).

The parsing and the comparison (everything below :func:`real_run`) take plain snapshot dicts and
run on a CPU: ``tests/test_replay_against_real.py`` checks them on synthetic snapshots.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchutil import environment_line, markdown_table, output_dir  # noqa: E402

from pytorch_mem_profiler.estimate.allocator import AllocatorReplay, StepEvents, block_size  # noqa: E402

#: model -> (batch, card in GiB): the largest batch the estimate predicted under the conformance
#: run's card (``benchmarks/zoo_conformance.py``) on an H200, torch 2.11, where the real run ran out
#: of memory (its real largest batch in the comment).
CASES: dict[str, tuple[int, float]] = {
    "vit": (152, 5.5),  # 151
    "neumf": (329_065, 2.25),  # 315,695
    "gru_lm": (97, 3.0),  # 89
    "mobilenet": (331, 7.25),  # 329
    "sparse_recommender": (46_332, 6.5),  # 43,435
    "compiled_mlp": (139, 12.5),  # 138
}

#: Phases in the order a training step runs them (the estimate's names: ``other`` is the loss, and
#: again ``zero_grad`` with the output and the loss dropped).
STEP_PHASES = ("forward", "other", "backward", "optimizer", "other")
#: Of the frames the history recorded, how many of the innermost are shown per allocation.
FRAMES_SHOWN = 4
#: Above this many allocations in a phase, its two sides are aligned by their common prefix only.
ALIGN_MOST = 20_000


# =====================================================================================
# the real run (GPU)
# =====================================================================================
def fresh(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


_COUNTS = (
    "allocation.all.allocated", "allocation.all.freed", "segment.all.allocated", "segment.all.freed",
    "allocated_bytes.all.current", "reserved_bytes.all.current", "allocated_bytes.all.peak",
    "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms",
)  # fmt: skip


def _stats(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {key: int(stats.get(key, 0)) for key in _COUNTS}


def real_run(entry: Any, batch: int, device: torch.device, *, limit_fraction: float | None, max_entries: int,
             stacks: str = "python") -> dict[str, Any]:  # fmt: skip
    """Two training steps of ``entry`` at ``batch`` recorded: ``{"base", "snapshot", "marks", "start", "oom", ...}``.

    Under ``limit_fraction`` the whole run (warm-up included) is under the limit, as the
    conformance run's is; an ``OutOfMemoryError`` ends it, and the snapshot is taken after it.
    """
    from benchmarks.zoo.training import Training, call, draws_as_estimated
    from zoo_conformance import WARM_BATCH

    from pytorch_mem_profiler.measure.allocator import history

    total = torch.cuda.mem_get_info(device)[1]
    if limit_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(limit_fraction, device)
    out: dict[str, Any] = {"limit": int(limit_fraction * total) if limit_fraction is not None else None, "oom": None}
    run = None
    try:
        # the warm-up is recorded too, so that the blocks it leaves (the base: the libraries'
        # workspaces) carry the frames that made them; stopping clears that history
        history.start(max_entries=max_entries, stacks=stacks)
        try:
            warm = Training(entry, "real", device, min(WARM_BATCH, batch))
            warm.step()
            del warm
            fresh(device)
            out["base"] = history.snapshot()["segments"]
        finally:
            history.stop()
        history.start(max_entries=max_entries, stacks=stacks)
        try:
            out["start"] = _stats(device)
            marks: list[dict[str, Any]] = []

            def mark(step: int, phase: str) -> None:
                marks.append({"step": step, "phase": phase, **_stats(device)})

            def steps(run: Training) -> None:
                """Training.step twice, a mark at each phase's start (in a function: what a step
                holds is dropped when it returns or raises)."""
                dtype = entry.autocast
                for step in (1, 2):
                    mark(step, "forward")
                    with draws_as_estimated(entry), torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                        output = call(run.model, run.inputs)
                    mark(step, "other")
                    loss = entry.loss(output, *run.targets)
                    mark(step, "backward")
                    loss.backward()
                    mark(step, "optimizer")
                    run.optimizer.step()
                    mark(step, "other")
                    run.optimizer.zero_grad(set_to_none=True)
                    del output, loss

            try:
                mark(0, "before")  # the model and the batch: the estimate's events before its steps
                run = Training(entry, "real", device, batch)
                run.make_batch()
                steps(run)
                torch.cuda.synchronize(device)
                mark(3, "end")
            except torch.cuda.OutOfMemoryError as err:
                out["oom"] = str(err).splitlines()[0][:300]
            out["marks"] = marks
            out["end"] = _stats(device)
            out["snapshot"] = history.snapshot()
        finally:
            history.stop()
    finally:
        del run
        if limit_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        fresh(device)
    return out


def estimate_events(entry: Any, batch: int, device: torch.device) -> tuple[Any, StepEvents]:
    """The estimate at ``batch`` on fake CUDA tensors, and the events its replay takes."""
    from pytorch_mem_profiler import estimate_memory

    est = estimate_memory(**entry.estimate_kwargs("real"), batch_size=batch, device=device, fit=False)
    if est.step_events is None:
        raise RuntimeError("the estimate has no allocator events (not a CUDA estimate?)")
    return est, est.step_events


# =====================================================================================
# parsing a snapshot (plain dicts: runs on a CPU)
# =====================================================================================
@dataclass
class RealTrace:
    """One device's recorded history, made into what the comparison needs.

    Attributes:
        entries: the trace's entries (``alloc``, ``free_requested``, ``free_completed``,
            ``segment_alloc``, ``segment_free``, ``oom``; others dropped), in order.
        base_reserved, base_allocated, base_segments: the segments before the model (the run's base).
        reserved, allocated, segments: after each entry (``allocated`` in blocks, as
            ``memory_allocated()`` counts).
        events: the requests as the replay takes them, ``(key, +requested)`` at an ``alloc``,
            ``(key, -requested)`` at a ``free_completed``; ``event_entry[i]`` is the entry index of event ``i``.
        base_blocks: the base's segments as ``(address, bytes, small, [(block bytes, key or None)])``,
            each allocated block keyed (a negative key) so that its later free is matched.
        truncated: the trace lost its first entries (the ring buffer was full): counts do not add up.
        refused: the entry indices of ``oom`` requests the run went on after (cuDNN ran another plan
            without the workspace it was refused); the last ``oom`` of a run that ran out is not one.
    """

    entries: list[dict[str, Any]]
    base_reserved: int
    base_allocated: int
    base_segments: int
    reserved: list[int]
    allocated: list[int]
    segments: list[int]
    events: list[tuple[int, int]]
    event_entry: list[int]
    base_blocks: list[tuple[int, int, bool, list[tuple[int, int | None]]]]
    truncated: bool = False
    refused: frozenset[int] = frozenset()

    @property
    def refused_keys(self) -> frozenset[int]:
        """The replay's keys of the :attr:`refused` requests (for ``AllocatorReplay(fallback=...)``)."""
        return frozenset(self.events[n][0] for n, i in enumerate(self.event_entry) if i in self.refused and self.events[n][1] > 0)


_KEPT_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}


def device_trace(snapshot: Mapping[str, Any], device: int = 0) -> list[dict[str, Any]]:
    """The device's trace entries from a ``torch.cuda.memory._snapshot()`` dict."""
    traces = snapshot.get("device_traces") or []
    return list(traces[device]) if device < len(traces) else []


def parse_base(segments: Iterable[Mapping[str, Any]], device: int = 0) -> list[tuple[int, int, bool, list[tuple[int, int | None]]]]:
    """A snapshot's segments (of ``device``, the default pool) as the replay's preloaded segments:
    ``(address, bytes, small, [(block bytes, key or None if free)])``, allocated blocks keyed by
    ``-(address + 1)`` (a block freed later in the trace is matched by its address)."""
    out = []
    for seg in segments:
        if int(seg.get("device", device)) != device or tuple(seg.get("segment_pool_id", (0, 0)) or (0, 0)) != (0, 0):
            continue
        address = int(seg["address"])
        blocks = []
        at = address
        for block in seg.get("blocks", []):
            size = int(block["size"])
            held = block.get("state", "active_allocated") != "inactive"
            blocks.append((size, -(at + 1) if held else None))
            at += size
        if not blocks:
            blocks = [(int(seg["total_size"]), None)]
        out.append((address, int(seg["total_size"]), seg.get("segment_type") == "small", blocks))
    return sorted(out)


def parse_real(snapshot: Mapping[str, Any], base_segments: Iterable[Mapping[str, Any]], *, device: int = 0,
               counts: tuple[int, int] | None = None) -> RealTrace:  # fmt: skip
    """The history of ``snapshot`` from the base ``base_segments`` (the segments when recording began).

    ``counts``: the allocations and frees the allocator's statistics counted over the recording, to
    tell whether the ring buffer dropped entries.
    """
    base = parse_base(base_segments, device)
    reserved = sum(size for _, size, _, _ in base)
    allocated = sum(n for _, _, _, blocks in base for n, key in blocks if key is not None)
    segments = len(base)
    entries = [e for e in device_trace(snapshot, device) if e.get("action") in _KEPT_ACTIONS]
    trace = RealTrace(entries, reserved, allocated, segments, [], [], [], [], [], base)
    # blocks of the base are keyed by their address: a free of one in the trace is matched
    live: dict[int, int] = {-(key + 1): key for _, _, _, blocks in base for _, key in blocks if key is not None}
    next_key = 0
    allocs = frees = 0
    for i, e in enumerate(entries):
        action, size = e["action"], int(e.get("size", 0))
        addr = int(e.get("addr", 0) or 0)
        if action == "segment_alloc":
            reserved += size
            segments += 1
        elif action == "segment_free":
            reserved -= size
            segments -= 1
        elif action == "alloc":
            allocs += 1
            allocated += block_size(size)
            live[addr] = next_key
            trace.events.append((next_key, size))
            trace.event_entry.append(i)
            next_key += 1
        elif action == "free_requested":
            frees += 1
        elif action == "oom":  # the request that failed: made no block, but the replay must meet it too
            trace.events.append((next_key, max(size, 1)))
            trace.event_entry.append(i)
            next_key += 1
        elif action == "free_completed":
            allocated -= block_size(size)
            key = live.pop(addr, None)
            if key is not None:
                trace.events.append((key, -max(size, 1)))
                trace.event_entry.append(i)
        trace.reserved.append(reserved)
        trace.allocated.append(allocated)
        trace.segments.append(segments)
    if counts is not None:  # fewer than the statistics counted: the ring buffer dropped the first entries
        trace.truncated = allocs < counts[0] or frees < counts[1]
    # an out-of-memory the run went on after: a workspace refused and done without (cuDNN's next plan)
    last_alloc = max((i for i, e in enumerate(entries) if e["action"] == "alloc"), default=-1)
    trace.refused = frozenset(i for i, e in enumerate(entries) if e["action"] == "oom" and i < last_alloc)
    return trace


def base_report(segments: Iterable[Mapping[str, Any]], device: int = 0) -> list[dict[str, Any]]:
    """The blocks held before the model (the warm-up's leftovers: the libraries' workspaces), each
    with its segment and the frames that made it, largest first."""
    out = []
    for seg in segments:
        if int(seg.get("device", device)) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state", "active_allocated") == "inactive":
                continue
            out.append({"size": int(block["size"]), "requested": int(block.get("requested_size", block["size"])),
                        "segment": int(seg["total_size"]), "pool": seg.get("segment_type", "?"),
                        "from": frames_text(block.get("frames"), most=6)})  # fmt: skip
    return sorted(out, key=lambda b: -b["size"])


@dataclass(frozen=True)
class Phase:
    """One phase of one step: where it starts among a run's entries (or events)."""

    label: str
    start: int
    end: int


def phase_labels(marks: Sequence[tuple[int, str]]) -> list[str]:
    """Labels for ``(step, phase)`` marks in order, a phase seen twice in a step numbered:
    ``["step 1 forward", "step 1 other", ..., "step 1 other #2"]``.

    Example::

        >>> phase_labels([(0, "model"), (1, "forward"), (1, "other"), (1, "other")])
        ['step 0 model', 'step 1 forward', 'step 1 other', 'step 1 other #2']
    """
    seen: Counter = Counter()
    out = []
    for step, phase in marks:
        seen[(step, phase)] += 1
        n = seen[(step, phase)]
        out.append(f"step {step} {phase}" + (f" #{n}" if n > 1 else ""))
    return out


def real_phases(trace: RealTrace, marks: Sequence[Mapping[str, Any]], start: Mapping[str, int]) -> list[Phase]:
    """The real run's phases among ``trace.entries``, placed by the allocation and free counts the
    allocator's statistics gave at each phase's start (``marks``, relative to ``start``)."""
    boundaries = []
    for m in marks:
        allocs = m["allocation.all.allocated"] - start["allocation.all.allocated"]
        frees = m["allocation.all.freed"] - start["allocation.all.freed"]
        boundaries.append((allocs, frees))
    positions = []
    allocs = frees = 0
    want = iter(boundaries)
    target = next(want, None)
    i = 0
    entries = trace.entries
    while target is not None:
        # the boundary: the first entry after the counts are reached (a free's completion, which
        # follows its request at once, stays with it)
        while i < len(entries) and (allocs < target[0] or frees < target[1]):
            action = entries[i]["action"]
            allocs += action == "alloc"
            frees += action == "free_requested"
            i += 1
        while i < len(entries) and entries[i]["action"] == "free_completed" and (allocs, frees) == target:
            i += 1
        positions.append(i)
        target = next(want, None)
    labels = phase_labels([(m["step"], m["phase"]) for m in marks])
    ends = positions[1:] + [len(entries)]
    return [Phase(label, s, e) for label, s, e in zip(labels, positions, ends)]


def estimate_phases(events: StepEvents) -> list[Phase]:
    """The estimate's phases among its events (``events.marks``), the events before them as step 0."""
    marks = [(0, 0, "before")] + [m for m in events.marks]
    labels = phase_labels([(step, phase) for _, step, phase in marks])
    starts = [m[0] for m in marks]
    ends = starts[1:] + [len(events.events)]
    return [Phase(label, s, e) for label, s, e in zip(labels, starts, ends) if e > s or label != "step 0 before"]


# =====================================================================================
# the comparison (runs on a CPU)
# =====================================================================================
#: C++ frames of the history's own recording and of the allocator (``--stacks all``): the same at every
#: allocation, so left out of what names one
RECORDING_FRAMES = ("torch::unwind::", "torch::CapturedTraceback::", "gather_with_cpp", "CUDACachingAllocator")

#: C++ frames every tensor allocation or dispatched call passes through (the empty-tensor factories,
#: the dispatcher's wrappers): left out too, so that what is shown names the kernel that asked
ALLOCATION_FRAMES = ("at::detail::empty", "at::native::empty", "at::empty", "at::cuda::empty", "c10::impl::", "c10::Dispatcher",
                     "at::_ops::", "c10::KernelFunction", "c10::BoxedKernel", "wrap_kernel_functor", "make_boxed_from_unboxed")


def _is_python(frame: Mapping[str, Any]) -> bool:
    return str(frame.get("filename", "")).endswith(".py")


def _frame_text(frame: Mapping[str, Any]) -> str:
    name = str(frame.get("filename", "?"))
    cut = name.rfind("site-packages/")
    name = name[cut + len("site-packages/") :] if cut >= 0 else name.replace(str(ROOT) + "/", "")
    return f"{name}:{frame.get('line', 0)}({frame.get('name', '?')})"


def frames_text(frames: Iterable[Mapping[str, Any]] | None, most: int = FRAMES_SHOWN) -> str:
    """The innermost ``most`` frames as ``file:line(name) < ...``, paths cut after ``site-packages/``,
    the recording's and the allocator's own C++ frames left out (:data:`RECORDING_FRAMES`), and the
    frames every allocation passes through (:data:`ALLOCATION_FRAMES`). Where C++ frames were
    recorded (``--stacks all``) and none of those shown is Python's, the innermost Python frame
    follows after ``...``: the model's line that called the kernel."""
    out: list[str] = []
    shown_python = False
    for frame in frames or ():
        name = str(frame.get("name", ""))
        if any(part in name for part in RECORDING_FRAMES) or any(part in name for part in ALLOCATION_FRAMES):
            continue
        if len(out) < most:
            out.append(_frame_text(frame))
            shown_python = shown_python or _is_python(frame)
        elif shown_python:
            break
        elif _is_python(frame):  # the innermost Python frame after the kernel's
            out.append("... " + _frame_text(frame))
            break
    return " < ".join(out) if out else "(no frames recorded)"


@dataclass
class Side:
    """One side of a comparison, allocation by allocation: the request's rounded size, whether a
    segment was made for it, the reserved and allocated bytes above the base after it, where it came from."""

    name: str
    sizes: list[int] = field(default_factory=list)
    made_segment: list[bool] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    phase: list[str] = field(default_factory=list)
    origin: list[str] = field(default_factory=list)
    #: per phase label: its figures (see :func:`_phase_row`)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    releases: list[dict[str, Any]] = field(default_factory=list)
    oom: dict[str, Any] | None = None
    freed_in_phase: list[bool] = field(default_factory=list)


def _empty_row() -> dict[str, int]:
    return {"allocations": 0, "bytes": 0, "frees": 0, "peak_allocated": 0, "peak_reserved": 0, "segments_made": 0,
            "segments_given_back": 0, "end_allocated": 0, "end_reserved": 0, "end_segments": 0}  # fmt: skip


def real_side(trace: RealTrace, phases: Sequence[Phase]) -> Side:
    """The real run as a :class:`Side`: reserved and allocated above its base."""
    side = Side("real")
    phase_of = [""] * len(trace.entries)
    for p in phases:
        for i in range(p.start, min(p.end, len(trace.entries))):
            phase_of[i] = p.label
    freed_at: dict[int, int] = {}
    alive_since: dict[int, int] = {}
    for i, e in enumerate(trace.entries):
        label = phase_of[i] or "step 0 before"
        row = side.phases.setdefault(label, _empty_row())
        reserved = trace.reserved[i] - trace.base_reserved
        allocated = trace.allocated[i] - trace.base_allocated
        action = e["action"]
        if action == "alloc":
            size = block_size(int(e["size"]))
            side.sizes.append(size)
            side.made_segment.append(i > 0 and trace.entries[i - 1]["action"] == "segment_alloc")
            side.reserved.append(reserved)
            side.segments.append(trace.segments[i] - trace.base_segments)
            side.phase.append(label)
            side.origin.append(frames_text(e.get("frames")))
            alive_since[int(e.get("addr", 0) or 0)] = len(side.sizes) - 1
            row["allocations"] += 1
            row["bytes"] += size
        elif action == "free_completed":
            row["frees"] += 1
            n = alive_since.pop(int(e.get("addr", 0) or 0), None)
            if n is not None:
                freed_at[n] = i
        elif action == "segment_alloc":
            row["segments_made"] += 1
        elif action == "segment_free":
            row["segments_given_back"] += 1
            side.releases.append({"phase": label, "allocation": len(side.sizes), "bytes": int(e.get("size", 0)), "reserved_after": reserved})
        elif action == "oom" and i not in trace.refused:
            side.oom = {"phase": label, "allocation": len(side.sizes), "requested": int(e.get("size", 0)),
                        "reserved": reserved, "from": frames_text(e.get("frames"))}  # fmt: skip
        if action in ("free_requested", "oom"):
            continue  # no change of state: a phase's figures are those after its changes, as the replay's
        row["peak_allocated"] = max(row["peak_allocated"], allocated)
        row["peak_reserved"] = max(row["peak_reserved"], reserved)
        row["end_allocated"], row["end_reserved"] = allocated, reserved
        row["end_segments"] = trace.segments[i] - trace.base_segments
    side.freed_in_phase = [n in freed_at and phase_of[freed_at[n]] == side.phase[n] for n in range(len(side.sizes))]
    return side


def replay_side(name: str, events: StepEvents, replay: AllocatorReplay, first_event: int = 0) -> Side:
    """A recorded replay of ``events`` as a :class:`Side`, above its base: what it did before
    event ``first_event`` (the workspaces' events) or before the events (preloaded segments)."""
    side = Side(name)
    phases = estimate_phases(events)
    phase_of: dict[int, str] = {}
    for p in phases:
        for i in range(p.start, p.end):
            phase_of[i] = p.label
    base = [e for e in replay.trace if e.index < first_event]
    base_reserved = base[-1].reserved if base else 0
    base_segments = sum(1 for e in base if e.action == "segment_alloc")
    born: dict[int, int] = {}
    asked: dict[int, int] = {}
    segments = base_segments
    allocated = 0  # above the base, in requests rounded to 512 bytes, as the real side counts from its trace
    pending_segment = False
    for entry in replay.trace[len(base):]:
        label = phase_of.get(entry.index, "step 0 before")
        row = side.phases.setdefault(label, _empty_row())
        reserved = entry.reserved - base_reserved
        if entry.action == "alloc":
            asked[entry.key] = block_size(entry.requested)  # type: ignore[index]
            allocated += asked[entry.key]  # type: ignore[index]
        elif entry.action == "free":
            allocated -= asked.pop(entry.key, 0)  # type: ignore[arg-type]
        if entry.action == "segment_alloc":
            segments += 1
            row["segments_made"] += 1
            pending_segment = True
        elif entry.action == "segment_free":
            segments -= 1
            row["segments_given_back"] += 1
            side.releases.append({"phase": label, "allocation": len(side.sizes), "bytes": entry.size, "reserved_after": reserved})
        elif entry.action == "alloc":
            side.sizes.append(block_size(entry.requested))
            side.made_segment.append(pending_segment)
            side.reserved.append(reserved)
            side.segments.append(segments - base_segments)
            side.phase.append(label)
            side.origin.append(events.sources.get(entry.key, "?") if entry.key is not None else "?")
            born[entry.key] = len(side.sizes) - 1  # type: ignore[index]
            row["allocations"] += 1
            row["bytes"] += side.sizes[-1]
            pending_segment = False
        elif entry.action == "free":
            row["frees"] += 1
        elif entry.action == "oom":
            side.oom = {"phase": label, "allocation": len(side.sizes), "requested": entry.requested, "reserved": reserved,
                        "from": events.sources.get(entry.key, "?") if entry.key is not None else "?"}  # fmt: skip
        row["peak_allocated"] = max(row["peak_allocated"], allocated)
        row["peak_reserved"] = max(row["peak_reserved"], reserved)
        row["end_allocated"], row["end_reserved"], row["end_segments"] = allocated, reserved, segments - base_segments
    died_in: dict[int, str] = {}
    for entry in replay.trace:
        if entry.action == "free" and entry.key in born:
            died_in[born[entry.key]] = phase_of.get(entry.index, "")
    side.freed_in_phase = [died_in.get(n) == side.phase[n] for n in range(len(side.sizes))]
    return side


def align(real: Side, other: Side) -> list[tuple[str, list[int], list[int]]]:
    """The two sides' allocations paired, phase by phase, by their rounded sizes in order
    (``difflib``): ``(tag, real allocation indices, other's)`` with tag ``equal``, ``replace``,
    ``delete`` (only the real run's) or ``insert`` (only the other's)."""
    out: list[tuple[str, list[int], list[int]]] = []
    labels = list(dict.fromkeys([*real.phase, *other.phase]))
    by_label_real: dict[str, list[int]] = {}
    by_label_other: dict[str, list[int]] = {}
    for i, label in enumerate(real.phase):
        by_label_real.setdefault(label, []).append(i)
    for i, label in enumerate(other.phase):
        by_label_other.setdefault(label, []).append(i)
    for label in labels:
        a, b = by_label_real.get(label, []), by_label_other.get(label, [])
        sa, sb = [real.sizes[i] for i in a], [other.sizes[i] for i in b]
        if len(a) > ALIGN_MOST or len(b) > ALIGN_MOST:
            n = 0
            while n < min(len(a), len(b)) and sa[n] == sb[n]:
                n += 1
            out.append(("equal", a[:n], b[:n]))
            if a[n:] or b[n:]:
                out.append(("replace", a[n:], b[n:]))
            continue
        matcher = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            out.append((tag, a[i1:i2], b[j1:j2]))
    return out


def _at(side: Side, i: int) -> dict[str, Any]:
    return {"allocation": i, "phase": side.phase[i], "size": side.sizes[i], "made_segment": side.made_segment[i],
            "reserved_above_base": side.reserved[i], "segments_above_base": side.segments[i], "from": side.origin[i]}  # fmt: skip


def first_divergences(real: Side, other: Side, pairs: Sequence[tuple[str, list[int], list[int]]]) -> dict[str, Any]:
    """Where ``other`` first parts from ``real``: ``requests`` (the first allocations that do not pair),
    ``segment`` (the first paired allocation one side made a segment for and the other did not),
    ``reserved`` (the first paired allocation after which the reserved bytes above the base differ),
    ``release`` (each side's first segments given back) and ``oom`` (each side's)."""
    out: dict[str, Any] = {"requests": None, "segment": None, "reserved": None}
    for tag, a, b in pairs:
        if tag != "equal" and out["requests"] is None:
            out["requests"] = {
                "phase": (real.phase[a[0]] if a else other.phase[b[0]]),
                "real": [_at(real, i) for i in a[:5]],
                other.name: [_at(other, j) for j in b[:5]],
                "real_count": len(a), f"{other.name}_count": len(b),
            }  # fmt: skip
        if tag != "equal":
            continue
        for i, j in zip(a, b):
            if out["segment"] is None and real.made_segment[i] != other.made_segment[j]:
                out["segment"] = {"real": _at(real, i), other.name: _at(other, j)}
            if out["reserved"] is None and real.reserved[i] != other.reserved[j]:
                out["reserved"] = {"real": _at(real, i), other.name: _at(other, j)}
    out["release"] = {"real": real.releases[:1] and real.releases[0], other.name: other.releases[:1] and other.releases[0]}
    out["oom"] = {"real": real.oom, other.name: other.oom}
    return out


def unmatched(side: Side, pairs: Sequence[tuple[str, list[int], list[int]]], which: int, most: int = 25) -> list[dict[str, Any]]:
    """One side's allocations the other does not make (``which``: 0 the real side, 1 the other),
    grouped by rounded size and origin (frames or operator): count, bytes, and how many were freed
    within their phase (a kernel's temporary)."""
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for pair in pairs:
        if pair[0] == "equal":
            continue
        for i in pair[1 + which]:
            key = (side.sizes[i], side.origin[i])
            g = groups.setdefault(key, {"size": side.sizes[i], "from": side.origin[i], "count": 0, "bytes": 0, "transient": 0, "phases": []})
            g["count"] += 1
            g["bytes"] += side.sizes[i]
            g["transient"] += side.freed_in_phase[i]
            if side.phase[i] not in g["phases"]:
                g["phases"].append(side.phase[i])
    return sorted(groups.values(), key=lambda g: -g["bytes"])[:most]


def rule_check(trace: RealTrace, limit: int | None, *, real_addresses: bool = True) -> dict[str, Any]:
    """The real run's own requests replayed through the replay's rules, from its base: the first
    request where the replay makes a segment and the real allocator does not (or the other way),
    gives back another number of segments, or runs out where the other does not. ``real_addresses``:
    new segments take the real ones in order (ties between free blocks of a size go by address, as
    the allocator's do); else the replay makes them up, each below the others, as the estimate's
    replay does."""
    addresses = [int(e["addr"]) for e in trace.entries if e["action"] == "segment_alloc"] if real_addresses else None
    replay = AllocatorReplay(limit=limit, record=True, addresses=addresses, fallback=trace.refused_keys)
    for address, size, small, blocks in trace.base_blocks:
        replay.add_segment(size, blocks, small=small, address=address if real_addresses else None)
    replay.run(trace.events)
    fell_back: set[int] = set()
    made: dict[int, bool] = {}
    released: Counter = Counter()
    reserved_after: dict[int, int] = {}
    pending = False
    for entry in replay.trace:
        if entry.index < 0:
            continue
        if entry.action == "segment_alloc":
            pending = True
        elif entry.action == "segment_free":
            released[entry.index] += 1
        elif entry.action in ("alloc", "oom", "fallback"):
            made[entry.index] = pending
            reserved_after[entry.index] = entry.reserved
            pending = False
            if entry.action == "fallback":
                fell_back.add(entry.index)
    first = None
    ordinal = -1
    for n, i in enumerate(trace.event_entry):
        if trace.events[n][1] <= 0:
            continue
        ordinal += 1
        action = trace.entries[i]["action"]
        real_made = action == "alloc" and i > 0 and trace.entries[i - 1]["action"] == "segment_alloc"
        real_released, k = 0, i - 1 - real_made
        while k >= 0 and trace.entries[k]["action"] == "segment_free":
            real_released, k = real_released + 1, k - 1
        refused = i in trace.refused  # the run went on without it: the replay skips it (a fallback) or not
        replay_oom = (replay.oom is not None and replay.oom[0] == n) or n in fell_back
        where = {"allocation": ordinal, "size": trace.events[n][1], "from": frames_text(trace.entries[i].get("frames")),
                 "real_reserved": trace.reserved[i], "replay_reserved": reserved_after.get(n)}  # fmt: skip
        if n not in made:
            first = {**where, "what": "the replay ran out of memory before this request"}
        elif (action == "oom") != replay_oom:
            first = {**where, "what": f"out of memory: real {action == 'oom'}, replay {replay_oom}"}
        elif made[n] != real_made or released[n] != real_released:
            first = {**where, "what": f"segment made: real {real_made}, replay {made[n]}; segments given back: "
                     f"real {real_released}, replay {released[n]}"}  # fmt: skip
        if first is not None or (action == "oom" and not refused):
            break
    return {
        "addresses": "real" if real_addresses else "made up, each below the others",
        "exact": first is None,
        "first_difference": first,
        "replay_peak_reserved": replay.peak_reserved,
        "real_peak_reserved": max(trace.reserved, default=trace.base_reserved),
        "replay_oom": replay.oom,
        "real_oom": any(e["action"] == "oom" and i not in trace.refused for i, e in enumerate(trace.entries)),
        "real_refused": len(trace.refused),
    }


def step_totals(side: Side) -> dict[str, dict[str, int]]:
    """``side``'s phases summed by step (``"step 1"``: its allocations, bytes, segments made and given
    back; its peaks the highest of its phases')."""
    out: dict[str, dict[str, int]] = {}
    for label, row in side.phases.items():
        step = " ".join(label.split()[:2])
        total = out.setdefault(step, _empty_row())
        for key in ("allocations", "bytes", "frees", "segments_made", "segments_given_back"):
            total[key] += row[key]
        for key in ("peak_allocated", "peak_reserved"):
            total[key] = max(total[key], row[key])
        total["end_allocated"], total["end_reserved"], total["end_segments"] = row["end_allocated"], row["end_reserved"], row["end_segments"]
    return out


def phase_table(real: Side, replays: Mapping[str, Side]) -> list[list[Any]]:
    """Rows per step, then per phase (in the real run's order, then the others'): each side's
    allocations, bytes, peak allocated and reserved above the base, segments made and given back."""
    sides = (real, *replays.values())
    steps = [step_totals(side) for side in sides]
    labels = list(dict.fromkeys([*real.phases, *(label for s in replays.values() for label in s.phases)]))
    step_labels = list(dict.fromkeys(" ".join(label.split()[:2]) for label in labels))
    rows = []
    for label in [*(f"{step} (all)" for step in step_labels), *labels]:
        row: list[Any] = [label]
        for side, by_step in zip(sides, steps):
            p = by_step.get(label[: -len(" (all)")]) if label.endswith(" (all)") else side.phases.get(label)
            if p is None:
                row.append("-")
            else:
                row.append(f"{p['allocations']} / {p['bytes']:,} / {p['peak_allocated']:,} / {p['peak_reserved']:,} / "
                           f"+{p['segments_made']} -{p['segments_given_back']}")  # fmt: skip
        rows.append(row)
    return rows


def workspace_events(events: StepEvents) -> int:
    """How many of ``events`` come first and are the libraries' workspaces (negative keys, before the steps)."""
    first_mark = events.marks[0][0] if events.marks else len(events.events)
    n = 0
    while n < first_mark and events.events[n][0] < 0 and events.events[n][1] > 0:
        n += 1
    return n


def compare(trace: RealTrace, phases: Sequence[Phase], events: StepEvents, limit: int | None) -> dict[str, Any]:
    """The real run against the estimate's replay (from its own workspaces) and against the same
    events replayed from the real base (the workspaces left out: the real base holds its own);
    and the rule check. Plain data."""
    real = real_side(trace, phases)
    workspaces = workspace_events(events)
    own = AllocatorReplay(limit=limit, record=True, fallback=events.fallback).run(events.events)
    estimate = replay_side("estimate", events, own, workspaces)
    step_only = StepEvents(events.events[workspaces:], tuple((i - workspaces, s, p) for i, s, p in events.marks), events.sources,
                           fallback=events.fallback)  # fmt: skip
    on_base = AllocatorReplay(limit=limit, record=True, fallback=events.fallback)
    for _, size, small, blocks in trace.base_blocks:
        on_base.add_segment(size, blocks, small=small)
    on_base.run(step_only.events)
    from_base = replay_side("estimate on the real base", step_only, on_base)
    result: dict[str, Any] = {"limit": limit}
    for other in (estimate, from_base):
        pairs = align(real, other)
        result[other.name] = {
            "first": first_divergences(real, other, pairs),
            "real_only": unmatched(real, pairs, 0),
            "replay_only": unmatched(other, pairs, 1),
            "paired": sum(len(a) for tag, a, _ in pairs if tag == "equal"),
            "peak_reserved_above_base": max(other.reserved, default=0),
            "oom": other.oom,
        }
    result["real"] = {"allocations": len(real.sizes), "peak_reserved_above_base": max(real.reserved, default=0),
                      "base_reserved": trace.base_reserved, "base_allocated": trace.base_allocated,
                      "base_segments": trace.base_segments, "oom": real.oom, "releases": len(real.releases),
                      "truncated": trace.truncated}  # fmt: skip
    result["phases"] = phase_table(real, {"estimate": estimate, "estimate on the real base": from_base})
    result["rules"] = [rule_check(trace, limit, real_addresses=True), rule_check(trace, limit, real_addresses=False)]
    return result


# =====================================================================================
# the report
# =====================================================================================
def _point(value: Any) -> str:
    if not value:
        return "-"
    if isinstance(value, dict) and "real" in value:
        parts = []
        for side, v in value.items():
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, dict):
                parts.append(f"{side}: " + ", ".join(f"{k} {v[k]:,}" if isinstance(v[k], int) and not isinstance(v[k], bool) else f"{k} {v[k]}" for k in v))
            else:
                parts.append(f"{side}: {v if v is not None else '-'}")
        return "; ".join(parts)
    return str(value)


def render(payload: Mapping[str, Any]) -> str:
    lines = [payload.get("environment", ""), ""]
    if payload.get("PYTORCH_CUDA_ALLOC_CONF"):
        lines += [f"PYTORCH_CUDA_ALLOC_CONF={payload['PYTORCH_CUDA_ALLOC_CONF']}: the replay follows the default settings", ""]
    for row in payload["rows"]:
        head = f"## {row['name']} at batch {row['batch']:,}"
        if row.get("card"):
            head += f", card {row['card'] / 2**30:g} GiB"
        lines += [head, ""]
        if "error" in row:
            lines += [f"error: {row['error']}", ""]
        est = row.get("estimate")
        if est:
            lines.append(f"estimate: peak {est['peak']:,} (+ workspace {est['workspace']:,}), reserved {est['reserved']:,}, "
                         f"error bound {est['error_bound']:,}")  # fmt: skip
        for run_name, run in row.get("runs", {}).items():
            lines += ["", f"### {run_name}", ""]
            if "error" in run:
                lines += [f"error: {run['error']}", ""]
                continue
            real = run["real"]
            lines.append(f"real: {real['allocations']:,} allocations, peak reserved above base {real['peak_reserved_above_base']:,}, "
                         f"base {real['base_reserved']:,} reserved / {real['base_allocated']:,} allocated in {real['base_segments']} segments, "
                         f"segments given back {real['releases']}, out of memory: {real['oom'] or 'no'}"
                         + (" (the trace lost its first entries: raise --max-entries)" if real.get("truncated") else ""))  # fmt: skip
            if real.get("base_blocks"):
                lines += ["", "Held before the model (the base):", ""]
                lines.append(markdown_table(["block", "requested", "segment", "pool", "from"],
                                            [[f"{b['size']:,}", f"{b['requested']:,}", f"{b['segment']:,}", b["pool"], b["from"]]
                                             for b in real["base_blocks"]]))  # fmt: skip
                lines.append("")
            for check in run["rules"]:
                verdict = "exact" if check["exact"] else f"parts at {_point(check['first_difference'])}"
                lines.append(f"rule check (real requests replayed, addresses {check['addresses']}): {verdict}; peak reserved "
                             f"replay {check['replay_peak_reserved']:,} vs real {check['real_peak_reserved']:,}")  # fmt: skip
            for name in ("estimate", "estimate on the real base"):
                part = run[name]
                lines += ["", f"**{name}** ({part['paired']:,} allocations paired; peak reserved above base {part['peak_reserved_above_base']:,}; "
                          f"out of memory: {part['oom'] or 'no'})", ""]  # fmt: skip
                for what in ("requests", "segment", "reserved", "release", "oom"):
                    lines.append(f"- first {what}: {_point(part['first'].get(what))}")
                if part["real_only"]:
                    lines += ["", "Real allocations the estimate does not make (rounded size, count, bytes, freed in their phase, from):", ""]
                    lines.append(markdown_table(["size", "count", "bytes", "transient", "phases", "from"],
                                                [[f"{g['size']:,}", g["count"], f"{g['bytes']:,}", g["transient"], ", ".join(g["phases"][:3]),
                                                  g["from"]] for g in part["real_only"]]))  # fmt: skip
                if part["replay_only"]:
                    lines += ["", "The estimate's allocations the real run does not make:", ""]
                    lines.append(markdown_table(["size", "count", "bytes", "transient", "phases", "from"],
                                                [[f"{g['size']:,}", g["count"], f"{g['bytes']:,}", g["transient"], ", ".join(g["phases"][:3]),
                                                  g["from"]] for g in part["replay_only"]]))  # fmt: skip
            lines += ["", "Per phase: allocations / bytes / peak allocated above base / peak reserved above base / segments made, given back", ""]
            lines.append(markdown_table(["phase", "real", "estimate", "estimate on the real base"], run["phases"]))
        lines.append("")
    return "\n".join(lines)


# =====================================================================================
# driving it
# =====================================================================================
def models() -> dict[str, Any]:
    """Every model the registries hold (the zoo, the held-back text and vision sets, the sweep), by
    name: the zoo's name wins where two registries share one."""
    from benchmarks.zoo import registries

    merged: dict[str, Any] = {}
    for registry in reversed(list(registries().values())):
        merged.update(registry)
    return merged


def one_model(name: str, batch: int | str, card_gib: float, device: torch.device, *, max_entries: int, stacks: str,
              snapshots: Path | None) -> dict[str, Any]:  # fmt: skip
    entry = models()[name]
    row: dict[str, Any] = {"name": name, "card": int(card_gib * 2**30)}
    total = torch.cuda.mem_get_info(device)[1]
    fraction = row["card"] / total
    # the allocator's limit is the fraction of cudaMemGetInfo's total; the conformance run computes
    # it from the device's properties: where the two differ, so do the limits
    row["total_memory"] = {"mem_get_info": total, "properties": torch.cuda.get_device_properties(device).total_memory}
    try:
        if batch == "predicted":
            from pytorch_mem_profiler import estimate_memory

            fitted = estimate_memory(**entry.estimate_kwargs("real"), batch_size=entry.batch["real"], device=device)
            search = fitted.batch_search(int(fraction * total), margin=0, outside=0)
            batch = search.largest
            row["search"] = {"largest": search.largest, "bound": search.bound, "tried": search.tried}
        row["batch"] = int(batch)
        est, events = estimate_events(entry, int(batch), device)
        row["estimate"] = {"peak": est.peak, "workspace": est.workspace, "reserved": est.reserved, "error_bound": est.error_bound,
                           "events": len(events.events)}  # fmt: skip
        row["runs"] = {}
        for run_name, limit_fraction in (("no limit", None), (f"under the card ({card_gib:g} GiB)", fraction)):
            started = time.perf_counter()
            try:
                real = real_run(entry, int(batch), device, limit_fraction=limit_fraction, max_entries=max_entries, stacks=stacks)
                if snapshots is not None:
                    path = snapshots / f"{name}_{batch}_{'limit' if limit_fraction else 'free'}.pickle"
                    path.write_bytes(pickle.dumps(real["snapshot"], protocol=4))
                counts = (real["end"]["allocation.all.allocated"] - real["start"]["allocation.all.allocated"],
                          real["end"]["allocation.all.freed"] - real["start"]["allocation.all.freed"])  # fmt: skip
                trace = parse_real(real["snapshot"], real["base"], device=device.index or 0, counts=counts)
                phases = real_phases(trace, real["marks"], real["start"])
                result = compare(trace, phases, events, real["limit"])
                result["real"]["base_blocks"] = base_report(real["base"], device.index or 0)
                result["real"]["stats_at_end"] = real["end"]
                result["real"]["oom_message"] = real["oom"]
                result["seconds"] = time.perf_counter() - started
                row["runs"][run_name] = result
            except Exception as err:  # noqa: BLE001 - recorded in the row
                row["runs"][run_name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
                                         "traceback": traceback.format_exc()}  # fmt: skip
                fresh(device)
    except Exception as err:  # noqa: BLE001 - one model failing goes in its row
        row.setdefault("batch", batch if isinstance(batch, int) else 0)
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        row["traceback"] = traceback.format_exc()
    torch._dynamo.reset()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for replay_against_real.md and .json (default: $OUT, else a new temporary folder)")
    parser.add_argument("--only", help=f"comma-separated models of any registry: the zoo, the held-back sets (default: {','.join(CASES)})")
    parser.add_argument("--batch", help="the batch (one model), or 'predicted': the estimate's max_batch_size under the card now")
    parser.add_argument("--card-gib", type=float, help="the card's size in GiB (one model; default: the conformance run's)")
    parser.add_argument("--max-entries", type=int, default=1_000_000, help="the allocator history's ring buffer (default 1,000,000)")
    parser.add_argument("--stacks", choices=("python", "all"), default="python", help="'all' records C++ frames too (slow)")
    parser.add_argument("--snapshots", action="store_true", help="also write each real run's snapshot (pickle, for memory_viz)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the real runs need a CUDA GPU")
    known = models()
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--only: unknown models {', '.join(unknown)}; known: {', '.join(known)}")
    if (args.batch or args.card_gib) and len(names) != 1 and args.batch != "predicted":
        parser.error("--batch N and --card-gib are for one model (--only NAME)")
    out = output_dir(args.out) or Path(tempfile.mkdtemp(prefix="replay_against_real_"))
    device = torch.device("cuda", torch.cuda.current_device())
    # the replay's rules are the allocator's defaults: say where the run's settings are others
    payload: dict[str, Any] = {"environment": environment_line(device), "torch": torch.__version__,
                               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "rows": []}  # fmt: skip
    started = time.perf_counter()
    for name in names:
        batch, card = CASES.get(name, (known[name].batch["real"], 0.0))
        if args.batch:
            batch = args.batch if args.batch == "predicted" else int(args.batch)
        if args.card_gib:
            card = args.card_gib
        if not card:
            parser.error(f"{name}: give --card-gib (no conformance card known for it)")
        reason = known[name].unavailable()
        if reason:
            payload["rows"].append({"name": name, "batch": batch if isinstance(batch, int) else 0, "error": f"skipped: {reason}"})
            continue
        row = one_model(name, batch, card, device, max_entries=args.max_entries, stacks=args.stacks, snapshots=out if args.snapshots else None)
        payload["rows"].append(row)
        payload["seconds"] = time.perf_counter() - started
        # after each model: a run cut short keeps what it compared
        (out / "replay_against_real.json").write_text(json.dumps(payload, indent=1, default=str))
        print(f"{name}: {'error' if 'error' in row else 'done'} ({time.perf_counter() - started:.0f} s)", flush=True)
    text = render(payload)
    (out / "replay_against_real.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'replay_against_real.md'} and {out / 'replay_against_real.json'}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
