"""Each rank's estimated peak against a real two-GPU run: DDP and FSDP2, float32 and bf16 mixed precision.

Starts ``torchrun --nproc-per-node 2`` with NCCL on ``tests/parallel_estimate_worker.py``
(each rank's ``torch.cuda.max_memory_allocated`` over two AdamW steps, less what was
allocated before the model was built), estimates the same rank with
``estimate_memory(parallel=..., world_size=2, rank=r, device="cuda")``, and writes
``OUT/parallel_estimate.md`` and ``OUT/parallel_estimate.json``::

    NCCL_NVLS_ENABLE=0 python benchmarks/parallel_estimate_accuracy.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

#: a model big enough that the step is tens of MB per rank: width, hidden width, blocks
SIZES = {"width": 1024, "hidden": 4096, "layers": 6}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="ddp,ddp_view,fsdp2,fsdp2_keep,fsdp2_bf16")
    args = parser.parse_args(argv)
    out = Path(args.out)
    runs = out / "ranks"
    runs.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        str(ROOT / "tests" / "parallel_estimate_worker.py"), "--out", str(runs), "--backend", "nccl",
        "--scenarios", args.scenarios, "--sizes", json.dumps(SIZES),
    ]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0"}
    subprocess.run(cmd, check=True, env=env, timeout=180)
    import torch

    from parallel_estimate_worker import BATCH, SCENARIOS, SEQ, build, loss_fn
    from pytorch_mem_profiler.estimate import estimate_memory
    from pytorch_mem_profiler.estimate.parallel import DDP, FSDP2

    def tokens(b: int) -> torch.Tensor:
        return torch.zeros(b, SEQ, dtype=torch.long)

    rows = []
    for name in args.scenarios.split(","):
        parallel, settings = SCENARIOS[name]
        plan = DDP(**settings) if parallel == "ddp" else FSDP2(**settings)
        for r in (0, 1):
            real = json.loads((runs / f"rank{r}.json").read_text())[name]
            if "error" in real:
                rows.append({"scenario": name, "rank": r, "error": real["error"][-2000:]})
                continue
            est = estimate_memory(
                lambda: build(**SIZES), tokens, batch_size=BATCH, loss_fn=loss_fn, targets=tokens,
                optimizer=torch.optim.AdamW, device="cuda", fit=False, parallel=plan, world_size=2, rank=r,
            )  # fmt: skip
            error = (est.peak_allocated - real["peak"]) / real["peak"]
            rows.append({
                "scenario": name, "rank": r, "gpu": real["gpu"], "estimated": est.peak_allocated,
                "measured": real["peak"], "error": error, "weights": [est.weights, real["weights"]],
                "optimizer_state": [est.optimizer_state, real["optimizer_state"]],
            })  # fmt: skip
    lines = [
        "| scenario | rank | GPU | estimated peak (MB) | measured max_memory_allocated (MB) | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "error" in row and isinstance(row["error"], str):
            lines.append(f"| {row['scenario']} | {row['rank']} | failed | | | |")
            continue
        lines.append(
            f"| {row['scenario']} | {row['rank']} | {row['gpu']} | {row['estimated'] / 1e6:.2f} | "
            f"{row['measured'] / 1e6:.2f} | {100 * row['error']:+.2f}% |"
        )
    (out / "parallel_estimate.md").write_text("\n".join(lines) + "\n")
    (out / "parallel_estimate.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
