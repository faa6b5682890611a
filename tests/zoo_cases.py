"""The test cases of a zoo registry (:data:`benchmarks.zoo.ZOO` and the held-back sets): one place
for what the zoo's CPU and GPU test files share.

- :func:`cases`: a registry's names as ``pytest`` parameters, skipped (naming why) where the
  entry cannot run here, ``xfail(strict=True)`` where a known gap names them;
- :func:`listed_goals`: the goals a listed entry may miss in the GPU tests' check;
- :class:`ProfiledRuns`: :func:`~benchmarks.zoo.checks.profiled_run` of each entry, once per
  test module (its ``clear()`` in a module fixture frees them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zoo import ZooModel  # noqa: E402
from benchmarks.zoo.checks import Iteration, profiled_run  # noqa: E402
from pytorch_mem_profiler.torch_versions import COMPILE_YIELDS_TO_DISPATCH_MODES  # noqa: E402

__all__ = ["ProfiledRuns", "cases", "listed_goals"]


def _why_not(entry: ZooModel, on_cpu: bool) -> str | None:
    reason = entry.unavailable()
    if reason is None and on_cpu and entry.needs_compile and not COMPILE_YIELDS_TO_DISPATCH_MODES:
        reason = f"torch {torch.__version__} runs compiled code past the CPU counter: the measured step misses its tensors"
    return reason


def cases(
    registry: Mapping[str, ZooModel],
    known: Mapping[str, str] | None = None,
    *,
    on_cpu: bool = True,
    unsteady: Mapping[str, str] | None = None,
    raises: type[BaseException] | None = None,
) -> list[Any]:
    """The registry's names as parameters: skipped where the entry cannot run here (``on_cpu``:
    also a compiled entry where this torch runs compiled code past the CPU counter), else
    ``xfail(strict=True, reason=known[name])`` where ``known`` names it, and ``xfail(strict=False)``
    where ``unsteady`` does (a model at the edge of a goal, seen both to meet and to miss it: the
    reason gives both runs' figures). ``raises``: the only exception a known miss may end in (the GPU
    tests' ``AssertionError``: a miss whose model now fails otherwise fails the test)."""
    params = []
    for name, entry in registry.items():
        reason = _why_not(entry, on_cpu)
        if reason:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)))
        elif known and name in known:
            params.append(pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=known[name], raises=raises)))
        elif unsteady and name in unsteady:
            params.append(pytest.param(name, marks=pytest.mark.xfail(strict=False, reason=unsteady[name], raises=raises)))
        else:
            params.append(name)
    return params


def listed_goals(name: str, goals: tuple[str, ...], *listings: Mapping[str, str]) -> tuple[str, ...] | None:
    """``goals`` where one of ``listings`` (a GPU test file's known and unsteady misses) lists
    ``name``, else ``None``: the ``known_misses`` of ``zoo_conformance.assert_conforms``. A listed
    entry that misses another goal then raises a ``RuntimeError``, which its xfail does not expect.

    Example::

        >>> listed_goals("levit", ("reserved",), {"levit": "reserved -5.1%"}, {})
        ('reserved',)
        >>> listed_goals("vit", ("reserved",), {"levit": "reserved -5.1%"}, {}) is None
        True
    """
    return goals if any(name in listing for listing in listings) else None


class ProfiledRuns:
    """Each entry's :func:`~benchmarks.zoo.checks.profiled_run`, made once and kept until :meth:`clear`."""

    def __init__(self, registry: Mapping[str, ZooModel]) -> None:
        self.registry = registry
        self._runs: dict[str, tuple[Iteration, ...]] = {}

    def __call__(self, name: str) -> tuple[Iteration, ...]:
        runs = self._runs.get(name)
        if runs is None:
            runs = self._runs[name] = profiled_run(self.registry[name])
        return runs

    def clear(self) -> None:
        self._runs.clear()
