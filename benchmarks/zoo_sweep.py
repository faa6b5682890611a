"""The CPU checks on the sweep's 78 models (``benchmarks/zoo/sweep.py``), and on each in other set-ups.

For each model, on the CPU, each a line of ``name: check ok | check FAILED: why``:

- ``record``: three profiled iterations against the independent counts (``checks.check_record``);
- ``estimate``: ``estimate_memory(device="cpu")`` equals the measured peak to the byte;
- ``emulated``: the CUDA estimate without a GPU adds up (``checks.check_emulated_estimate``);
- ``swapped``: the record and the estimate again with the other optimizer (AdamW for SGD with
  momentum and back) and bf16 autocast switched;
- ``checkpointing``: ``estimate_memory(checkpointing=True)`` equals the measured peak of the same
  model checkpointed for real (``estimate.step.checkpoint_blocks``, which the estimate applies);
- ``unchanged``: three training steps with the profiler (default, then ``by_layer=True``) give the
  losses and weights of three without it, bit for bit;
- ``largest_batch``: under a limit of six times the measured step at batch 2, the largest batch
  the estimate finds on the CPU (``max_batch_size(limit, margin=0)``, verified with fake steps)
  measures within the limit, and the batch 1% larger (one more, below 200) does not: the search
  stops once its bracket is that narrow.

Usage::

    python benchmarks/zoo_sweep.py                    # every model, every check (about 45 minutes on two cores)
    python benchmarks/zoo_sweep.py --only gemma2 tcn  # models whose names contain these
    python benchmarks/zoo_sweep.py --checks estimate checkpointing
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import random
import sys
import time
from pathlib import Path
from typing import Callable

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zoo.checks import (  # noqa: E402
    CPU,
    Iteration,
    check_cpu_estimate,
    check_emulated_estimate,
    check_record,
    measured_peak,
    profiled_run,
    refused_as_named,
)
from benchmarks.zoo.registry import ADAMW, SGD_MOMENTUM, ZooModel  # noqa: E402
from benchmarks.zoo.training import Training  # noqa: E402
from benchmarks.zoo.sweep import SWEEP  # noqa: E402
from pytorch_mem_profiler import estimate_memory, memory_profiler  # noqa: E402
from pytorch_mem_profiler.estimate.step import checkpoint_blocks  # noqa: E402


_RUNS: dict[str, tuple[Iteration, ...]] = {}


def _profiled(entry: ZooModel) -> tuple[Iteration, ...]:
    """``entry``'s profiled run, made once for the record's check and the estimate's (:func:`main`
    lets go of it after the model's checks)."""
    if entry.name not in _RUNS:
        _RUNS[entry.name] = profiled_run(entry)
    return _RUNS[entry.name]


def _estimate(entry: ZooModel) -> None:
    check_cpu_estimate(entry, _profiled(entry))


def _record(entry: ZooModel) -> None:
    check_record(entry, _profiled(entry))


def _swapped(entry: ZooModel) -> None:
    other = dataclasses.replace(
        entry,
        optimizer=SGD_MOMENTUM if entry.optimizer is ADAMW else ADAMW,
        autocast=None if entry.autocast is torch.bfloat16 else torch.bfloat16,
    )
    try:
        runs = profiled_run(other)
    except Exception as real_error:  # noqa: BLE001 - the model itself refuses the other settings
        # (BigBird's block-sparse attention under bf16 autocast scatters bf16 into fp32): the estimate
        # must refuse them too, not give a figure for a step that cannot run
        try:
            estimate_memory(**dict(other.estimate_kwargs("small"), batch_size=other.batch["small"], device="cpu", fit=False))
        except Exception:  # noqa: BLE001 - refused, as the real step is
            return
        raise AssertionError(f"the real step fails with the other settings ({type(real_error).__name__}: {real_error}), the estimate gave a figure")
    check_record(other, runs)
    check_cpu_estimate(other, runs)


