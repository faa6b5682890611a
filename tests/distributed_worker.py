"""One rank of the distributed tests: trains small models under the profiler, writes what it saw.

Started by ``torchrun`` (``python -m torch.distributed.run --nproc_per_node 2
--standalone tests/distributed_worker.py --out DIR``) from
``tests/test_distributed.py`` (gloo, CPU) and ``tests/test_distributed_cuda.py``
(NCCL, two GPUs). Each rank writes ``DIR/rank<r>.json``: per scenario, the
profiler's records, the figures computed here independently of it
(``numel() * element_size()``, DDP's real bucket tensors seen by a comm hook,
the allocator), the printed text, the CSV files and the collectives the
profiler ran.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.distributed_overhead import Block  # noqa: E402
from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.torch_versions import FSDP2_ON_CPU  # noqa: E402

EPOCHS = 2
ITERATIONS = 4
PRINT_PERIOD = 2
VOCAB, WIDTH, SEQ = 64, 32, 16


# -- a small transformer -------------------------------------------------------
class TinyTransformer(torch.nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))  # (batch * seq, vocab)


# -- helpers -----------------------------------------------------------------------
def nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def padded_bytes(p: torch.Tensor, world: int) -> int:
    """Bytes of a parameter gathered by FSDP2: dim 0 padded to a multiple of the world size."""
    shape = list(p.shape)
    rows = math.ceil(shape[0] / world) * world if shape else 1
    return rows * math.prod(shape[1:]) * p.element_size()


def record_dict(rec) -> dict:
    keys = (
        "epoch iteration step device allocated peak_allocated peak_cached weights gradients "
        "optimizer_state buffers feature_maps ddp_gradient_buckets fsdp_gathered_parameters rank reported"
    ).split()
    return {k: getattr(rec, k) for k in keys}


class CollectiveCounter:
    """Counts torch.distributed collectives issued while the profiler's own calls run."""

    NAMES = (
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "broadcast_object_list",
        "reduce_scatter_tensor",
        "gather",
        "gather_object",
        "barrier",
    )

    def __init__(self) -> None:
        self.where: str | None = None
        self.calls: dict[str, list[str]] = {"record_stats": [], "epoch_end": []}
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if self.where is not None:
                self.calls[self.where].append(name)
            return original(*args, **kwargs)

        return counted

    def call(self, where: str, fn):
        self.where = where
        try:
            return fn()
        finally:
            self.where = None


