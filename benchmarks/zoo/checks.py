"""The CPU checks every zoo model passes, for any registry of :class:`ZooModel` entries.

``tests/test_zoo.py`` runs them on :data:`ZOO`, ``tests/test_zoo_holdout_text.py`` and
``tests/test_zoo_holdout_vision.py`` on the models held back from it
(:mod:`benchmarks.zoo.holdout_text`, :mod:`benchmarks.zoo.holdout_vision`): the same bar for all.

- :func:`profiled_run`: three iterations under ``memory_profiler(model, print_period=1,
  by_layer=True)``, with the user's own ``saved_tensors_hooks`` pack hook around each forward,
  and the independent counts of each (unique storages, what the pack hook saw);
- :func:`check_record`: the profiler's record against those counts;
- :func:`check_cpu_estimate`: ``estimate_memory(..., device="cpu")`` equals the measured peak
  to the byte (or refuses an operation the entry says it refuses, by name);
- :func:`check_emulated_estimate`: ``estimate_memory(..., device="cuda")`` without a GPU (fake
  CPU tensors standing in for CUDA) adds up, its weights each a block of the caching allocator,
  or it refuses the step naming an ``aten`` operation (the entry's, where it names one).

Example::

    >>> from benchmarks.zoo import ZOO
    >>> runs = profiled_run(ZOO["neumf"])
    >>> check_record(ZOO["neumf"], runs)
    >>> check_cpu_estimate(ZOO["neumf"], runs)
"""

from __future__ import annotations

import gc
import io
from dataclasses import dataclass
from typing import Any

import torch

from pytorch_mem_profiler import estimate_memory, memory_profiler
from pytorch_mem_profiler.estimate import EstimateUnsupported
from pytorch_mem_profiler.estimate.rnn import cudnn_flattens
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.stats import IterationRecord

from .registry import ZooModel
from .training import SavedStorages, Training, storage_bytes

__all__ = ["ITERATIONS", "Iteration", "profiled_run", "measured_peak", "check_record", "check_cpu_estimate", "check_emulated_estimate"]

CPU = torch.device("cpu")
ITERATIONS = 3


@dataclass
class Iteration:
    """One profiled iteration's record and the counts made apart from the profiler."""

    record: IterationRecord
    weights: int
    buffers: int
    gradients: int
    optimizer_state: int
    saved: int
    sparse: bool  # the model makes sparse gradients


def profiled_run(entry: ZooModel) -> tuple[Iteration, ...]:
    """Three profiled iterations of ``entry`` at its small size, on the CPU, with the independent counts."""
    run = Training(entry, "small", CPU)
    saved = SavedStorages(run.model)
    gc.collect()
    out = []
    with memory_profiler(
        run.model, print_period=1, by_layer=True, stream=io.StringIO(), strict=True, optimizer=run.optimizer,
        overhead=None,  # every iteration in full: the checks need every figure
    ) as profiler:
        run.make_batch()  # made while profiled, as a data loader's batch is (and as the estimate counts it)
        for _ in range(ITERATIONS):
            run.step(saved)
            record = profiler.record_stats()
            out.append(
                Iteration(
                    record,
                    storage_bytes(run.model.parameters()),
                    storage_bytes(run.model.buffers()),
                    run.gradients[-1],
                    run.optimizer_state[-1],
                    saved.total,
                    any(getattr(m, "sparse", False) is True for m in run.model.modules()),
                )
            )
    return tuple(out)


def measured_peak(runs: tuple[Iteration, ...]) -> int:
    """The measured peak of the two steps ``estimate_memory`` runs: the larger of the first two iterations'."""
    return max(it.record.iteration_peak_allocated for it in runs[:2])


