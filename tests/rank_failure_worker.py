"""A rank of the torchrun rank-failure test (``tests/test_rank_failure.py``); not a test itself.

Both ranks train a small CPU model (gloo), profiled with ``print_period=1`` and
``by_layer=True``. After each ``record_stats()`` a rank appends ``epoch
iteration`` to ``<out>/rank<r>.reported`` (one ``os.write``: in the file the
moment it returns). At iteration 3, rank 0 enters the step (forward done) and
waits there; rank 1 raises, so torchrun sends SIGTERM to rank 0 mid-step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pytorch_mem_profiler import memory_profiler


def note(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    profiler = memory_profiler(
        model, 1, True, csv_dir=out / "csv", by_layer=True, stream=open(os.devnull, "w"), overhead=None
    )
    note(out / f"rank{rank}.files", f"{profiler.csv_path} {profiler.layers_csv_path}")
    reported = out / f"rank{rank}.reported"
    for iteration in range(1, 11):
        dist.barrier()  # both ranks start iteration 3 together
        loss = model(torch.randn(8, 16)).pow(2).mean()
        if iteration == 3:
            if rank == 1:
                raise RuntimeError("rank 1 fails at iteration 3")
            note(out / "rank0.in_step", "3")
            time.sleep(120)  # inside the step: torchrun's SIGTERM ends it before this does
            note(out / "rank0.woke", "3")
        loss.backward()
        for p in model.parameters():  # the gradients averaged over the ranks, inside the step
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        record = profiler.record_stats()
        assert record is not None
        note(reported, f"{record.epoch} {record.iteration}")
    profiler.epoch_end()
    profiler.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
