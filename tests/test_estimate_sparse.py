"""``estimate_memory`` on sparse gradients (``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``) and on
``_foreach_*`` operators over them, against the CPU counter's measurement of the same two steps.

The truth is the profiler's CPU counter over the two steps the estimate runs (it counts live
storages, a sparse tensor's index and value storages among them, to the byte), and the bytes of
the storages of the real tensors (``untyped_storage().nbytes()``), computed here.
"""

from __future__ import annotations

import functools
import gc
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler, estimate_memory
from pytorch_mem_profiler.estimate import EstimateUnsupported
from pytorch_mem_profiler.estimate.allocator import block_size
from pytorch_mem_profiler.estimate.fake import fake_mode
from pytorch_mem_profiler.measure.accounting import storage_parts

CPU = torch.device("cpu")
ROWS, DIM, BATCH, BAG = 500, 16, 8, 6


class Recommender(nn.Module):
    """A sparse table (a bag of ids per sample, or one embedding per id, summed) and a dense head."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) if bag else nn.Embedding(ROWS, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.table(ids)
        return self.head(x if self.bag else x.sum(1)).squeeze(1)


def ids(seed: int = 0, low: int = 0, high: int = ROWS) -> torch.Tensor:
    return torch.randint(low, high, (BATCH, BAG), generator=torch.Generator().manual_seed(seed))


def held(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a sparse one's indices and values), by
    storage object (the tensors are alive: no storage's id is reused; a fake one has no address)."""
    seen = {}
    for t in tensors:
        for part in storage_parts(t):
            storage = part.untyped_storage()
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def measured(bag: bool, optimizer, batches) -> tuple[int, int, int]:
    """The profiler's largest iteration peak over two steps, the weight gradients after the second
    backward and the optimizer state after the second step (bytes of the real storages)."""
    torch.manual_seed(0)
    model = Recommender(bag)
    opt = optimizer(model.parameters())
    gc.collect()
    peaks, gradients, state = [], 0, 0
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt) as profiler:
        for batch in batches:
            x = batch.clone()  # made while counted, as the estimate counts its inputs
            out = model(x)
            loss = out.sum()
            loss.backward()
            gradients = held(p.grad for p in model.parameters())
            opt.step()
            state = held(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
            opt.zero_grad(set_to_none=True)
            del out, loss, x
            peaks.append(profiler.record_stats().iteration_peak_allocated)
    return max(peaks), gradients, state


def estimated(bag: bool, optimizer, device: str = "cpu"):
    return estimate_memory(lambda: Recommender(bag), ids(), optimizer=optimizer, device=device, fit=False)


SGD = functools.partial(torch.optim.SGD, lr=0.1)
MOMENTUM_LOOP = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=False)
MOMENTUM_FOREACH = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True)
NESTEROV = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, foreach=True)


@pytest.mark.parametrize("bag", [True, False], ids=["EmbeddingBag", "Embedding"])
@pytest.mark.parametrize("optimizer", [SGD, MOMENTUM_LOOP, MOMENTUM_FOREACH], ids=["sgd", "momentum-loop", "momentum-foreach"])
def test_a_sparse_step_is_estimated_to_the_byte(bag, optimizer):
    peak, gradients, state = measured(bag, optimizer, [ids(), ids()])
    est = estimated(bag, optimizer)
    assert est.peak == peak, (est.peak, peak)
    assert est.gradients == gradients
    assert est.optimizer_state == state
    if optimizer is not SGD:
        # the momentum over the sparse table holds both steps' gradient entries: nnz(a) + nnz(b)
        entries = 2 * BATCH * BAG
        table = DIM * 4 + 8  # a row of float32 values and its int64 index
        dense = sum(p.numel() * 4 for p in nn.Linear(DIM, 1).parameters())
        assert est.optimizer_state == entries * table + dense


