"""The CPU counter under FSDP2 and DTensors: a rank's own memory, not the global shapes.

Two things the dispatcher alone does not show: a ``DTensor``'s storage claims the
bytes of its *global* shape (its memory is its local shard), and FSDP2 frees and
remakes its all-gathered parameters with ``UntypedStorage.resize_``, which no
dispatch mode sees. Before these were handled, a 2-rank FSDP2 step of a 33.6 MB
model on gloo read 134.3 MB at its end where the rank held 50.4 MB (shards and
AdamW's state). Here one process is rank 0 of a fake 2-rank group (real tensors,
no communication), and every figure is checked against the storages themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pytorch_mem_profiler.measure.accounting import storage_parts
from pytorch_mem_profiler.measure import storage_counting
from pytorch_mem_profiler.measure.devices import CpuCounter
from pytorch_mem_profiler.measure.storage_counting import unwatch_storage_resizes, watch_storage_resizes
from pytorch_mem_profiler.torch_versions import FSDP2_ON_CPU

from .helpers import local_storage_bytes



@pytest.fixture
def fake_two_ranks():
    """This process as rank 0 of a fake process group of two ranks, torn down after."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield 2
    finally:
        dist.destroy_process_group()


def test_storage_resize_is_counted_and_the_method_put_back(counter):
    assert "resize_" in torch.UntypedStorage.__dict__  # watched while the counter runs
    x = torch.empty(1000)  # 4000 bytes
    assert counter.read().allocated == 4000
    x.untyped_storage().resize_(0)
    assert counter.read().allocated == 0
    x.untyped_storage().resize_(8000)
    reading = counter.read()
    assert (reading.allocated, reading.peak_allocated) == (8000, 8000)
    counter.stop()
    # put back as it was before the counter: the C method (or what another tool left in the class)
    before = storage_counting._ORIGINAL_RESIZE if storage_counting._ORIGINAL_IN_CLASS else None
    assert torch.UntypedStorage.__dict__.get("resize_") is before


def test_resize_listeners_come_and_go_in_any_order():
    seen_a, seen_b = [], []
    installed = torch.UntypedStorage.__dict__.get("resize_")  # nothing, or what another tool left there
    a = lambda s, before: seen_a.append((before, s.nbytes()))  # noqa: E731
    b = lambda s, before: seen_b.append((before, s.nbytes()))  # noqa: E731
    watch_storage_resizes(a)
    watch_storage_resizes(b)
    storage = torch.zeros(8).untyped_storage()
    storage.resize_(16)
    unwatch_storage_resizes(a)
    storage.resize_(0)
    unwatch_storage_resizes(b)
    storage.resize_(4)
    assert seen_a == [(32, 16)] and seen_b == [(32, 16), (16, 0)]
    assert torch.UntypedStorage.__dict__.get("resize_") is installed


def test_a_resize_wrapper_installed_before_the_counter_is_put_back():
    # someone's own wrapper of UntypedStorage.resize_ (another tool's): still there, and still
    # called, after the counter came and went
    original = torch.UntypedStorage.resize_
    calls = []

    def theirs(storage, size):
        calls.append(size)
        return original(storage, size)

    torch.UntypedStorage.resize_ = theirs
    try:
        listen = lambda storage, before: None  # noqa: E731
        watch_storage_resizes(listen)
        unwatch_storage_resizes(listen)
        assert torch.UntypedStorage.__dict__.get("resize_") is theirs
        torch.zeros(4).untyped_storage().resize_(0)
        assert calls == [0]
    finally:
        del torch.UntypedStorage.resize_
    assert torch.UntypedStorage.resize_ is original


def test_a_dtensor_counts_its_local_shard(fake_two_ranks, counter):
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch < 2.5: DTensor's private home
        from torch.distributed._tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (fake_two_ranks,))
    base = counter.read().allocated
    whole = torch.zeros(1024, 256)  # 1 MiB
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    del whole
    doubled = sharded * 2  # a DTensor operator's result: a new local shard
    assert [t.untyped_storage().nbytes() for t in storage_parts(doubled)] == [512 * 256 * 4]
    assert doubled.untyped_storage().nbytes() == 1024 * 256 * 4  # what the wrapper claims
    assert counter.read().allocated - base == local_storage_bytes([sharded, doubled]) == 2 * 512 * 256 * 4


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 on the CPU needs torch >= 2.6")
def test_fsdp2_step_counts_the_ranks_shards_state_and_gathered_parameters(fake_two_ranks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width, layers = 256, 4
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (fake_two_ranks,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    counter = CpuCounter()
    counter.start()
    try:
        counter.adopt(list(model.parameters()))
        gathered_during_forward = []

        def after_block(module, args, output):
            gathered_during_forward.append(counter.read().allocated)

        handles = [block.register_forward_hook(after_block) for block in model]
        for _ in range(2):
            model(torch.randn(8, width)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for h in handles:
            h.remove()
        end = counter.read().allocated
    finally:
        counter.stop()
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    full = sum(p.numel() * p.element_size() for p in params)
    # Each rank holds half of every parameter, and AdamW's two moments of that half.
    assert local_storage_bytes(params) == full // 2
    assert end == local_storage_bytes(params) + local_storage_bytes(state)
    assert local_storage_bytes(state) == 2 * full // 2 + 4 * len(params)  # exp_avg, exp_avg_sq; a float32 step each
    # A block's gathered parameters are freed (resize_(0)) once its forward ends: after
    # each block's forward the level grows by that block's output (8 x 256 float32, kept
    # for the next block's backward), not by a gathered block (256 x 257 float32).
    second_step = gathered_during_forward[layers:]
    assert [b - a for a, b in zip(second_step, second_step[1:])] == [8 * width * 4] * (layers - 1)
    assert "resize_" not in torch.UntypedStorage.__dict__