def settle(device: torch.device) -> None:
    """Let NCCL's watchdog thread reap finished collectives before the profiler counts.

    NCCL holds a collective's tensors until its watchdog (which wakes every
    100 ms or so) reaps the finished work: temporaries of DDP's start-up
    broadcast or of a barrier would otherwise be freed at an arbitrary moment
    during the training loop, between two readings of the allocator.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(0.5)


def summary_dict(summary) -> dict | None:
    if summary is None:
        return None
    return {
        "epoch": summary.epoch,
        "ranks": [
            {
                "rank": r.rank,
                "host": r.host,
                "device": r.device,
                "peak_cached": r.peak_cached,
                "peak_allocated": r.peak_allocated,
                "largest": list(r.largest_category) if r.largest_category else None,
            }
            for r in summary.ranks
        ],
        "highest": summary.highest.rank if summary.highest is not None else None,
    }


def train(profiler, model, opt, batches, counter, device, extra=None) -> dict:
    """EPOCHS x ITERATIONS steps; the independent figures are taken right after backward."""
    records, grads_after_backward, allocator = [], [], []
    for _ in range(EPOCHS):
        for tokens in batches:
            loss = F.cross_entropy(model(tokens), tokens.flatten())
            loss.backward()
            grads_after_backward.append(
                sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
            )
            opt.step()
            opt.zero_grad()
            rec = counter.call("record_stats", profiler.record_stats)
            if device.type == "cuda":
                allocator.append(torch.cuda.memory_allocated(device))
            records.append(record_dict(rec))
        counter.call("epoch_end", profiler.epoch_end)
    return {
        "records": records,
        "grads_after_backward": grads_after_backward,
        "allocator_allocated": allocator,
        "summary": summary_dict(profiler.cross_rank_summary),
        **(extra or {}),
    }


def make_batches(rank: int, device: torch.device) -> list[torch.Tensor]:
    # Rank 1 takes four times the batch: its feature maps, and so its peak, are the highest.
    g = torch.Generator().manual_seed(rank)
    batch = 2 if rank == 0 else 8
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(device) for _ in range(ITERATIONS)]


# -- scenarios -----------------------------------------------------------------------
def scenario_ddp(args, device, counter, bucket_view: bool, print_ranks) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=bucket_view,
        bucket_cap_mb=0.01,  # several buckets even for a small model
    )
    bucket_bytes: dict[int, int] = {}

    def record_buckets(state, bucket):
        buf = bucket.buffer()
        bucket_bytes[bucket.index()] = buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, record_buckets)
    settle(device)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    out = io.StringIO()
    name = "ddp_view" if bucket_view else "ddp"
    profiler = MemoryProfiler(
        ddp,
        overhead=None,  # every reported iteration measured: the tests assert each one
        print_period=PRINT_PERIOD,
        csv=True,
        csv_dir=Path(args.out) / name,
        stream=out,
        units="B",
        strict=True,
        print_ranks=print_ranks,
    )
    result = train(profiler, ddp, opt, make_batches(rank, device), counter, device)
    profiler.close()
    logged = ddp._get_ddp_logging_data()
    logged_sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
    result.update(
        weights_expected=sum(nbytes(p) for p in model.parameters()),
        buckets_seen=sum(bucket_bytes.values()),
        buckets_seen_count=len(bucket_bytes),
        buckets_logged=sum(int(x) for x in str(logged_sizes).split(",") if x.strip()),
        text=out.getvalue(),
        csv=str(profiler.csv_path),
        device=str(profiler.device),
        file_tag=profiler.file_tag,
    )
    return result


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
    return fully_shard


def scenario_fsdp(args, device, counter) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    fully_shard = _fully_shard()
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    block_bytes = [sum(padded_bytes(p, world) for p in b.parameters()) for b in model.blocks]
    block_param_ids = {id(p) for b in model.blocks for p in b.parameters()}
    root_bytes = sum(padded_bytes(p, world) for p in model.parameters() if id(p) not in block_param_ids)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = io.StringIO()
    profiler = MemoryProfiler(
        model,
        overhead=None,  # every reported iteration measured: the tests assert each one
        print_period=PRINT_PERIOD,
        csv=True,
        csv_dir=Path(args.out) / "fsdp",
        stream=out,
        units="B",
        strict=True,
    )
    result = train(profiler, model, opt, make_batches(rank, device), counter, device)
    profiler.close()
    result.update(
        weights_expected=sum(nbytes(p) for p in model.parameters()),
        full_weights=sum(p.numel() * p.element_size() for p in model.parameters()),
        optimizer_expected=sum(
            nbytes(v) for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.device == device
        ),
        gathered_expected=root_bytes + max(block_bytes),
        text=out.getvalue(),
        csv=str(profiler.csv_path),
    )
    return result


def scenario_pipeline(args, device, counter) -> dict:
    """Two pipeline stages, one per rank: each rank holds only its stage's parameters."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    if rank == 0:
        stage = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), Block(WIDTH)).to(device)
    else:
        stage = torch.nn.Sequential(Block(WIDTH), Block(WIDTH), torch.nn.Linear(WIDTH, VOCAB)).to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    out = io.StringIO()
    profiler = MemoryProfiler(
        stage, print_period=PRINT_PERIOD, csv=True, csv_dir=Path(args.out) / "pipeline",
        overhead=None,  # every reported iteration measured: the tests assert each one
        stream=out, units="B", strict=True,
    )
    tokens = make_batches(0, device)[0]
    records, grads = [], []
    for _ in range(EPOCHS):
        for _ in range(ITERATIONS):
            if rank == 0:
                acts = stage(tokens)
                dist.send(acts.detach().contiguous(), dst=1)
                grad = torch.empty_like(acts)
                dist.recv(grad, src=1)
                acts.backward(grad)
            else:
                acts = torch.empty(tokens.shape[0], SEQ, WIDTH, device=device, requires_grad=True)
                dist.recv(acts.data, src=0)
                loss = F.cross_entropy(stage(acts).flatten(0, 1), tokens.flatten())
                loss.backward()
                dist.send(acts.grad.contiguous(), dst=0)
            grads.append(sum(nbytes(p.grad) for p in stage.parameters() if p.grad is not None))
            opt.step()
            opt.zero_grad()
            records.append(record_dict(counter.call("record_stats", profiler.record_stats)))
        counter.call("epoch_end", profiler.epoch_end)
    profiler.close()
    return {
        "records": records,
        "grads_after_backward": grads,
        "weights_expected": sum(nbytes(p) for p in stage.parameters()),
        "summary": summary_dict(profiler.cross_rank_summary),
        "text": out.getvalue(),
        "csv": str(profiler.csv_path),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--scenarios", default="ddp,ddp_view,fsdp,pipeline")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    counter = CollectiveCounter()
    results: dict = {"rank": rank, "world_size": dist.get_world_size(), "torch": torch.__version__}
    for name in args.scenarios.split(","):
        started = time.perf_counter()
        try:
            if name == "ddp":
                results[name] = scenario_ddp(args, device, counter, False, 0)
            elif name == "ddp_view":
                results[name] = scenario_ddp(args, device, counter, True, "all")
            elif name == "fsdp" and device.type == "cpu" and not FSDP2_ON_CPU:
                results[name] = {"skipped": f"FSDP2 on the CPU needs torch >= 2.6, not {torch.__version__}"}
            elif name == "fsdp":
                results[name] = scenario_fsdp(args, device, counter)
            elif name == "pipeline":
                results[name] = scenario_pipeline(args, device, counter)
            else:
                raise ValueError(f"unknown scenario {name!r}")
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {rank}] scenario {name} failed:\n{results[name]['error']}", file=sys.stderr)
        results[name]["seconds"] = time.perf_counter() - started
        dist.barrier()
        settle(device)
    results["collectives"] = counter.calls
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    # Leave without the interpreter's finalization: there, gloo's threads
    # sometimes abort the process ("terminate called without an active
    # exception"), with or without the profiler, after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