def test_nesterov_counts_the_room_a_cpu_merge_makes():
    """The CPU's sparse add merges equal indices into tensors with room for both operands and
    narrows them: Nesterov's ``grad.add(buf)`` then sees the merged count, which depends on the
    indices. The estimate counts the room (CUDA concatenates, so there it is the count): equal
    to a run whose two batches share no index, and above one that repeats its batch."""
    est = estimated(True, NESTEROV)
    disjoint, _, _ = measured(True, NESTEROV, [ids(0, 0, ROWS // 2), ids(1, ROWS // 2, ROWS)])
    repeated, _, _ = measured(True, NESTEROV, [ids(), ids()])
    assert est.peak == disjoint
    assert est.peak > repeated


@pytest.mark.parametrize(
    "optimizer",
    [functools.partial(torch.optim.Adagrad, lr=0.1, foreach=False), functools.partial(torch.optim.Adagrad, lr=0.1, foreach=True)],
    ids=["adagrad-loop", "adagrad-foreach"],
)
def test_coalescing_a_sparse_gradient_is_refused_as_a_data_dependent_shape(optimizer):
    # Adagrad coalesces each sparse gradient: the entries kept depend on how many indices repeat
    measured(True, optimizer, [ids(), ids()])  # the step itself runs on the CPU
    with pytest.raises(EstimateUnsupported, match=r"aten\._coalesce.*data-dependent shape") as caught:
        estimated(True, optimizer)
    assert caught.value.operation == "aten._coalesce.default"
    assert "adagrad.py" in str(caught.value)  # the line that coalesced


def test_sparse_adam_is_refused_naming_coalesce():
    with pytest.raises(EstimateUnsupported) as caught:
        estimate_memory(
            lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True), ids(), optimizer=torch.optim.SparseAdam, device="cpu", fit=False
        )
    assert caught.value.operation == "aten._coalesce.default"


def test_fused_sgd_on_sparse_gradients_fails_as_it_does_for_real():
    fused = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True)
    with pytest.raises(RuntimeError, match="does not support sparse") as real:
        measured(True, fused, [ids()])
    with pytest.raises(RuntimeError, match="does not support sparse") as fake:
        estimated(True, fused)
    assert str(real.value) == str(fake.value)


def test_the_emulated_cuda_estimate_takes_the_foreach_path_over_sparse_momentum():
    """On CUDA, SGD takes its foreach path (``_foreach_mul_``, ``_foreach_add_`` over sparse
    buffers: no fake kernel, run as their per-tensor loop); the state holds both gradients'
    entries (CUDA concatenates), each index and value tensor a 512-byte block."""
    est = estimated(True, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), device="cuda")
    entries = 2 * BATCH * BAG
    expected = block_size(entries * 8) + block_size(entries * DIM * 4) + block_size(DIM * 4) + block_size(4)
    assert est.optimizer_state == expected


