"""A forward is one thread's: ``nn.DataParallel`` runs a replica of the model per GPU, each in a
thread of its own and carrying the model's hooks (the Hugging Face Trainer does on a machine with
several GPUs, launched without ``torchrun``). On the CPU, a thread stands in for another GPU's
replica and runs the model while the training forward runs: the record is the training forward's
alone, against what a ``saved_tensors_hooks`` pack hook saw it keep. The two-GPU run is in
``tests/test_integrations_cuda.py``.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.entries import replica_device
from pytorch_mem_profiler.measure.saved_tensors import can_chain

from .helpers import SavedBytes, nbytes


class Rendezvous(nn.Module):
    """Identity where the training forward and the replica's meet, in the order a test asks.

    ``replica_first``: the replica's forward enters first and stays inside until the training
    forward has ended; else the training forward starts the replica, which stays inside until
    the training forward has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.replica_thread: threading.Thread | None = None
        self.inside = threading.Event()
        self.leave = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        thread = self.replica_thread
        if thread is not None and threading.current_thread() is thread:
            self.inside.set()
            self.leave.wait(10)
        elif thread is not None and not self.inside.is_set():
            thread.start()
            self.inside.wait(10)
        return x


def replica_of(model: nn.Module, device: torch.device | None) -> nn.Module:
    """The root copied as ``nn.parallel.replicate`` copies it (children shared here), its tensors
    on ``device`` (``None``: the same as the model's)."""
    replica = model._replicate_for_data_parallel()
    replica._former_parameters = {} if device is None else {"weight": torch.empty(0, device=device)}
    return replica


@pytest.mark.parametrize("by_layer", [False, True])
@pytest.mark.parametrize("replica_first", [False, True], ids=["training_first", "replica_first"])
def test_a_replicas_forward_in_another_thread_is_not_the_training_forward(by_layer, replica_first):
    torch.manual_seed(0)
    gate = Rendezvous()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), gate, nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    failures: list[BaseException] = []
    # every iteration in detail (no cost budget): each is checked
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=by_layer, overhead=None) as profiler:
        for _ in range(3):
            # on another device (the meta device standing in for a second GPU) where it enters first
            replica = replica_of(model, torch.device("meta") if replica_first else None)

            def replica_forward() -> None:
                try:
                    with torch.no_grad():
                        replica(x)
                except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
                    failures.append(exc)

            gate.inside.clear()
            gate.leave.clear()
            gate.replica_thread = threading.Thread(target=replica_forward)
            if replica_first:
                gate.replica_thread.start()
                assert gate.inside.wait(10)
            seen = SavedBytes(model, (x,))
            with seen.hooks():
                out = model(x)
            gate.leave.set()
            gate.replica_thread.join(10)
            gate.replica_thread = None
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            record = profiler.record_stats()
            assert not failures, failures
            assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
            # ReLU's output (the second Linear saves it too: kept once) and the output
            assert record.feature_maps == seen.total + nbytes(out) == (16 * 64 + 16 * 10) * 4
            if by_layer and can_chain():
                acts = {m: n for (m, c), n in record.layers.by_module.items() if c == "activations"}
                assert acts == {"(input)": nbytes(x), "1": seen.total}
                assert record.layers.calls == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_replica_device_reads_the_replicas_tensors():
    linear = nn.Sequential(nn.Linear(2, 2))
    assert replica_device(linear) is None  # the model itself
    assert replica_device(replica_of(linear, torch.device("meta"))) == torch.device("meta")
    assert replica_device(replica_of(linear, None)) is None  # it holds no tensor: no device to tell
    normed = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2).to("meta"))
    assert replica_device(replica_of(normed, None)) == torch.device("meta")  # a buffer tells
