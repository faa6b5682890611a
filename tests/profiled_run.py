"""Runs of a tiny model with the profiler writing its CSV, for the CLI, plot and report tests.

The CSV files are the profiler's own, written in the test: no hand-made files.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from pytorch_mem_profiler import memory_profiler

REPO = Path(__file__).resolve().parent.parent


class TinyNet(nn.Module):
    """Three layers of different sizes: ``encoder`` is the largest by weight."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(48)
        self.head = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.encoder(x))))


def profile_tiny_model(
    folder: Path,
    *,
    batch: int = 8,
    epochs: int = 2,
    iterations: int = 4,
    print_period: int = 2,
    units: str = "KB",
    seed: int = 0,
    by_layer: bool = False,
    breakdown: bool = False,
) -> tuple[Path, nn.Module]:
    """Train :class:`TinyNet` with the profiler writing CSV into ``folder``; (CSV path, model).

    With ``by_layer`` the profiler also writes the per-layer file ``<run>_layers.csv``.
    Without ``breakdown`` the ``peak_<category>`` columns are emptied, as in a file
    written before the breakdown was measured: the analysis tests choose breakdowns
    whose figures they know (:mod:`.peak_columns`).
    """
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    profiler = memory_profiler(
        model,
        print_period,
        True,
        csv_dir=folder,
        stream=io.StringIO(),
        units=units,
        strict=True,
        by_layer=by_layer,
        overhead=None,  # every reported row measured (module-scoped fixtures run outside conftest's)
    )
    with profiler:
        for _ in range(epochs):
            for _ in range(iterations):
                model(torch.randn(batch, 16)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.record_stats()
            profiler.epoch_end()
    path = Path(profiler.csv_path)
    if not breakdown:
        from .peak_columns import add_peak_columns

        add_peak_columns(path, device_total=None, shares=None)
    return path, model


def run_cli(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m pytorch_mem_profiler ARGS`` in ``cwd``, the package taken from this clone."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    return subprocess.run(
        [sys.executable, "-m", "pytorch_mem_profiler", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG file's IHDR chunk."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def load_example(name: str):
    """``examples/<name>.py`` as a module (the examples folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
