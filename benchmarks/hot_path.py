"""Where the profiler's per-iteration cost goes: ablations and a cProfile of the hot path.

    python benchmarks/hot_path.py --workload tiny_mlp --steps 300
    python benchmarks/hot_path.py --host-cost        # host us per iteration, reported or not (CPU, seconds)
    python benchmarks/hot_path.py --layer-cost       # host us per reported by_layer iteration, 8 layers + Adam
    python benchmarks/hot_path.py --layer-cost --profile   # ... and where that time goes (cProfile)
    python benchmarks/hot_path.py --reads            # us per device read, peak reset and driver read
    python benchmarks/hot_path.py --read-floor       # what the reads alone add to the tiny MLP's step (CUDA)
    python benchmarks/hot_path.py --workload gpt2 --by-layer --profile-only   # cProfile of profiled steps
    python benchmarks/hot_path.py --by-layer --no-budget    # per-layer mode at every reported iteration
    python benchmarks/hot_path.py --by-position --print-period 10   # what each iteration of a period adds
    python benchmarks/hot_path.py --inside           # time inside each hook and its reads, in the real loop
    python benchmarks/hot_path.py --light-inside [--device cuda]   # what stays installed at "light", and its cost
    python benchmarks/hot_path.py --workload gpt2 --timeline [--batch 1]   # host vs GPU time per step (CUDA)

Times the workload without the profiler, with it, and with parts of it
replaced by no-ops (the device reads; the backward hooks), alternating in one
process, then prints the functions of this package that cost most per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS, median  # noqa: E402

import pytorch_mem_profiler.measure.meter as meter_module  # noqa: E402
from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.measure.devices import MemoryCounter, Reading  # noqa: E402
from pytorch_mem_profiler.measure.hooks import StepHooks  # noqa: E402
from pytorch_mem_profiler.measure.phases import PhaseMachine  # noqa: E402
from pytorch_mem_profiler.measure.layers import ATTRIBUTION_PART  # noqa: E402
from pytorch_mem_profiler.measure.peak_breakdown import BREAKDOWN_PART  # noqa: E402


class NullCounter(MemoryCounter):
    """A counter that reads nothing: isolates the Python cost of the hooks."""

    shares_peaks = False

    def _read_device(self) -> Reading:
        return Reading(0, 0, 0, 0)


class CountingCounter(NullCounter):
    """A null counter that counts its device reads and peak resets."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.reads = 0
        self.resets = 0

    def _read_device(self) -> Reading:
        self.reads += 1
        return Reading(0, 0, 0, 0)

    def reset_peak(self) -> None:
        self.resets += 1


def _tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(4, 8)


def _eight_layers() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """8 x (Linear(16) + ReLU) with Adam, batch 4: the layer count of ``tiny_mlp`` (8 x Linear(1024)),
    so the per-layer machinery does the same work per iteration while the arithmetic is nothing."""
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(4, 16)


def host_cost(
    print_period: int,
    by_layer: bool,
    steps: int = 2000,
    rounds: int = 9,
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]] = _tiny_model,
    profile: cProfile.Profile | None = None,
) -> float:
    """Host microseconds the profiler adds to an iteration of a tiny CPU model, its counter a
    :class:`NullCounter` (so only the Python of the hooks and the record is timed): the median
    over interleaved rounds of (with - without) per step, in the thread's CPU time. ``print_period`` larger than ``steps``
    times non-reported iterations only; 1 reported ones only. The :class:`NullCounter` keeps a
    peak, so the peak breakdown is :class:`~pytorch_mem_profiler.measure.peak_breakdown.BoundaryPeakBreakdown`,
    the one CUDA uses. ``profile``: enabled around the profiled blocks only."""
    torch.manual_seed(0)
    model, opt, x = build()

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def block(profiler: MemoryProfiler | None) -> float:
        # The thread's CPU time: other processes on a shared machine do not count.
        start = time.thread_time()
        for _ in range(steps):
            step()
            if profiler is not None:
                profiler.record_stats()
        return (time.thread_time() - start) / steps * 1e6

    real = meter_module.make_counter
    meter_module.make_counter = lambda d: NullCounter(d)
    sink = open(os.devnull, "w")
    try:
        for _ in range(200):
            step()
        diffs = []
        for _ in range(rounds):
            before = block(None)
            prof = MemoryProfiler(
                model, print_period, stream=sink, by_layer=by_layer, strict=True, overhead=None
            )
            if profile is not None:
                profile.enable()
            with_ = block(prof)
            if profile is not None:
                profile.disable()
            prof.close()
            after = block(None)
            diffs.append(with_ - (before + after) / 2)
    finally:
        meter_module.make_counter = real
        sink.close()
    return median(diffs)


