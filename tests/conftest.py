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


@pytest.fixture(autouse=True)
def _every_reported_iteration_detailed(request, monkeypatch):
    """Most tests assert the figures of every reported iteration, which the default cost budget
    (``overhead=0.03``) may skip, by timings no test controls: for them the budget is off
    (``overhead=None``) unless the test gives one. Tests of the default itself are marked
    ``default_budget`` (tests/test_budget.py gives ``overhead=`` explicitly)."""
    if request.node.get_closest_marker("default_budget") is not None:
        return
    from pytorch_mem_profiler.profiler import MemoryProfiler

    monkeypatch.setitem(MemoryProfiler.__init__.__kwdefaults__, "overhead", None)


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
