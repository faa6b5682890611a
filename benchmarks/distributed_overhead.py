"""The profiler's per-iteration overhead on one GPU and under DDP on two, side by side.

Trains a small GPT-like transformer without and with the profiler in
alternating rounds (so drift in clocks and temperature hits both alike) and
reports the median, over rounds, of the ratio of the per-iteration times
(with / without). Run it on a machine with two GPUs::

    python benchmarks/distributed_overhead.py --rounds 5 --iterations 30 --json overhead.json

It measures one GPU in this process, then starts itself on two GPUs with
``torchrun`` (NCCL, with ``NCCL_NVLS_ENABLE=0``) and prints both::

    one GPU:        9.81 ms without, 10.02 ms with the profiler: ratio 1.021
    DDP, 2 GPUs:   11.40 ms without, 11.61 ms with the profiler: ratio 1.018
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402


class Block(torch.nn.Module):
    """Pre-norm attention and MLP, the shape of a GPT block (the distributed tests use it too)."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SmallGPT(torch.nn.Module):
    def __init__(self, vocab: int = 1024, width: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).flatten(0, 1))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iterations(model, opt, tokens, iterations: int, profiler=None) -> float:
    """Seconds per iteration, the GPU synchronized at both ends."""
    synchronize(tokens.device)
    start = time.perf_counter()
    for _ in range(iterations):
        loss = F.cross_entropy(model(tokens), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if profiler is not None:
            profiler.record_stats()
    synchronize(tokens.device)
    return (time.perf_counter() - start) / iterations


def measure(args: argparse.Namespace, distributed: bool) -> dict:
    """Alternating rounds without and with the profiler, in this process (one rank)."""
    rank, world = 0, 1
    on_gpu = args.device == "cuda"
    if distributed:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        if on_gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if on_gpu else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = SmallGPT(width=args.width, layers=args.layers).to(device)
    if distributed:
        model = DDP(model, device_ids=[device.index] if on_gpu else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1024, (args.batch, args.seq), device=device)
    time_iterations(model, opt, tokens, args.warmup)
    without, with_profiler = [], []
    sink = open(os.devnull, "w")
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for profiled in order:
            if profiled:
                profiler = MemoryProfiler(model, print_period=args.print_period, stream=sink)
                # One iteration first: the hooks' first calls and the optimizer
                # state's first count are start-up, not per-iteration, costs.
                time_iterations(model, opt, tokens, 1, profiler)
                with_profiler.append(time_iterations(model, opt, tokens, args.iterations, profiler))
                profiler.epoch_end()  # a collective under DDP: every rank calls it
                profiler.close()
            else:
                without.append(time_iterations(model, opt, tokens, args.iterations))
    sink.close()
    ratios = [w / wo for w, wo in zip(with_profiler, without)]
    result = {
        "world_size": world,
        "rounds": args.rounds,
        "iterations": args.iterations,
        "ms_without": statistics.median(without) * 1e3,
        "ms_with": statistics.median(with_profiler) * 1e3,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
    }
    if distributed:
        import torch.distributed as dist

        del model, opt  # DDP goes before the process group it uses
        dist.destroy_process_group()
    if rank == 0 and args.worker_json:
        Path(args.worker_json).write_text(json.dumps(result))
    return result


def launch_ddp(args: argparse.Namespace, gpus: int) -> dict:
    """This script on ``gpus`` GPUs under torchrun; rank 0's result."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ddp.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
            "--standalone", str(Path(__file__).resolve()), "--worker",
            "--worker-json", str(out), "--rounds", str(args.rounds),
            "--iterations", str(args.iterations), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--seq", str(args.seq),
            "--print-period", str(args.print_period), "--device", args.device,
            "--width", str(args.width), "--layers", str(args.layers),
        ]  # fmt: skip
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
        proc = subprocess.Popen(cmd, env=env)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its workers on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            sys.exit(f"the DDP run did not finish in {args.timeout} s")
        if code != 0:
            sys.exit(f"the DDP run failed with exit code {code}")
        return json.loads(out.read_text())


def line(label: str, r: dict) -> str:
    return (
        f"{label:<14}{r['ms_without']:7.2f} ms without, {r['ms_with']:7.2f} ms with the profiler: "
        f"ratio {r['ratio']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 3)")
    parser.add_argument("--iterations", type=int, default=30, help="iterations per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--print-period", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs (processes) for the DDP run")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a gloo smoke run, no timing claim"
    )
    parser.add_argument("--json", help="write both results here")
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 for a median, got {args.rounds}")
    if args.worker:
        measure(args, distributed=True)
        # Skip the interpreter's finalization, where gloo's threads sometimes
        # abort a finished process (the NCCL runs do not need it, the gloo smoke run does).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} CUDA GPUs, found {torch.cuda.device_count()}")
    args.worker_json = None
    single = measure(args, distributed=False)
    ddp = launch_ddp(args, args.gpus)
    if args.device == "cuda":
        labels = ("one GPU:", f"DDP, {args.gpus} GPUs:")
    else:
        labels = ("one process:", f"DDP, {args.gpus} procs:")
    print(line(labels[0], single))
    print(line(labels[1], ddp))
    if args.json:
        Path(args.json).write_text(json.dumps({"single_gpu": single, "ddp": ddp}, indent=1))


if __name__ == "__main__":
    main()
