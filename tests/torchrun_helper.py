"""Start ``tests/distributed_worker.py`` under ``torchrun`` for the distributed tests, with a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_worker.py"


def torchrun_env() -> dict[str, str]:
    """The environment of the started processes: this checkout importable, NVLink multicast off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared GPU machines
    return env


def run_command(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; past ``timeout_s`` stop it and fail the test (a hang)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=torchrun_env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # torchrun's workers run in sessions of their own: SIGTERM lets torchrun
        # stop them before it exits; SIGKILL only if it does not.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = "", "(killed)"
        pytest.fail(
            f"{' '.join(cmd)} did not finish in {timeout_s} s (a hang?)\n{stdout}\n{stderr[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_worker(
    out: Path, backend: str, scenarios: str, nproc: int = 2, timeout_s: float = 120
) -> subprocess.CompletedProcess:
    """The worker on ``nproc`` ranks of one node; each writes ``out/rank<r>.json``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--standalone", str(WORKER), "--out", str(out), "--backend", backend,
        "--scenarios", scenarios,
    ]  # fmt: skip
    return run_command(cmd, timeout_s)