def print_host_cost() -> None:
    print("host us the profiler adds per iteration (NullCounter, 3-layer CPU model, median of interleaved rounds):")
    for label, period, by_layer in (
        ("not reported", 10**9, False),
        ("not reported, by_layer", 10**9, True),
        ("reported (print_period=1)", 1, False),
        ("reported, by_layer", 1, True),
    ):
        print(f"  {label:28s} {host_cost(period, by_layer):8.1f} us")


def print_layer_cost(profile: bool, rounds: int = 9) -> None:
    """Host us of a reported by_layer iteration of 8 x (Linear(16) + ReLU) + Adam (batch 4), against
    reported without by_layer; with ``profile``, where the by_layer iteration's time goes."""
    print("host us the profiler adds per reported iteration (NullCounter, 8 x Linear(16)+ReLU + Adam, batch 4):")
    for label, by_layer in (("reported (print_period=1)", False), ("reported, by_layer", True)):
        cost = host_cost(1, by_layer, steps=500, rounds=rounds, build=_eight_layers)
        print(f"  {label:28s} {cost:8.1f} us")
    if not profile:
        return
    steps = 500
    prof = cProfile.Profile()
    host_cost(1, True, steps=steps, rounds=3, build=_eight_layers, profile=prof)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    # The profiled blocks: 3 rounds of ``steps`` iterations.
    print(f"cProfile of {3 * steps} reported by_layer iterations (divide by {3 * steps} for per iteration):")
    stats.sort_stats("tottime").print_stats("pytorch_mem_profiler|autograd|optim|_C|torch", 35)
    stats.sort_stats("cumulative").print_stats("pytorch_mem_profiler", 40)
    print(out.getvalue())


def print_read_costs(device: torch.device, calls: int = 20000) -> None:
    """Microseconds per call of each way to read the allocator's counters, and of the peak reset."""
    if device.type != "cuda":
        print("--reads needs a CUDA device")
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    keep = torch.empty(1 << 20, device=device)  # the allocator is initialised and holds a block
    candidates = {
        "torch._C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(idx),
        "torch._C._accelerator_getDeviceStats": getattr(torch._C, "_accelerator_getDeviceStats", None),
        "torch._C._cuda_resetPeakMemoryStats": lambda: torch._C._cuda_resetPeakMemoryStats(idx),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(idx),
        "torch.cuda.mem_get_info (driver)": lambda: torch.cuda.mem_get_info(idx),
    }
    if candidates["torch._C._accelerator_getDeviceStats"] is not None:
        candidates["torch._C._accelerator_getDeviceStats"] = lambda: torch._C._accelerator_getDeviceStats(idx)
    from pytorch_mem_profiler.measure.devices import make_counter
    from pytorch_mem_profiler.measure.outside import DeviceMemoryReader

    counter = make_counter(device)
    candidates["profiler: counter.mark() (read + reset)"] = counter.mark
    reader = DeviceMemoryReader(device)
    candidates["profiler: outside-PyTorch read (NVML)"] = reader.read
    print(f"us per call on {torch.cuda.get_device_name(idx)} (median of 5 x {calls} calls):")
    for name, fn in candidates.items():
        if fn is None:
            print(f"  {name:44s}      n/a")
            continue
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        print(f"  {name:44s} {median(times):8.2f}")
    del keep


