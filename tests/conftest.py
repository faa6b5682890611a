"""Shared test fixtures and the one GPU skip rule.

Tests that need a CUDA GPU are marked ``cuda`` and live in ``test_*_cuda.py``
files; without a GPU they are skipped (CI has none). Run them on a GPU machine
with ``PYTHONPATH=. python3 -m pytest -m cuda -q``.
"""

from __future__ import annotations

import io

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def stream() -> io.StringIO:
    """Where a test's profiler prints its report."""
    return io.StringIO()


@pytest.fixture
def csv_dir(tmp_path):
    """A fresh CSV folder per test, so tests never write into the repository."""
    return tmp_path / "memory_csv_data"


@pytest.fixture
def counter():
    """A started exact CPU counter, stopped after the test."""
    from pytorch_mem_profiler.measure.devices import CpuCounter

    c = CpuCounter()
    c.start()
    yield c
    c.stop()
