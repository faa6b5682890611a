"""The foreign-memory battery on the CPU (see ``tests/foreign_memory.py``): memory that is not the
profiled model's never becomes advice, and the part of 'other' that existed before the iteration is
what that memory holds, to the byte."""

from __future__ import annotations

import pytest
import torch

from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.outputs.advice import advise

from .foreign_memory import KINDS, SETUPS, check_no_wrong_advice, run

CPU = torch.device("cpu")
#: elements of each foreign tensor: 4 MB of float32, several times the models' peaks
SIZE = 1 << 20


@pytest.fixture(scope="module")
def baselines():
    return {name: run(setup, CPU, None, SIZE)[0] for name, setup in SETUPS.items()}


def test_the_setups_get_advice_of_their_own(baselines):
    # the checks below mean something only if the model alone gets advice to compare with
    assert {"8-bit optimizer", "foreach-free step"} <= {a.kind for a in advise(baselines["optimizer-heavy"])}
    assert baselines["optimizer-heavy"].peak_phase == "optimizer"
    # checkpointing names blocks by their feature maps, which torch tells by layer from 2.8 on
    assert ("checkpointing" in {a.kind for a in advise(baselines["activation-heavy"])}) == can_chain()
    for record in baselines.values():
        assert record.peak_other_before == 0  # nothing foreign: nothing in 'other' from before


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("kind", KINDS)
def test_foreign_memory_gives_no_wrong_advice(baselines, setup, kind):
    record, before = run(SETUPS[setup], CPU, kind, SIZE)
    alone = baselines[setup]
    # the peak's make-up sums to the peak
    assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated
    # what existed before the iteration: the foreign memory's own storages, to the byte
    assert before is not None and before >= SIZE
    assert record.peak_other_before == before, (record.peak_other_before, before)
    assert record.peak_breakdown["other"] >= record.peak_other_before
    if record.peak_phase == alone.peak_phase:
        # the same moment peaks: the model's own categories and the step's temporaries are as without it
        for category in ("weights", "gradients", "optimizer_state", "activations"):
            assert record.peak_breakdown[category] == alone.peak_breakdown[category], category
        assert record.peak_step_temporaries == alone.peak_step_temporaries
    else:
        # the foreign memory's own work peaks (a second model's training, between the phases)
        assert kind == "second model and optimizer" and record.peak_phase == "other", (kind, record.peak_phase)
    check_no_wrong_advice(alone, record)