def _sparse(rows: int, entries: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sparse_coo_tensor(torch.randint(0, rows, (1, entries), generator=g), torch.randn(entries, 4, generator=g), (rows, 4))


FOREACH = [
    ("_foreach_mul_ scalar", lambda s, d: torch._foreach_mul_(s, 0.5)),
    ("_foreach_mul out of place", lambda s, d: torch._foreach_mul(s, 0.5)),
    ("_foreach_div_ scalar list", lambda s, d: torch._foreach_div_(s, [2.0] * len(s))),
    ("_foreach_add_ list", lambda s, d: torch._foreach_add_(s, [t.clone() for t in s], alpha=0.5)),
    ("_foreach_add list", lambda s, d: torch._foreach_add(s, s)),
    ("_foreach_add_ dense += sparse", lambda s, d: torch._foreach_add_(d, s, alpha=-0.1)),
    ("_foreach_copy_", lambda s, d: torch._foreach_copy_(s, [t.clone() for t in s])),
]


@pytest.mark.parametrize("name,op", FOREACH, ids=[n for n, _ in FOREACH])
def test_foreach_operators_over_sparse_tensors_hold_what_their_loop_holds(name, op):
    """Each ``_foreach_`` operator over a list with sparse tensors, on fake tensors, leaves the
    same index and value storages (bytes) as the real operator leaves on the real tensors."""
    sizes = [(100, 12), (50, 7), (30, 0)]  # rows, entries (an empty gradient too)

    def run(make):
        sparse = [make(_sparse(rows, n, i)) for i, (rows, n) in enumerate(sizes)]
        dense = [make(torch.zeros(rows, 4)) for rows, _ in sizes]
        out = op(sparse, dense)
        results = out if isinstance(out, list) and out and out[0] is not sparse[0] else []
        return [held([t]) for t in [*sparse, *dense, *results]]

    real = run(lambda t: t)
    mode = fake_mode()
    with mode:
        fake = run(lambda t: mode.from_tensor(t) if t.layout is torch.strided else _fake_sparse(t))
    assert fake == real


def _fake_sparse(real: torch.Tensor) -> torch.Tensor:
    """A fake sparse tensor holding as many entries as ``real`` (``from_tensor`` keeps none)."""
    from pytorch_mem_profiler.estimate.layouts import sparse_like

    return sparse_like(real, torch.empty_like(real._indices()), torch.empty_like(real._values()), real.is_coalesced())


def test_cuda_mul_in_place_copies_a_sparse_tensor_and_drops_the_old_one():
    """CUDA's ``mul_`` of a sparse tensor by a scalar (SGD's momentum ``_foreach_mul_``) allocates a
    copy of the indices, then new values, and frees the old ones (an H100, torch 2.11: 32,768 and
    1,048,576 bytes allocated, then freed, for 4,096 entries of 64 floats); the CPU's scales the
    values where they are. With the CUDA rules the fake tensor holds new storages of the same bytes."""
    def run(kernels):
        mode = fake_mode(kernels=kernels)
        with mode:
            buf = _fake_sparse(_sparse(100, 12, 0))
            old = [p.untyped_storage() for p in storage_parts(buf)]
            torch._foreach_mul_([buf], 0.9)
            new = [p.untyped_storage() for p in storage_parts(buf)]
        return [o is n or o._cdata == n._cdata for o, n in zip(old, new)], held([buf])

    same_cpu, bytes_cpu = run("cpu")
    same_cuda, bytes_cuda = run("cuda")
    assert same_cpu == [True, True] and same_cuda == [False, False]
    assert bytes_cpu == bytes_cuda == 12 * 8 + 12 * 4 * 4


def test_the_emulated_cuda_step_holds_the_old_and_new_momentum_at_once():
    """In the second step, CUDA's ``_foreach_mul_`` over the sparse momentum makes the buffer's copy
    before it frees the old one, and ``_foreach_add_`` concatenates the gradient's entries into new
    tensors before it frees the copy: in the step's allocator events each replacement's two blocks
    (indices, then values, 512-byte blocks on CUDA) come before the frees of the ones it replaces,
    as the allocator history on an H100 shows them (torch 2.11)."""
    momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    est = estimated(True, momentum, device="cuda")
    events = est.step_events
    sources = events.sources
    table = BATCH * BAG
    copy = [block_size(table * 8), block_size(table * DIM * 4)]
    joined = [block_size(2 * table * 8), block_size(2 * table * DIM * 4)]
    second = [(key, n) for i, (key, n) in enumerate(events.events) if events.phase_at(i) == (2, "optimizer")]
    sparse = [(key, n) for key, n in second if abs(n) in (*copy, *joined)]
    made_by = [sources[key].split(";")[0] for key, n in sparse]
    # frees: the values, then the indices (measured so: 1,048,576 then 32,768 bytes)
    assert [n for _, n in sparse] == [*copy, -copy[1], -copy[0], *joined, -copy[1], -copy[0]], sparse
    assert made_by[:2] == ["aten._foreach_mul_.Scalar"] * 2 and made_by[4:6] == ["aten._foreach_add_.List"] * 2
