"""Each rank's estimated peak against a real two-GPU run: DDP and FSDP2, float32 and bf16 mixed precision.

DDP in float32 (buckets copied, or the gradients their views), under bf16 autocast, with
BatchNorm's buffers and with position tables as buffers (broadcast before each forward);
FSDP2 resharding after forward or not, float32 or bf16 parameters with float32 reduction.

For each scenario, its own ``torchrun --nproc-per-node 2`` with NCCL on
``tests/parallel_estimate_worker.py --warmup`` (a fresh process: nothing of another
scenario in the allocator, the cuBLAS workspaces taken afresh). Each rank measures the
caching allocator's peak over two steady AdamW steps (after two first steps and a wait
for the device and NCCL's watchdog) above what was allocated before the model was built,
each phase's peak, and its shards' and optimizer state's bytes. The same rank is
estimated with ``estimate_memory(parallel=..., world_size=2, rank=r, device="cuda")``.
Writes ``OUT/parallel_estimate.md`` (the table and, per rank, the estimate's breakdown
against the measured phases) and ``OUT/parallel_estimate.json``; each launch's output is
in ``OUT/ranks/<scenario>/log.txt``. A scenario that fails is reported and the rest run::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/parallel_estimate_accuracy.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

#: a model big enough that the step is hundreds of MB per rank: width, hidden width, blocks
SIZES = {"width": 1024, "hidden": 4096, "layers": 6}
#: the goal of the estimate across ranks: each rank's peak within this fraction of the real one
TOLERANCE = 0.03
SCENARIO_NAMES = "ddp,ddp_view,ddp_bf16,ddp_bn,ddp_tables,fsdp2,fsdp2_keep,fsdp2_bf16"
_MB = 1e6


def launch(name: str, out: Path, timeout_s: float, backend: str = "nccl", sizes: dict = SIZES) -> dict[int, dict]:
    """Run one scenario on two GPUs; each rank's figures (``{"error": ...}`` where it failed)."""
    folder = out / "ranks" / name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        str(ROOT / "tests" / "parallel_estimate_worker.py"), "--out", str(folder), "--backend", backend,
        "--scenarios", name, "--sizes", json.dumps(sizes), "--warmup",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "NCCL_NVLS_ENABLE": "0"}
    # torchrun and its workers in a session of their own: past the timeout all of them are stopped,
    # none left holding a GPU for the next scenario
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        log = f"$ {' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        log = f"$ {' '.join(cmd)}\ntimed out after {timeout_s} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    (folder / "log.txt").write_text(log)
    ranks = {}
    for r in (0, 1):
        path = folder / f"rank{r}.json"
        if not path.exists():
            ranks[r] = {"error": f"no {path.name}; see {folder / 'log.txt'}:\n{log[-3000:]}"}
            continue
        ranks[r] = json.loads(path.read_text()).get(name, {"error": f"{path} has no {name}"})
    return ranks


def estimate(name: str, rank: int, device: str = "cuda", sizes: dict = SIZES, world_size: int = 2):
    """The estimate of ``rank`` of ``world_size`` for the scenario, with the benchmark's model."""
    import torch

    from parallel_estimate_worker import BATCH, SCENARIOS, SEQ, build, loss_fn
    from pytorch_mem_profiler.estimate import estimate_memory

    scenario = SCENARIOS[name]
    model = {**scenario.model, **sizes}

    def tokens(b: int) -> torch.Tensor:
        return torch.zeros(b, SEQ, dtype=torch.long)

    return estimate_memory(
        lambda: build(**model), tokens, batch_size=BATCH, loss_fn=loss_fn, targets=tokens, optimizer=torch.optim.AdamW,
        device=device, fit=False, parallel=scenario.plan(), world_size=world_size, rank=rank, autocast=scenario.autocast,
    )  # fmt: skip


