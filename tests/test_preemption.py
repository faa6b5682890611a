"""Preemption: a run killed by SIGTERM (SLURM, Kubernetes) or SIGKILL (the OOM killer) keeps every row.

A child process trains a small CPU model for 2 epochs of 40 iterations with
``print_period=1`` (a row per iteration, and the per-layer file), and is
killed at iteration 30 of epoch 2: by itself, right after ``record_stats()``
returned, or by this process, while it goes on training. Every row reported
before the kill must be in both files, and both must parse.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from pytorch_mem_profiler.measure.saved_tensors import can_chain

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    sys.path.insert(0, {root!r})
    from pytorch_mem_profiler import memory_profiler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    profiler = memory_profiler(model, 1, True, csv_dir={csv_dir!r}, by_layer=True,
                               stream=open(os.devnull, "w"), overhead=None)
    print("files", profiler.csv_path, profiler.layers_csv_path, flush=True)
    for epoch in (1, 2):
        for iteration in range(1, 41):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            if (epoch, iteration) > (2, 30):
                time.sleep(0.05)  # a slower step, so that the parent's signal lands mid-run
            loss.backward()
            opt.step(); opt.zero_grad()
            record = profiler.record_stats()
            print("reported", record.epoch, record.iteration, flush=True)
            if (epoch, iteration) == (2, 30):
                if {who!r} == "self":
                    os.kill(os.getpid(), getattr(signal, {signame!r}))
                    time.sleep(60)  # the signal ends the process before this does
                print("marker", flush=True)
        profiler.epoch_end()
    print("finished", flush=True)
    """
)


def _run_until_killed(tmp_path: Path, signame: str, who: str) -> tuple[list[str], Path, Path, int]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=str(ROOT), csv_dir=str(tmp_path / "csv"), who=who, signame=signame))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if who == "parent" and line.startswith("marker"):
                # the child trains on while the signal is on its way: it lands mid-step
                os.kill(proc.pid, getattr(signal, signame))
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert "finished" not in lines, stderr
    files = next(line for line in lines if line.startswith("files")).split()
    return lines, Path(files[1]), Path(files[2]), code


@pytest.mark.parametrize(
    "signame, who",
    # the OOM killer, a SLURM time limit or Kubernetes eviction, and torchrun stopping a rank mid-step
    [("SIGKILL", "self"), ("SIGTERM", "self"), ("SIGTERM", "parent")],
)
def test_every_reported_row_survives_the_kill(tmp_path, signame, who):
    lines, main_path, layers_path, code = _run_until_killed(tmp_path, signame, who)
    assert code == -getattr(signal, signame)  # killed by the signal, no handler ran
    reported = [tuple(map(int, line.split()[1:])) for line in lines if line.startswith("reported")]
    main = pd.read_csv(main_path)
    on_disk = list(zip(main.epoch, main.iteration))
    if who == "self":
        # killed right after iteration 30 of epoch 2 was reported: 40 + 30 rows
        assert len(reported) == 70
        assert on_disk == reported == [(1, i) for i in range(1, 41)] + [(2, i) for i in range(1, 31)]
    else:
        # killed somewhere after iteration 30 of epoch 2; every row the child reported is
        # there; at most one more (written, killed before it printed that it was)
        assert len(reported) >= 70
        assert on_disk[: len(reported)] == reported
        assert len(on_disk) - len(reported) in (0, 1)
        assert on_disk == [(1, i) for i in range(1, 41)] + [(2, i) for i in range(1, len(on_disk) - 39)]
    assert main.total_weight_usage.notna().all() and (main.total_weight_usage > 0).all()
    layers = pd.read_csv(layers_path)
    if can_chain():
        # the per-layer file has the rows of the same reported iterations, whole
        assert sorted(set(zip(layers.epoch, layers.iteration))) == on_disk
        totals = layers[layers.module == "(total by layer)"]
        assert len(totals) == len(on_disk)
    else:  # torch < 2.8 measures no feature maps by layer: the per-layer file holds its header alone
        assert layers.empty and {"epoch", "iteration", "module", "bytes"} <= set(layers.columns)
    # both files end with a whole line
    assert main_path.read_bytes().endswith(b"\n") and layers_path.read_bytes().endswith(b"\n")