def print_read_floor(device: torch.device, steps: int = 300, rounds: int = 9) -> None:
    """What the allocator reads alone add to the tiny MLP's step, without the profiler: one read
    and reset per step (a non-reported iteration), one at each of the seven phase boundaries (a
    reported one) and 39 (a reported ``by_layer=True`` one: two more for each of its 16 modules).
    Each variant's block runs between two blocks without reads; the ratio is against their mean."""
    if device.type != "cuda":
        print("--read-floor needs a CUDA device")
        return
    from pytorch_mem_profiler.measure.devices import make_counter

    work = WORKLOADS["tiny_mlp"](device)
    model, opt, (x,) = work.model, work.optimizer, work.inputs
    mark = make_counter(device).mark

    def block(reads: int) -> float:
        at_boundaries = reads >= 7
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            if at_boundaries:
                mark()  # forward starts
            out = model(x)
            if at_boundaries:
                mark()  # forward ends
            loss = out.pow(2).mean()
            if at_boundaries:
                mark()  # backward starts
            loss.backward()
            if at_boundaries:
                mark()  # backward ends
                mark()  # the step starts
            opt.step()
            if at_boundaries:
                mark()  # the step ends
            opt.zero_grad(set_to_none=True)
            for _ in range(reads - 6 if at_boundaries else reads):
                mark()  # record_stats(), and the per-module boundaries
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps * 1e6

    for _ in range(50):
        block(0)
    variants = {1: "1 read (a non-reported iteration)", 7: "7 reads (a reported one)", 39: "39 reads (reported, by_layer)"}
    ratios: dict[int, list[float]] = {n: [] for n in variants}
    added: dict[int, list[float]] = {n: [] for n in variants}
    bases = []
    for _ in range(rounds):
        for n in variants:
            before, with_, after = block(0), block(n), block(0)
            base = (before + after) / 2
            bases.append(base)
            ratios[n].append(with_ / base)
            added[n].append(with_ - base)
    print(
        f"tiny_mlp on {torch.cuda.get_device_name(device)}: step {median(bases):.1f} us without; the reads alone, "
        f"median (lowest-highest) over {rounds} interleaved rounds"
    )
    for n, label in variants.items():
        r, a = ratios[n], added[n]
        print(
            f"  {label:34s} {median(r):.3f}x ({min(r):.3f}-{max(r):.3f})   +{median(a):7.1f} us/step, "
            f"{median(a) / n:5.1f} us/read"
        )