def _checkpointing(entry: ZooModel) -> None:
    if refused_as_named(entry, fit=False, checkpointing=True):
        return

    def checkpointed(size: str) -> torch.nn.Module:
        model = entry.build(size)
        checkpoint_blocks(model, True)
        return model

    measured = measured_peak(profiled_run(dataclasses.replace(entry, build=checkpointed)))
    est = estimate_memory(**dict(entry.estimate_kwargs("small"), batch_size=entry.batch["small"], device="cpu", fit=False, checkpointing=True))
    assert est.peak == measured, f"estimated {est.peak:,} B, measured {measured:,} B"


def _train(entry: ZooModel, by_layer: bool | None) -> tuple[list[float], list[torch.Tensor]]:
    """Three steps from the same seeds, a new batch each: the losses and the weights after
    (``by_layer=None``: unprofiled)."""
    run = Training(entry, "small", CPU)
    profiler = None
    if by_layer is not None:
        profiler = memory_profiler(run.model, print_period=1, by_layer=by_layer, stream=io.StringIO(), strict=True, optimizer=run.optimizer, overhead=None)  # fmt: skip
    losses = []
    try:
        for step in range(3):
            # seeded at each step: a model may seed the generator itself (Reformer's torch.seed()
            # in training) or draw outside torch (SEW's SpecAugment masks, by numpy)
            torch.manual_seed(1 + step)
            random.seed(1 + step)
            numpy.random.seed(1 + step)
            run.make_batch()
            losses.append(run.step())
            if profiler is not None:
                profiler.record_stats()
    finally:
        if profiler is not None:
            profiler.close()
    return losses, [p.detach().clone() for p in run.model.parameters()]


def _unchanged(entry: ZooModel) -> None:
    plain = _train(entry, None)
    for by_layer in (False, True):
        losses, weights = _train(entry, by_layer)
        same = losses == plain[0] and all(map(torch.equal, plain[1], weights))
        assert same, f"by_layer={by_layer}: the profiled run computed other losses or weights"


def _measured_at(entry: ZooModel, batch: int) -> int:
    return measured_peak(profiled_run(dataclasses.replace(entry, batch={"small": batch, "real": batch})))


def _largest_batch(entry: ZooModel) -> None:
    if refused_as_named(entry, fit=True, outside=0):
        return
    limit = 6 * _measured_at(entry, 2)
    est = estimate_memory(**dict(entry.estimate_kwargs("small"), batch_size=2, device="cpu", fit=True, outside=0))
    batch = est.max_batch_size(limit, margin=0.0, outside=0)
    # the search stops once its bracket is within 1% of the batch, or 1 (estimate.result._bisect)
    larger = batch + max(1, int(batch * 0.01))
    at, above = _measured_at(entry, batch), _measured_at(entry, larger)
    assert at <= limit < above, f"limit {limit:,} B: batch {batch} measures {at:,} B, batch {larger} {above:,} B"


CHECKS: dict[str, Callable[[ZooModel], None]] = {
    "record": _record,
    "estimate": _estimate,
    "emulated": check_emulated_estimate,
    "swapped": _swapped,
    "checkpointing": _checkpointing,
    "unchanged": _unchanged,
    "largest_batch": _largest_batch,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="models whose names contain one of these")
    parser.add_argument("--checks", nargs="*", choices=sorted(CHECKS), default=list(CHECKS), help="which checks (default: all)")
    args = parser.parse_args(argv)
    failed = 0
    for name, entry in SWEEP.items():
        if args.only and not any(part in name for part in args.only):
            continue
        why = entry.unavailable()
        if why:
            print(f"{name}: skipped ({why})", flush=True)
            continue
        started, results = time.time(), []
        for check in args.checks:
            try:
                CHECKS[check](entry)
                results.append(f"{check} ok")
            except Exception as err:  # a line per model: one failure does not stop the sweep
                failed += 1
                results.append(f"{check} FAILED: {type(err).__name__}: {str(err)[:300]}")
        _RUNS.clear()
        print(f"{name} ({time.time() - started:.0f} s): " + " | ".join(results), flush=True)
    print(f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
