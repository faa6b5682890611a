"""One rank of a real DDP or FSDP2 run, measured, for the per-rank estimate's tests and benchmark.

Started by ``torchrun`` (``python -m torch.distributed.run --nproc_per_node 2 --standalone
tests/parallel_estimate_worker.py --out DIR --scenarios ddp,fsdp2``) from
``tests/test_estimate_parallel.py`` (gloo, CPU) and ``benchmarks/parallel_estimate_accuracy.py``
(NCCL, two GPUs, one launch per scenario). Each rank writes ``DIR/rank<r>.json``: per
scenario, the peak over two training steps above what was allocated before the model was
built (the CPU counter, started before the model is built, on the CPU; the caching
allocator's peak on a GPU, where ``--warmup`` first runs two steps, waits for the device
and NCCL, and then measures two more: the steady state, DDP's bucket rebuild behind it),
each phase's peak and ``torch.cuda.memory_stats`` figures on a GPU, and independent
figures: the bytes of the rank's parameter shards and optimizer state, from their storages.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytorch_mem_profiler.estimate.parallel import FSDP2, fully_shard_function  # noqa: E402
from pytorch_mem_profiler.measure.devices import CpuCounter  # noqa: E402
from tests.helpers import local_storage_bytes  # noqa: E402

BATCH = 8
STEPS = 2
VOCAB, WIDTH, HIDDEN, SEQ = 101, 48, 130, 12  # odd sizes: FSDP2 pads dim 0 to a multiple of the world


class Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """An embedding, repeated blocks and a head: the shape FSDP2 users wrap block by block."""

    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x).flatten(0, 1)


def build(width: int = WIDTH, hidden: int = HIDDEN, layers: int = 3) -> Net:
    torch.manual_seed(0)
    return Net(width, hidden, layers)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), targets.flatten())


#: scenario -> (parallel, settings)
SCENARIOS = {
    "ddp": ("ddp", {}),
    "ddp_view": ("ddp", {"gradient_as_bucket_view": True}),
    "fsdp2": ("fsdp2", {}),
    "fsdp2_keep": ("fsdp2", {"reshard_after_forward": False}),
    "fsdp2_bf16": ("fsdp2", {"mixed_precision": "bf16"}),
}


#: ``torch.cuda.memory_stats`` keys kept for each phase and at the end (bytes, since the last reset)
CUDA_STATS = (
    "allocated_bytes.all.current", "allocated_bytes.all.peak", "active_bytes.all.peak",
    "requested_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries",
)  # fmt: skip


def _cuda_drained(device: torch.device) -> None:
    """Wait until nothing of an earlier step is still held: the device idle, Python's cycles
    collected, and ProcessGroupNCCL's watchdog past its next round (it drops the finished
    collectives' work objects, and with them the tensors they kept alive: every 100 ms in
    recent versions, every second in older ones' cleanup thread)."""
    torch.cuda.synchronize(device)
    gc.collect()
    dist.barrier()
    time.sleep(1.1)
    gc.collect()
    torch.cuda.synchronize(device)


class _Phases:
    """Each phase's peak (bytes above ``base``): on CUDA the allocator's peak since the phase
    began (reset at each boundary), on the CPU the counter's reading at the boundary."""

    def __init__(self, device: torch.device, base: int, counter: CpuCounter | None) -> None:
        self.device, self.base, self.counter = device, base, counter
        self.rows: list[dict] = []
        self.peak = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = 0

    def mark(self, step: int, phase: str) -> None:
        if self.device.type != "cuda":
            return  # the CPU counter's peak over the steps is read once, at the end
        stats = torch.cuda.memory_stats(self.device)
        peak = stats["allocated_bytes.all.peak"] - self.base
        self.peak = max(self.peak, peak)
        row = {"step": step, "phase": phase, "peak": peak, "allocated": stats["allocated_bytes.all.current"] - self.base}
        row.update({k: stats.get(k, 0) for k in CUDA_STATS})
        self.rows.append(row)
        torch.cuda.reset_peak_memory_stats(self.device)