def check_record(entry: ZooModel, runs: tuple[Iteration, ...]) -> None:
    """The profiler's records of :func:`profiled_run` against the independent counts (``AssertionError``)."""
    name = entry.name
    for it in runs:
        record = it.record
        where = f"{name}, iteration {record.iteration}"
        assert record.weights == it.weights > 0, where
        assert record.buffers == it.buffers, where
        assert record.gradients == it.gradients > 0, where
        assert record.optimizer_state == it.optimizer_state, where
        assert record.forward_passes == record.backward_passes == record.optimizer_steps == 1, where
        assert record.peak_breakdown is not None, where
        assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated > 0, where
        if entry.needs_compile:
            # inside a compiled graph there are no module boundaries to attribute to: totals only
            assert record.layers is None and record.feature_maps > 0, where
        elif can_chain():
            layers = record.layers
            assert layers is not None and it.saved > 0, where
            attributed = sum(layers.by_module.values())
            assert attributed == layers.total + layers.inputs, where
            assert abs(attributed - it.saved) <= 0.01 * it.saved, (where, attributed, it.saved)
    first, second = runs[:2]
    # the optimizer's state is made by its first step and kept (SGD's momentum, AdamW's moments);
    # a sparse momentum buffer gains each sparse gradient's entries
    assert 0 < first.optimizer_state <= second.optimizer_state, name
    if not first.sparse:
        assert first.optimizer_state == second.optimizer_state, name


def refused_as_named(entry: ZooModel, **settings: Any) -> bool:
    """For an entry whose estimate is to be refused (``unsupported``): whether ``estimate_memory`` on
    the CPU with ``settings`` refuses it naming that operation (``AssertionError`` if it gives a
    figure instead). ``False`` for any other entry: its check goes on."""
    if not entry.unsupported:
        return False
    try:
        estimate_memory(**dict(entry.estimate_kwargs("small"), batch_size=entry.batch["small"], device="cpu", **settings))
    except EstimateUnsupported as err:
        assert entry.unsupported in str(err), (entry.name, str(err))
        return True
    raise AssertionError(f"{entry.name}: estimated, though {entry.unsupported} was to be refused")


def check_cpu_estimate(entry: ZooModel, runs: tuple[Iteration, ...] | None = None) -> None:
    """``estimate_memory`` on the CPU equals the step :func:`profiled_run` measured, to the byte
    (``AssertionError``); an entry with ``unsupported`` must be refused, naming that operation."""
    if refused_as_named(entry, fit=False):
        return
    estimate = estimate_memory(**dict(entry.estimate_kwargs("small"), batch_size=entry.batch["small"], device="cpu", fit=False))
    runs = runs if runs is not None else profiled_run(entry)
    measured = measured_peak(runs)
    assert estimate.weights == runs[0].weights, entry.name
    assert estimate.optimizer_state == runs[1].optimizer_state, entry.name
    assert sum(estimate.peak_breakdown.values()) == estimate.peak, entry.name
    assert estimate.peak == measured, f"{entry.name}: estimated {estimate.peak:,} B, measured {measured:,} B"


def check_emulated_estimate(entry: ZooModel) -> None:
    """The CUDA estimate of ``entry``'s small step on this machine's CPU (emulated where no GPU is
    here) adds up, or refuses naming an ``aten`` operation (``AssertionError`` otherwise)."""
    kwargs = dict(entry.estimate_kwargs("small"), batch_size=entry.batch["small"], device="cuda", fit=False)
    try:
        estimate = estimate_memory(**kwargs)
    except EstimateUnsupported as err:
        assert err.operation and err.operation.startswith("aten."), (entry.name, err.operation, str(err))
        assert err.operation in str(err), (entry.name, str(err))
        if entry.unsupported:
            assert entry.unsupported in str(err), (entry.name, str(err))
        return
    assert not entry.unsupported, f"{entry.name}: estimated, though {entry.unsupported} was to be refused"
    assert estimate.peak > 0 and sum(estimate.peak_breakdown.values()) == estimate.peak, (entry.name, estimate.peak_breakdown)
    # weights: each parameter's storage as CUDA's caching allocator takes it (a multiple of 512 bytes);
    # a recurrent layer's weights, which model.to("cuda") copies into one flat buffer of cuDNN's, one block
    model = entry.builder("small")()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    for module in model.modules():
        if cudnn_flattens(module):
            weights = list(module._flat_weights)
            for w in weights:
                storages.pop(w.untyped_storage().data_ptr(), None)
            storages[id(module)] = sum(w.nbytes for w in weights)
    assert estimate.weights == sum(-(-nbytes // 512) * 512 for nbytes in storages.values()), entry.name
