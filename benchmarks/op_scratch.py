"""Which CUDA operations take memory from the caching allocator that their outputs do not hold.

    python benchmarks/op_scratch.py --out results/     # on a GPU: the estimator's workloads, seconds
    python benchmarks/op_scratch.py --zoo unet,resnet18_bf16 --out results/   # zoo models: also the segments each op reserves

A fake-tensor estimate sees each operation's inputs and outputs, never the
scratch a CUDA kernel takes from the caching allocator inside the operation
(sort buffers, reduction staging, library workspaces made on first use) and
gives back before returning. This runs one warmed-up training step of each
workload under a dispatch mode that, around every operation, resets the peak
and reads the allocator: ``scratch = peak during the op - max(allocated before,
allocated after)``. It prints, per workload, the operations with scratch,
largest first, with their input shapes, so that the estimator's allowance for
them rests on measurements.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from workloads import build  # noqa: E402


class ScratchMeter(TorchDispatchMode):
    """Per operation: the allocator's peak inside it above both ends."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        peak = torch.cuda.max_memory_allocated()
        scratch = peak - max(before, after)
        if scratch > 0:
            shapes = [f"{tuple(a.shape)}:{str(a.dtype).removeprefix('torch.')}" for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            self.rows.append((str(func), scratch, " ".join(shapes)))
        return out


class ReservedGrowth(TorchDispatchMode):
    """Per operation: what the allocator reserved (new segments) inside it, and its scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - reserved
        scratch = torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated())
        if grown > 0 or scratch > 0:
            shapes = [f"{tuple(a.shape)}:{str(a.dtype).removeprefix('torch.')}" for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
            self.rows.append((str(func), grown, scratch, " ".join(shapes)))
        return out


def zoo_kernel_memory(names: list[str]) -> list[str]:
    """For zoo models at their real size: per operation of the first step (a clean cache), the
    segments it reserved and its scratch; of the third step, its scratch; and the step's figures."""
    from zoo import ZOO
    from zoo.training import Training

    device = torch.device("cuda")
    lines = []
    for name in names:
        entry = ZOO[name]
        why = entry.unavailable()
        if why:
            lines.append(f"## {name}: unavailable ({why})")
            continue
        torch.cuda.empty_cache()
        run = Training(entry, "real", device)
        run.make_batch()
        torch.cuda.synchronize()
        base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        first = ReservedGrowth()
        with first:
            run.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run.step()
        peak2, reserved2 = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
        third = ScratchMeter()
        with third:
            run.step()
        segments = torch.cuda.memory_snapshot()
        sizes = sorted((seg["total_size"] for seg in segments), reverse=True)
        lines.append(f"## {name} (batch {run.batch_size}, {entry.setup}): before the first step allocated {base_allocated:,} reserved {base_reserved:,};"
                     f" second step peak {peak2:,}, reserved after it {reserved2:,}; segments {len(sizes)}: largest {sizes[:12]}, "
                     f"small-pool (2 MiB) {sum(1 for s in sizes if s == 2 << 20)}")
        lines.append("### first step: operations that reserved a segment or took scratch (largest growth first)")
        for op, grown, scratch, shapes in sorted(first.rows, key=lambda r: (-r[1], -r[2]))[:40]:
            lines.append(f"- {op}: reserved +{grown:,} B, scratch {scratch:,} B on {shapes}")
        by_op: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for op, scratch, shapes in third.rows:
            by_op[op].append((scratch, shapes))
        lines.append("### third step: scratch by operation")
        for op, items in sorted(by_op.items(), key=lambda kv: -max(s for s, _ in kv[1])):
            largest = max(items)
            lines.append(f"- {op}: {len(items)} calls, total {sum(s for s, _ in items):,} B, largest {largest[0]:,} B on {largest[1]}")
        del run, first, third
        torch.cuda.empty_cache()
    return lines


def step_with_autocast(workload, dtype):
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        workload.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--zoo", default=None, help="comma-separated zoo models (benchmarks/zoo): their first step's segments and scratch, instead of the workloads")
    args = parser.parse_args()
    if args.zoo:
        text = "\n".join(zoo_kernel_memory(args.zoo.split(",")))
        print(text)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "zoo_kernel_memory.md").write_text(text + "\n")
        return
    device = torch.device("cuda")
    lines = []
    for name in ("gpt2", "resnet50", "neumf", "tiny_mlp"):
        try:
            workload = build(name, device)
        except Exception as err:  # noqa: BLE001 - a missing package skips its workload
            lines.append(f"## {name}: unavailable ({err})")
            continue
        workload.step()
        workload.step()
        meter = ScratchMeter()
        with meter:
            workload.step()
        by_op: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for op, scratch, shapes in meter.rows:
            by_op[op].append((scratch, shapes))
        lines.append(f"## {name}: {workload.description}")
        for op, items in sorted(by_op.items(), key=lambda kv: -max(s for s, _ in kv[1])):
            largest = max(items)
            lines.append(f"- {op}: {len(items)} calls, largest {largest[0]:,} B on {largest[1]}")
        del workload
        torch.cuda.empty_cache()
    # The estimator's test model: FeedForwardStack(512, 4) in bf16 autocast, batch 8 x 256.
    from optimizations import FeedForwardStack

    model = FeedForwardStack(512, 4).to(device)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 256, 512, device=device)
    for i in range(3):
        meter = ScratchMeter()
        with meter if i == 2 else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    lines.append("## FeedForwardStack(512, 4) bf16 autocast, 8 x 256")
    for op, scratch, shapes in sorted(meter.rows, key=lambda r: -r[1])[:15]:
        lines.append(f"- {op}: {scratch:,} B on {shapes}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "op_scratch.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