def run(name: str, device: torch.device, sizes: dict, warmup: bool = False) -> dict:
    """One scenario: build, wrap, (with ``warmup``: ``STEPS`` steps first), then ``STEPS`` measured steps.

    On CUDA everything is measured from ``base``, what was allocated before the model was
    built (with a previous scenario's tensors collected): the cuBLAS workspaces a first
    matmul takes count, as the estimate counts them. After the warm-up steps the run waits
    for the device and NCCL's watchdog (:func:`_cuda_drained`) so that the measured steps
    are the steady state the estimate's two steps model (DDP rebuilds its buckets before
    its second forward; the first step's may live on in NCCL's work objects for a while).
    """
    parallel, settings = SCENARIOS[name]
    counter = CpuCounter() if device.type == "cpu" else None
    if counter is not None:
        counter.start()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        with torch.device(device):
            model = build(**sizes)
        if parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(
                model,
                device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=settings.get("gradient_as_bucket_view", False),
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh

            from pytorch_mem_profiler.estimate.parallel import _mixed_precision_policy

            plan = FSDP2(**settings)
            fully_shard = fully_shard_function()
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            kwargs = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward}
            if plan.mixed_precision is not None:
                kwargs["mp_policy"] = _mixed_precision_policy(torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            wrapped = model
        opt = torch.optim.AdamW(wrapped.parameters())
        g = torch.Generator().manual_seed(dist.get_rank())
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
        targets = tokens.clone()  # the estimate's targets are a tensor of their own
        phases = _Phases(device, base, counter)
        cuda = device.type == "cuda"
        if cuda:
            _cuda_drained(device)  # DDP's broadcast of the weights at wrapping: its buffers gone
        before = torch.cuda.memory_allocated(device) - base if cuda else counter.mark().allocated

        def step(i: int) -> None:
            # the step as the estimate runs it: the output and the loss kept until the step ends
            output = wrapped(tokens)
            phases.mark(i, "forward")
            loss = loss_fn(output, targets)
            phases.mark(i, "other")
            loss.backward()
            phases.mark(i, "backward")
            opt.step()
            phases.mark(i, "optimizer")
            opt.zero_grad(set_to_none=True)
            del output, loss
            phases.mark(i, "other")

        phases.reset()
        first_steps_peak = None
        measured = range(STEPS)
        if warmup:
            for i in range(STEPS):
                step(i)  # the first steps as a user's run has them (DDP's bucket rebuild and all)
            if cuda:
                torch.cuda.synchronize(device)
                first_steps_peak = phases.peak
                _cuda_drained(device)
            phases.reset()
            measured = range(STEPS, 2 * STEPS)
        for i in measured:
            step(i)
        if cuda:
            torch.cuda.synchronize(device)
            phases.mark(-1, "end")
            peak = phases.peak
            end = torch.cuda.memory_allocated(device) - base
        else:
            reading = counter.read()
            peak, end = reading.peak_allocated, reading.allocated
        params = list(wrapped.parameters())
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        result = {
            "peak": peak,
            "end": end,
            "before_steps": before,
            "base": base,
            "warmup_steps": STEPS if warmup else 0,
            "first_steps_peak": first_steps_peak,
            "weights": local_storage_bytes(params),
            "optimizer_state": local_storage_bytes(state),
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
        }
        if cuda:
            result["phases"] = phases.rows
            result["memory_stats"] = {k: v for k, v in torch.cuda.memory_stats(device).items() if k.endswith(".all.current") or k.endswith(".all.peak") or k.startswith("num_")}
        del wrapped, model, opt, params, state
        return result
    finally:
        if counter is not None:
            counter.stop()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--sizes", default="{}", help="JSON keyword arguments of build()")
    parser.add_argument(
        "--warmup", action="store_true",
        help="run STEPS steps first (their peak kept as first_steps_peak), wait for the device, then measure",
    )  # fmt: skip
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    sizes = json.loads(args.sizes)
    results: dict = {"rank": rank, "world_size": dist.get_world_size(), "torch": torch.__version__}
    for name in args.scenarios.split(","):
        started = time.perf_counter()
        try:
            results[name] = run(name, device, sizes, args.warmup)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {rank}] {name} failed:\n{results[name]['error']}", file=sys.stderr)
        results[name]["seconds"] = time.perf_counter() - started
        dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort the interpreter's finalization


if __name__ == "__main__":
    main()
