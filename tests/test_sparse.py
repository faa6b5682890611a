"""Sparse gradients, parameters and optimizer state (nn.Embedding(sparse=True), SparseAdam), to the byte.

A sparse tensor holds its index and value tensors: the bytes expected are
``untyped_storage().nbytes()`` of those, computed here independently.
"""

from __future__ import annotations

import functools
import io
import types
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.accounting import (
    allocation_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    storage_parts,
    tensor_bytes,
    unique_parameters,
)
from pytorch_mem_profiler.measure.devices import CpuCounter
from pytorch_mem_profiler.measure.saved_tensors import can_chain

from .helpers import nbytes


def held(t: torch.Tensor) -> int:
    """Bytes a tensor holds, by hand: a sparse one's index and value storages."""
    if t.layout == torch.sparse_coo:
        return t._indices().untyped_storage().nbytes() + t._values().untyped_storage().nbytes()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    else:
        return t.untyped_storage().nbytes()
    return sum(p.untyped_storage().nbytes() for p in parts)


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a sparse one's indices and values)."""
    storages = {}
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        if t.layout == torch.sparse_coo:
            parts = (t._indices(), t._values())
        else:
            parts = (t,)
        for part in parts:
            storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return sum(storages.values())


class Recommender(nn.Module):
    """NeuMF-like: sparse embeddings, a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = nn.Embedding(1000, 16, sparse=True)
        self.items = nn.EmbeddingBag(500, 8, mode="sum", sparse=True)
        self.head = nn.Linear(24, 1)

    def forward(self, users, items, offsets):
        return self.head(torch.cat([self.users(users), self.items(items, offsets)], 1))


def batch():
    return torch.tensor([3, 7, 7, 42]), torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 3, 5])


@pytest.mark.parametrize("by_layer", [False, True])
def test_sparse_embeddings_with_sparse_adam_are_exact(by_layer):
    model = Recommender()
    sparse_opt = torch.optim.SparseAdam([model.users.weight, model.items.weight])
    dense_opt = torch.optim.Adam(model.head.parameters())
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=by_layer) as profiler:
        for _ in range(3):
            users, items, offsets = batch()
            model(users, items, offsets).sum().backward()
            grads = [p.grad for p in model.parameters()]
            sparse_opt.step()
            dense_opt.step()
            record = profiler.record_stats()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            assert [g.layout for g in grads] == [torch.sparse_coo, torch.sparse_coo, torch.strided, torch.strided]
            assert record.gradients == sum(held(g) for g in grads)
            # uncoalesced: one index and one row of values per looked-up id
            assert held(grads[0]) == 4 * 8 + 4 * 16 * 4 and held(grads[1]) == 6 * 8 + 6 * 8 * 4
            assert record.weights == sum(nbytes(p) for p in model.parameters())
            state = [t for opt in (sparse_opt, dense_opt) for s in opt.state.values() for t in s.values()]
            assert record.optimizer_state == sum(held(t) for t in state if torch.is_tensor(t))
            # SparseAdam's moments are dense, the size of the tables
            assert record.optimizer_state >= 2 * (1000 * 16 + 500 * 8) * 4
            # the CPU counter sees every storage alive: weights, gradients, state and the batch
            # (a gradient's indices may be the batch's own storage: each storage counts once)
            alive = [*model.parameters(), *grads, *state, users, items, offsets]
            assert record.allocated == unique_bytes(alive)
            del alive, grads  # the next iteration's figures hold none of these
            assert record.forward_passes == record.backward_passes == 1
            if by_layer and can_chain():
                assert record.layers.total + record.layers.unattributed == record.feature_maps


def test_sparse_accounting_of_every_layout():
    dense = torch.tensor([[0.0, 2.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0], [5.0, 0.0, 6.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        tensors = [
            dense.to_sparse(),
            dense.to_sparse_csr(),
            dense.to_sparse_csc(),
            dense.to_sparse_bsr((2, 2)),
            dense.to_sparse_bsc((2, 2)),
        ]
    for t in tensors:
        assert tensor_bytes(t) == allocation_bytes(t) == held(t), t.layout
        assert all(p.layout == torch.strided for p in storage_parts(t))
    coo = tensors[0]
    assert tensor_bytes(coo) == 6 * 2 * 8 + 6 * 4  # 6 entries: 2 int64 indices and 1 float each
    assert storage_parts(dense) == (dense,)


def test_a_sparse_parameter_and_its_sparse_gradient():
    class SparseLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            weight = torch.randn(64, 32) * (torch.rand(64, 32) < 0.1)
            self.weight = nn.Parameter(weight.to_sparse())

        def forward(self, x):
            return torch.sparse.mm(self.weight, x)

    model = SparseLinear()
    params = unique_parameters(model, torch.device("cpu"))
    assert [name for name, _ in params] == ["weight"]
    x = torch.randn(32, 8)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        model(x).sum().backward()
        grad = model.weight.grad
        record = profiler.record_stats()
    assert grad.layout == torch.sparse_coo
    assert record.weights == held(model.weight)
    assert record.gradients == held(grad) == gradient_bytes(params)[0]
    assert record.forward_passes == record.backward_passes == 1


def test_the_cpu_counter_counts_what_a_sparse_result_holds():
    counter = CpuCounter()
    counter.start()
    try:
        indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
        values = torch.tensor([3.0, 4.0, 5.0])
        made = counter.read().allocated
        sparse = torch.sparse_coo_tensor(indices, values, (2, 3), check_invariants=True)
        # made around the given tensors: no new memory
        assert counter.read().allocated == made
        doubled = sparse * 2  # new indices and values
        assert counter.read().allocated == made + held(doubled)
        del doubled
        assert counter.read().allocated == made
    finally:
        counter.stop()


def test_sparse_optimizer_state_counts_once():
    sparse = torch.eye(5).to_sparse()
    holder = types.SimpleNamespace(state={"p": {"moment": sparse, "same": sparse, "step": torch.zeros(())}})
    assert optimizer_state_bytes([holder], torch.device("cpu")) == held(sparse) + 4


def test_sgd_momentum_over_sparse_gradients_is_recounted_as_it_grows():
    """SGD's momentum buffer over a sparse gradient is itself sparse, and each step's update
    (``buf.mul_(momentum).add_(grad)``) appends the gradient's entries: the state grows with the
    number of state entries unchanged, so a count reused from the last iteration falls behind."""
    torch.manual_seed(0)
    model = nn.EmbeddingBag(1000, 8, mode="sum", sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sizes, records = [], []
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, optimizer=opt) as profiler:
        for _ in range(3):
            model(torch.randint(0, 1000, (16, 4))).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            buffer = opt.state[model.weight]["momentum_buffer"]
            sizes.append(held(buffer))
            records.append(profiler.record_stats())
    assert buffer.layout == torch.sparse_coo
    assert sizes[0] < sizes[1] < sizes[2]  # the buffer grew, len(opt.state) did not
    assert [r.optimizer_state for r in records] == sizes


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("bag", [True, False], ids=["EmbeddingBag", "Embedding"])
def test_the_cpu_counter_counts_sparse_tensors_rewritten_in_place(bag, foreach):
    """``buf.add_(grad)`` on a sparse momentum buffer (and ``_foreach_add_`` over such buffers)
    gives it new index and value tensors inside the kernel and returns nothing new: the counter
    must count the new ones as the old ones die. After each step the live bytes are the weights'
    and the momentum's storages, counted here by hand."""
    torch.manual_seed(0)
    table = nn.EmbeddingBag(1000, 8, mode="sum", sparse=True) if bag else nn.Embedding(1000, 8, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.01, momentum=0.9, foreach=foreach)
    counter = CpuCounter(torch.device("cpu"))
    counter.start()
    try:
        counter.adopt(list(table.parameters()))
        for step in range(3):
            x = torch.randint(0, 1000, (16, 4))
            table(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x
            buffer = opt.state[table.weight]["momentum_buffer"]
            assert buffer.layout == torch.sparse_coo
            assert counter.read().allocated == held(table.weight) + held(buffer), step
    finally:
        counter.stop()


class _EveryStorage(TorchDispatchMode):
    """An independent count: every storage seen in an operator's arguments or results (a sparse
    tensor's indices and values), summed while alive, read after each operator; the highest sum.
    A kernel writing a sparse tensor in place (``add_``) makes its new indices and values before
    it lets the old ones go (they are its locals until it returns): the old ones are held here
    until the operator's results are counted (the model has one sparse weight, so no operator
    writes two sparse tensors)."""

    def __init__(self, tensors=()) -> None:
        super().__init__()
        self.alive: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0
        self._see(list(tensors))

    def _see(self, values) -> None:
        for value in values:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    for part in (t._indices(), t._values()) if t.layout == torch.sparse_coo else (t,):
                        storage = part.untyped_storage()
                        known = self.alive.get(id(storage))
                        if known is None or known[0]() is not storage:
                            self.alive[id(storage)] = (weakref.ref(storage), storage.nbytes())

    def total(self) -> int:
        return sum(n for ref, n in self.alive.values() if ref() is not None)

    def reset(self) -> None:
        self.peak = self.total()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = [
            part
            for value in (*args, *(kwargs or {}).values())
            for t in (value if isinstance(value, (list, tuple)) else (value,))
            if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo
            for part in (t._indices(), t._values())
        ]
        out = func(*args, **(kwargs or {}))
        self._see([*args, *(kwargs or {}).values(), *(out if isinstance(out, (list, tuple)) else [out])])
        self.peak = max(self.peak, self.total())
        del held
        return out


def _step_peaks(optimizer, profiled: bool, steps: int = 3) -> tuple[list[int], list[int]]:
    """Each step's peak by the independent count, and the profiler's record peaks (when profiled)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(1000, 8, mode="sum", sparse=True), "head": nn.Linear(8, 1)})
    opt = optimizer(model.parameters())
    counted, recorded = [], []
    profiler = MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, optimizer=opt) if profiled else None
    # the batch is made while counted (by the profiler too), as a data loader's is
    x = torch.randint(0, 1000, (16, 4), generator=torch.Generator().manual_seed(1))
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]  # Adagrad makes it eagerly
    with _EveryStorage([*model.parameters(), *state, x]) as every:
        for _ in range(steps):
            every.reset()
            out = model["head"](model["bag"](x)).sum()
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
            counted.append(every.peak)
            if profiler is not None:
                recorded.append(profiler.record_stats().iteration_peak_allocated)
    if profiler is not None:
        profiler.close()
    return counted, recorded


@pytest.mark.parametrize(
    "optimizer",
    [
        functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, foreach=False),
        functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, foreach=True),
        functools.partial(torch.optim.Adagrad, lr=0.01),
    ],
    ids=["momentum-loop", "momentum-foreach", "adagrad"],
)
def test_profiling_sparse_gradients_leaves_each_steps_peak_as_it_was(optimizer):
    """The profiler observes: each step's peak, counted apart from it, is the same with and without
    it, and its own record of each step is that peak. The peaks grow from step to step (the sparse
    momentum gains the gradient's entries), so a step is compared with the same step only."""
    unprofiled, _ = _step_peaks(optimizer, profiled=False)
    profiled, recorded = _step_peaks(optimizer, profiled=True)
    assert profiled == unprofiled
    assert recorded == profiled
    if "momentum" in str(optimizer.keywords):
        assert unprofiled[0] < unprofiled[2]
