"""Under torchrun, one rank failing mid-run leaves every reported row of every rank on disk.

Two CPU ranks (gloo) train with ``print_period=1``; at iteration 3 rank 1
raises while rank 0 is inside its step (forward done, not yet reported), and
torchrun stops rank 0 with SIGTERM. Each rank noted every record that
``record_stats()`` returned, in a file of its own, the moment it returned; the
CSV files read back with :func:`~pytorch_mem_profiler.analysis.runs.load_run`
must hold exactly those rows: iterations 1 and 2 of both ranks.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from pytorch_mem_profiler.analysis.runs import load_run
from pytorch_mem_profiler.measure.saved_tensors import can_chain

from .torchrun_helper import ROOT, run_command

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available() or sys.platform == "win32",
        reason="needs torch.distributed with gloo and POSIX signals",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failing_rank_leaves_every_reported_row_of_both_ranks(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(ROOT / "tests" / "rank_failure_worker.py"), "--out", str(tmp_path),
    ]  # fmt: skip
    proc = run_command(cmd, timeout_s=150)
    log = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, log  # rank 1 failed: so does the job
    assert "rank 1 fails at iteration 3" in proc.stderr, log
    # rank 0 was inside iteration 3's step when it was stopped, and never left it
    assert (tmp_path / "rank0.in_step").exists(), log
    assert not (tmp_path / "rank0.woke").exists(), log
    assert "SIGTERM" in proc.stderr, log  # torchrun stopped it: its default action, no handler of ours
    for rank in (0, 1):
        noted = (tmp_path / f"rank{rank}.reported").read_text().split("\n")
        reported = [tuple(map(int, line.split())) for line in noted if line]
        # computed apart from the files: the iterations before the failing one
        assert reported == [(1, 1), (1, 2)], (rank, reported, log)
        main_path, layers_file = (tmp_path / f"rank{rank}.files").read_text().split()
        assert f"_rank{rank}_" in Path(main_path).name
        run = load_run(main_path)
        assert not run.warnings, run.warnings
        on_disk = list(zip(run.records.epoch.astype(int), run.records.iteration.astype(int)))
        assert on_disk == reported, (rank, on_disk, reported)
        assert (run.records.weights > 0).all()
        assert run.layers is not None
        layer_rows = sorted(set(zip(run.layers.epoch.astype(int), run.layers.iteration.astype(int))))
        # the per-layer file has the same iterations, each whole; torch < 2.8 measures no
        # feature maps by layer: there the file holds its header alone
        assert layer_rows == (reported if can_chain() else []), (rank, layer_rows)
        assert Path(main_path).read_bytes().endswith(b"\n") and Path(layers_file).read_bytes().endswith(b"\n")