def print_by_position(work, args, device: torch.device, sink) -> None:
    """Host time of each iteration of a print period, against the same loop without the profiler.

    On a step the CPU bounds, the time from one ``record_stats()`` return to the next is the
    step's time, so each position of the period (the reported iteration, the one after it, the
    ones the hooks sleep through, the one before the next report) gets its own cost. Blocks with
    and without the profiler alternate; each position's median is taken over every period of
    every block, and what it adds is against the median iteration without the profiler.
    """
    period = args.print_period
    steps = max(period, args.steps // period * period)

    def block(profiler: MemoryProfiler | None) -> list[int]:
        stamps = [0] * (steps + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps[0] = time.perf_counter_ns()
        for i in range(1, steps + 1):
            work.step()
            if profiler is not None:
                profiler.record_stats()
            stamps[i] = time.perf_counter_ns()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return [b - a for a, b in zip(stamps, stamps[1:])]

    without: list[int] = []
    at: list[list[int]] = [[] for _ in range(period)]
    whole: list[float] = []
    for _ in range(max(args.rounds, 9)):
        before = block(None)
        prof = MemoryProfiler(work.model, period, stream=sink, by_layer=args.by_layer, **_budget(args))
        # The profiler's first period holds its learning iteration: leave it out.
        times = block(prof)[period:]
        prof.close()
        after = block(None)
        without += before + after
        for i, t in enumerate(times):
            # Iteration i + period + 1 of the profiler is reported when (i + 1) % period == 0.
            at[(i + 1) % period].append(t)
        whole.append(sum(times) / (sum(before + after) / 2) * (len(before) / len(times)))
    base = median(without) / 1e3
    print(
        f"{args.workload} on {device}, print_period={period}{', by_layer' if args.by_layer else ''}: "
        f"iteration {base:.1f} us without the profiler (median); with it, by position in the period "
        f"(median us, and what it adds):"
    )
    total = 0.0
    for pos in range(period):
        med = median(at[pos]) / 1e3
        total += med - base
        label = "reported" if pos == 0 else f"reported + {pos}"
        print(f"  {label:14s} {med:9.1f}  {med - base:+8.1f}")
    print(
        f"  sum of what the positions add: {total:+.1f} us per period, {total / period:+.1f} us per iteration "
        f"({1 + total / period / base:.3f}x); whole blocks: {median(whole):.3f}x ({min(whole):.3f}-{max(whole):.3f})"
    )


def print_timeline(work, args, device: torch.device, sink, steps: int = 20) -> None:
    """Per step: the wall time, the host's time (to ``record_stats()``'s return, no sync) and the
    GPU's (CUDA events around the step), without the profiler and with it, per-layer mode with
    its parts switched off one by one; then the synchronizing calls of two profiled steps.

    Where the host's time is the GPU's, the host waits on a full launch queue or is itself
    the bottleneck; run the same workload with a small ``--batch`` to see the host's own time:
    the GPU then finishes early and the step is what the host needs. A profiler's cost that
    shows on the GPU's time (its events) reached the GPU: host work it could not hide, or a sync.
    """
    if device.type != "cuda":
        print("--timeline needs a CUDA device")
        return
    import statistics
    import warnings

    def measure(profiler: MemoryProfiler | None) -> tuple[float, float, float]:
        host = []
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for begin, end in events:
            began = time.perf_counter()
            begin.record()
            work.step()
            if profiler is not None:
                profiler.record_stats()
            end.record()
            host.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e3
        return wall, statistics.median(host), statistics.median(b.elapsed_time(e) for b, e in events)

    # (by_layer, parts switched off); None: without the profiler
    variants: dict[str, tuple[bool, set[str]] | None] = {
        "without the profiler": None,
        "print_period=1": (False, set()),
        "by_layer": (True, set()),
        "by_layer, no peak breakdown": (True, {BREAKDOWN_PART}),
        "by_layer, no per-layer attribution": (True, {ATTRIBUTION_PART}),
        "by_layer, neither": (True, {BREAKDOWN_PART, ATTRIBUTION_PART}),
    }

    def warmed(by_layer: bool, off: Iterable[str] = ()) -> MemoryProfiler:
        """A profiler with ``off`` switched off, past its learning iteration."""
        prof = MemoryProfiler(work.model, 1, stream=sink, by_layer=by_layer, **_budget(args))
        prof._guard.disabled.update(off)
        for _ in range(3):
            work.step()
            prof.record_stats()
        return prof

    print(f"{args.workload} on {torch.cuda.get_device_name(device)}: ms per step, median of {steps} steps")
    for round_ in range(args.rounds):
        for label, variant in variants.items():
            prof = warmed(*variant) if variant is not None else None
            wall, host, gpu = measure(prof)
            if prof is not None:
                prof.close()
            print(f"  round {round_}  {label:36s} wall {wall:7.2f}  host {host:7.2f}  GPU {gpu:7.2f}")
    prof = warmed(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                work.step()
                prof.record_stats()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        prof.close()
    syncs = [w for w in caught if "Synchronization debug mode" not in str(w.message)]
    print(f"synchronizing calls torch saw in two reported by_layer steps: {len(syncs)}")
    for w in syncs[:10]:
        print(f"  {w.filename}:{w.lineno}: {str(w.message)[:160]}")


def run(work, steps: int, profiler: MemoryProfiler | None, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        work.step()
        if profiler is not None:
            profiler.record_stats()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


#: (class, method): what torch calls (the hook set's hooks; the entry hook calls the machine directly)
_TIMED = (
    (PhaseMachine, "entered"),
    (StepHooks, "_exited"),
    (StepHooks, "_backward_started"),
    (StepHooks, "_backward_finishing"),
    (StepHooks, "_backward_finished"),
    (StepHooks, "_optimizer_pre"),
    (StepHooks, "_optimizer_post"),
)


def print_time_inside_hooks(work, args, device: torch.device, sink, null_counter: bool = False) -> None:
    """Wall time spent inside each of the profiler's hooks per step (autograd's threads included),
    and inside the counter's reads (``mark``: a read and a peak reset), which the hooks include.

    What the step loses beyond their sum is the cost of reaching them: module
    call overhead, and the hand-over of Python's lock to autograd's device thread.
    ``null_counter``: the counter reads nothing, so the hooks' time is their Python alone.
    """
    spent: dict[str, float] = {}
    originals = {(cls, name): getattr(cls, name) for cls, name in _TIMED}
    original_record = MemoryProfiler.record_stats
    real_make_counter = meter_module.make_counter

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    def make_timed_counter(d):
        counter = NullCounter(d) if null_counter else real_make_counter(d)
        counter.mark = timed("  of which counter.mark", counter.mark)
        return counter

    for (cls, name), fn in originals.items():
        setattr(cls, name, timed(name, fn))
    MemoryProfiler.record_stats = timed("record_stats", original_record)
    meter_module.make_counter = make_timed_counter
    try:
        base = median([run(work, args.steps, None, device) for _ in range(3)])
        prof = MemoryProfiler(work.model, args.print_period, stream=sink, by_layer=args.by_layer, **_budget(args))
        run(work, 20, prof, device)
        spent.clear()
        with_prof = run(work, args.steps, prof, device)
        prof.close()
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        MemoryProfiler.record_stats = original_record
        meter_module.make_counter = real_make_counter
    marks = spent.pop("  of which counter.mark", 0.0)
    inside = sum(spent.values()) / args.steps * 1e6
    kind = "a counter reading nothing" if null_counter else "the device's counter"
    print(f"time inside the hooks with {kind}, us per step (step {base:.1f} -> {with_prof:.1f} us):")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {seconds / args.steps * 1e6:8.1f}")
    print(f"  {'sum':24s} {inside:8.1f}   unaccounted: {with_prof - base - inside:8.1f}")
    print(f"  {'of which counter.mark':24s} {marks / args.steps * 1e6:8.1f}")


def installed_hooks(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, list]:
    """Every hook and mode installed now that torch runs during a training step of ``model``, by
    where it is: the model's modules' and parameters' hooks, torch's global module and optimizer
    hooks, the optimizers' own, the saved-tensor hooks on top of autograd's stack, and the
    dispatch and function modes (counted)."""
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    from pytorch_mem_profiler.measure.saved_tensors import can_chain, top_saved_tensors_hooks

    found: dict[str, list] = {}

    def add(where: str, hooks) -> None:
        if hooks:
            found.setdefault(where, []).extend(hooks.values())

    for module in model.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            add(f"module {attr}", getattr(module, attr, None))
    for param in model.parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            add(f"parameter {attr}", getattr(param, attr, None))
    for attr in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"):
        add(f"torch.nn {attr}", getattr(module_hooks, attr, None))
    for attr in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        add(f"torch.optim {attr}", getattr(optimizer_hooks, attr, None))
    for opt in optimizers:
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            add(f"optimizer {attr}", getattr(opt, attr, None))
    if can_chain() and top_saved_tensors_hooks() is not None:
        found["saved-tensor hooks on top"] = list(top_saved_tensors_hooks())
    for what, count in (
        ("dispatch modes", torch._C._len_torch_dispatch_stack()),
        ("function modes", torch._C._len_torch_function_stack()),
    ):
        if count:
            found[what] = [f"{count} mode(s)"] * count
    return found


def _hook_name(hook) -> str:
    if isinstance(hook, str):
        return hook
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def print_light_inside(work, args, device: torch.device, sink, steps: int = 300) -> None:
    """What runs inside a training step while the iterations are at the ``"light"`` level.

    Lists what the profiler leaves installed once its hooks sleep (everything installed with it,
    less what was installed without it), times each such optimizer hook called as torch calls
    it, then times the step in interleaved blocks: without the profiler, with it asleep and
    nothing called between the steps (what runs inside the step), and with ``record_stats()``
    after each step, split into ``record_stats()``'s own time and what the step loses after it
    (the caches and branch predictors the call leaves cold). ``print_period`` is set past the
    run, so that every iteration is light. The device's own counter is used (on CUDA: the
    allocator read and peak reset of every ``record_stats()``; on the CPU: the counting
    dispatch mode, in every operator of the step), or with ``--null-counter`` one that reads
    nothing (the Python alone).
    """
    import statistics

    model, opt = work.model, work.optimizer
    real_make_counter = meter_module.make_counter
    if args.null_counter:
        meter_module.make_counter = lambda d: NullCounter(d)

    def profiler() -> MemoryProfiler:
        """A profiler past its learning iteration, its hooks asleep."""
        prof = MemoryProfiler(model, 10**9, stream=sink, by_layer=args.by_layer, **_budget(args))
        for _ in range(5):
            work.step()
            prof.record_stats()
        assert prof._meter._hooks is not None and prof._meter._hooks.asleep, "the hooks should sleep by now"
        return prof

    def block(prof: MemoryProfiler | None, record: bool) -> tuple[list[int], list[int]]:
        """Thread ns of each step, and of each record_stats() after it (``record``)."""
        clock = time.thread_time_ns
        step_times, record_times = [0] * steps, [0] * steps
        if device.type == "cuda":
            torch.cuda.synchronize()
        for i in range(steps):
            start = clock()
            work.step()
            stepped = clock()
            if record:
                prof.record_stats()  # type: ignore[union-attr]
            step_times[i] = stepped - start
            record_times[i] = clock() - stepped
        if device.type == "cuda":
            torch.cuda.synchronize()
        return step_times, record_times

    try:
        before = {where: list(hooks) for where, hooks in installed_hooks(model, [opt]).items()}
        prof = profiler()
        now = installed_hooks(model, [opt])
        added = {where: [h for h in hooks if all(h is not b for b in before.get(where, []))] for where, hooks in now.items()}
        counter = type(prof._meter.counter).__name__
        print(
            f"{args.workload} on {device}{', by_layer' if args.by_layer else ''}, {counter}: "
            "what the profiler leaves installed at the light level"
        )
        if not any(added.values()):
            print("  nothing")
        for where, hooks in added.items():
            for hook in hooks:
                line = f"  {where:44s} {_hook_name(hook)}"
                if where.startswith(("torch.optim", "optimizer")):
                    calls = 100_000
                    start = time.thread_time()
                    for _ in range(calls):
                        hook(opt, (), {})
                    line += f"   {(time.thread_time() - start) / calls * 1e9:6.0f} ns per call"
                print(line)
        prof.close()

        rounds = max(args.rounds, 9)
        without: list[int] = []
        asleep: list[int] = []
        stepped: list[int] = []
        recorded: list[int] = []
        empty: list[int] = []
        for _ in range(rounds):
            without += block(None, False)[0]
            prof = profiler()
            slept, nothing = block(prof, False)
            asleep += slept
            empty += nothing
            steps_after, records = block(prof, True)
            stepped += steps_after
            recorded += records
            prof.close()
            without += block(None, False)[0]
    finally:
        meter_module.make_counter = real_make_counter
    m = lambda values: statistics.median(values) / 1e3  # noqa: E731
    base = m(without)
    # Each time is the median over every step of every round, each step timed alone (the thread
    # clock read around it: the same in every block). "Nothing called" is the clock's own cost.
    print(f"thread us per step, medians over {rounds} interleaved rounds of {steps} steps each:")
    print(f"  the step without the profiler                     {base:9.2f}")
    print(f"  the step, the profiler asleep (nothing after it)  {m(asleep) - base:+9.2f}   (what runs inside the step)")
    print(f"  the step, record_stats() after each               {m(stepped) - base:+9.2f}   (and what the call leaves cold)")
    print(f"  record_stats() itself                             {m(recorded) - m(empty):9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny_mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--print-period", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--host-cost", action="store_true", help="only the host cost per iteration, on the CPU")
    parser.add_argument("--by-layer", action="store_true", help="the profiler with by_layer=True")
    parser.add_argument("--no-budget", action="store_true", help="the profiler with overhead=None (no cost budget)")
    parser.add_argument("--profile-only", action="store_true", help="only the cProfile of the profiled steps")
    parser.add_argument("--reads", action="store_true", help="only the cost of each device read (CUDA)")
    parser.add_argument("--read-floor", action="store_true", help="what the allocator reads alone add to the step (CUDA)")
    parser.add_argument("--layer-cost", action="store_true", help="host cost of a reported by_layer iteration (CPU)")
    parser.add_argument("--profile", action="store_true", help="with --layer-cost: a cProfile of it")
    parser.add_argument("--by-position", action="store_true", help="what each iteration of a print period adds")
    parser.add_argument("--inside", action="store_true", help="only the time inside each hook, with and without reads")
    parser.add_argument("--timeline", action="store_true", help="host and GPU time per step, by_layer's parts off (CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="the workload's batch size (default: its own)")
    parser.add_argument(
        "--light-inside", action="store_true", help="what stays installed at the light level, and what it costs the step"
    )
    parser.add_argument("--null-counter", action="store_true", help="with --light-inside: a counter that reads nothing")
    args = parser.parse_args()
    if args.reads:
        print_read_costs(torch.device(args.device))
        return
    if args.read_floor:
        print_read_floor(torch.device(args.device), rounds=max(args.rounds, 9))
        return
    if args.layer_cost:
        torch.set_num_threads(1)
        print_layer_cost(args.profile, rounds=args.rounds)
        return
    if args.host_cost:
        torch.set_num_threads(1)
        print_host_cost()
        return
    device = torch.device(args.device)
    if args.light_inside and device.type == "cpu":
        # on the CPU, 8 x (Linear(16) + ReLU) with Adam: the layer count of tiny_mlp, in a step short
        # enough for the rounds (the CPU counter's dispatch mode is in every step, profiled or not)
        torch.set_num_threads(1)
        model, opt, x = _eight_layers()

        def eight_layer_step() -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        args.workload = "8 x (Linear(16) + ReLU) + Adam"
        work = argparse.Namespace(model=model, optimizer=opt, step=eight_layer_step)
    else:
        work = WORKLOADS[args.workload](device, **({} if args.batch is None else {"batch": args.batch}))
    for _ in range(10):
        work.step()
    sink = open(os.devnull, "w")
    real_make_counter = meter_module.make_counter
    real_backward_started = StepHooks._backward_started
    if args.profile_only:
        print_profile(work, args, device, sink)
        return
    if args.by_position:
        print_by_position(work, args, device, sink)
        return
    if args.timeline:
        print_timeline(work, args, device, sink)
        return
    if args.light_inside:
        print_light_inside(work, args, device, sink, steps=args.steps)
        return
    if args.inside:
        for _ in range(args.rounds):
            print_time_inside_hooks(work, args, device, sink)
            print_time_inside_hooks(work, args, device, sink, null_counter=True)
        return

    variants = {
        "full": {},
        "null counter": {"counter": True},
        "no backward hooks": {"backward": True},
        "no outputs": {"outputs": True},
        "null counter, no backward hooks": {"counter": True, "backward": True},
        "null counter, no backward hooks, no outputs": {"counter": True, "backward": True, "outputs": True},
    }
    # Each variant's block between two blocks without the profiler: what it adds is taken
    # against their mean, so a drift of the machine's speed cancels.
    base_times: list[float] = []
    added: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, parts in variants.items():
            before = run(work, args.steps, None, device)
            meter_module.make_counter = (lambda d: NullCounter(d)) if parts.get("counter") else real_make_counter
            StepHooks._backward_started = (lambda self, g: None) if parts.get("backward") else real_backward_started
            prof = MemoryProfiler(work.model, args.print_period, stream=sink, by_layer=args.by_layer, **_budget(args))
            if parts.get("outputs"):
                prof._sinks = prof._record_outputs = []
            with_ = run(work, args.steps, prof, device)
            prof.close()
            meter_module.make_counter = real_make_counter
            StepHooks._backward_started = real_backward_started
            after = run(work, args.steps, None, device)
            base_times += [before, after]
            added[name].append(with_ - (before + after) / 2)

    base = median(base_times)
    print(
        f"{args.workload} on {device}, print_period={args.print_period}: step {base:.1f} us without; "
        f"us added per step, median (lowest-highest) over {args.rounds} rounds"
    )
    for name, values in added.items():
        print(f"  {name:46s} +{median(values):8.1f}   ({min(values):.1f} to {max(values):.1f})")

    print_time_inside_hooks(work, args, device, sink)
    print_profile(work, args, device, sink)


def _budget(args: argparse.Namespace) -> dict:
    """The profiler's cost budget for ``args``: none with ``--no-budget`` (every reported iteration at
    the richest level allowed, as the overhead benchmark's per-layer rows run), else the default."""
    return {"overhead": None} if args.no_budget else {}


def print_profile(work, args, device: torch.device, sink) -> None:
    """cProfile of ``args.steps`` profiled steps: the costliest functions, then this package's."""
    prof = MemoryProfiler(work.model, args.print_period, stream=sink, by_layer=args.by_layer, **_budget(args))
    out = io.StringIO()
    profile = cProfile.Profile()
    profile.enable()
    run(work, args.steps, prof, device)
    profile.disable()
    prof.close()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats("pytorch_mem_profiler|autograd|optim|_C", 25)
    stats.sort_stats("cumulative").print_stats("pytorch_mem_profiler", 30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