def compare(name: str, rank: int, real: dict, device: str = "cuda", sizes: dict = SIZES) -> dict:
    """One rank's row: the estimate against the measured figures, with what explains a gap."""
    row: dict = {"scenario": name, "rank": rank}
    if "error" in real:
        row["failed"] = "run: " + real["error"][-3000:]
        return row
    try:
        est = estimate(name, rank, device, sizes)
    except Exception:  # noqa: BLE001 - one scenario's failure is reported, the others go on
        row["failed"] = "estimate: " + traceback.format_exc()[-3000:]
        return row
    measured = real["peak"]
    row.update(
        gpu=real["gpu"] or real["device"],
        estimated=est.peak_allocated,
        measured=measured,
        error=(est.peak_allocated - measured) / measured,
        within=abs(est.peak_allocated - measured) <= TOLERANCE * measured,
        first_steps_peak=real.get("first_steps_peak"),
        weights=[est.weights, real["weights"]],
        optimizer_state=[est.optimizer_state, real["optimizer_state"]],
        estimate={
            "peak_phase": est.peak_phase,
            "phases": {k: v + est.workspace for k, v in est.phases.items()},  # as the allocator counts
            "breakdown": dict(est.peak_breakdown),
            "parallel_parts": dict(est.parallel_parts),
            "workspace": est.workspace,
            "kernel_scratch": est.kernel_scratch,
            "gradients": est.gradients,
        },
        measured_phases=_phase_peaks(real.get("phases", [])),
        before_steps=real.get("before_steps"),
        end=real.get("end"),
        memory_stats=real.get("memory_stats", {}),
    )
    return row


def _phase_peaks(rows: list[dict]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for r in rows:
        if r["phase"] != "end":
            peaks[r["phase"]] = max(peaks.get(r["phase"], 0), r["peak"])
    return peaks


def report(rows: list[dict]) -> str:
    lines = [
        "| scenario | rank | GPU | estimated peak (MB) | measured peak (MB) | error | first two steps' peak (MB) | weights est/real (MB) | optimizer state est/real (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['scenario']} | {row['rank']} | failed: {row['failed'].strip().splitlines()[-1][:120]} | | | | | | |")
            continue
        first = row["first_steps_peak"]
        lines.append(
            f"| {row['scenario']} | {row['rank']} | {row['gpu']} | {row['estimated'] / _MB:.2f} | {row['measured'] / _MB:.2f} "
            f"| {100 * row['error']:+.2f}% | {first / _MB if first is not None else float('nan'):.2f} "
            f"| {row['weights'][0] / _MB:.2f} / {row['weights'][1] / _MB:.2f} "
            f"| {row['optimizer_state'][0] / _MB:.2f} / {row['optimizer_state'][1] / _MB:.2f} |"
        )
    lines += ["", "Per rank: the estimate's phases (workspaces included) against each phase's measured peak; the breakdown at the estimate's peak (MB).", ""]
    for row in rows:
        if "failed" in row:
            lines += [f"### {row['scenario']} rank {row['rank']}: failed", "", "```", row["failed"], "```", ""]
            continue
        e = row["estimate"]
        phases = sorted(set(e["phases"]) | set(row["measured_phases"]))
        lines.append(f"### {row['scenario']} rank {row['rank']} (estimated peak in {e['peak_phase']})")
        lines.append("")
        lines.append("| phase | estimated | measured | difference |")
        lines.append("| --- | --- | --- | --- |")
        for ph in phases:
            a, b = e["phases"].get(ph), row["measured_phases"].get(ph)
            diff = f"{(a - b) / _MB:+.2f}" if a is not None and b is not None else ""
            lines.append(f"| {ph} | {a / _MB if a is not None else float('nan'):.2f} | {b / _MB if b is not None else float('nan'):.2f} | {diff} |")
        parts = {**e["breakdown"], **{f"of other: {k}": v for k, v in e["parallel_parts"].items()}}
        parts.update(workspace=e["workspace"], kernel_scratch=e["kernel_scratch"])
        lines.append("")
        lines.append("breakdown: " + ", ".join(f"{k} {v / _MB:.2f}" for k, v in parts.items()))
        stats = row["memory_stats"]
        keys = ("allocated_bytes.all.current", "active_bytes.all.peak", "requested_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries")
        lines.append("memory_stats at the end: " + ", ".join(f"{k} {stats.get(k)}" for k in keys))
        lines.append(f"before the steps {row['before_steps'] / _MB:.2f}, at the end {row['end'] / _MB:.2f} (MB)")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT)")
    parser.add_argument("--scenarios", default=SCENARIO_NAMES)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one scenario's launch may take")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU with the tests' small model (a dry run)")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out (or $OUT) is needed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.scenarios.split(","):
        backend, device, sizes = ("gloo", "cpu", {}) if args.cpu else ("nccl", "cuda", SIZES)
        real = launch(name, out, args.timeout, backend, sizes)
        for r in (0, 1):
            rows.append(compare(name, r, real[r], device, sizes))
        print(f"{name}: " + "; ".join(
            f"rank {row['rank']} " + (f"{100 * row['error']:+.2f}%" if "error" in row else "failed")
            for row in rows[-2:]
        ), flush=True)  # fmt: skip
    text = report(rows)
    (out / "parallel_estimate.md").write_text(text)
    (out / "parallel_estimate.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return rows


if __name__ == "__main__":
    main()
