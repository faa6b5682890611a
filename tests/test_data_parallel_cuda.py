"""``nn.DataParallel`` on two GPUs: the replica on the profiled GPU is measured, the other's,
running meanwhile in its own thread with the model's hooks, is not (the CPU test of the threads
is ``tests/test_data_parallel_threads.py``). Figures against a pack hook inside each replica's
forward and the parameters' and optimizer state's storages; the Hugging Face Trainer wraps the
model in ``DataParallel`` itself on a machine with several GPUs when not launched by ``torchrun``.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

from .helpers import SavedBytes, nbytes
from .test_integrations import TokenData, recording_hf_callback, storage_bytes, tiny_gpt2

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


class KeepsTrack(nn.Module):
    """A network whose forward notes, per GPU, what autograd kept (a pack hook in the replica's own
    thread, where ``watch``) and the bytes of its output."""

    def __init__(self, watch: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        self.watch = watch
        self.kept: dict[int, SavedBytes] = {}
        self.out_bytes: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.watch:
            out = self.net(x)
        else:
            # the weights: the model's, or the replica's copies (on GPU 0 the same storages)
            copies = tuple(t for m in self.modules() for t in getattr(m, "_former_parameters", {}).values())
            kept = self.kept[x.device.index] = SavedBytes(self, (*copies, x))
            with kept.hooks():
                out = self.net(x)
        self.out_bytes[x.device.index] = nbytes(out)
        return out


STEPS = 4


def train(profiled: bool, by_layer: bool = False, watch: bool = True) -> tuple[list[float], list, list[int], KeepsTrack]:
    """Losses, the records, and what the replica on GPU 0 kept, of STEPS steps."""
    torch.manual_seed(0)
    model = KeepsTrack(watch).cuda(0)
    parallel = nn.DataParallel(model, device_ids=[0, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 256, generator=gen).cuda(0) for _ in range(STEPS)]
    losses, records, kept = [], [], []
    profiler = None
    if profiled:  # every iteration in detail (no cost budget): each is checked
        profiler = MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=by_layer, overhead=None)
    with profiler if profiler is not None else contextlib.nullcontext():
        for x in xs:
            model.kept.clear()
            loss = parallel(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            kept.append(model.kept[0].total if 0 in model.kept else 0)
            if profiler is not None:
                records.append(profiler.record_stats())
    return losses, records, kept, model


@pytest.mark.parametrize("by_layer", [False, True])
def test_data_parallel_measures_the_replica_on_the_profiled_gpu(by_layer):
    unprofiled, _, kept_unprofiled, _ = train(False)
    # by layer, the pack hook inside the forward would hide the profiler's (the innermost pair is
    # autograd's): what it keeps is the unprofiled run's
    losses, records, kept, model = train(True, by_layer, watch=not by_layer)
    assert losses == unprofiled  # the same run, bit for bit
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    kept = kept_unprofiled if by_layer else kept
    assert all(k == kept[0] > 0 for k in kept)
    weights = storage_bytes(model.parameters())
    out_bytes = model.out_bytes[0]
    for i, record in enumerate(records):
        assert record.device == "cuda:0"
        assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
        assert record.weights == record.gradients == weights
        assert record.optimizer_state == 2 * weights  # AdamW's two moments (its step counts on the CPU)
        if i:  # the first forward's thread also takes cuBLAS's workspaces (a thread's first matmul)
            # what the replica on GPU 0 kept for backward and its output; GPU 1's is not this device's
            assert record.feature_maps == kept[i] + out_bytes
        if by_layer:
            acts = {m: n for (m, c), n in record.layers.by_module.items() if c == "activations" and m != "(input)"}
            # GELU keeps its input (the first linear's output), the second linear GELU's output
            assert acts == {"net.1": kept[i] // 2, "net.2": kept[i] // 2}


def test_hf_trainer_with_data_parallel_on_two_gpus(tmp_path):
    transformers = pytest.importorskip("transformers")
    records = []
    callback = recording_hf_callback(records, overhead=None)  # every step in detail: each is checked
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_train_epochs=1, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(12))
    callback.add_to(trainer)
    trainer.train()
    assert args.n_gpu == torch.cuda.device_count() >= 2
    assert isinstance(trainer.model_wrapped, nn.DataParallel)
    assert len(records) == 12 // (2 * args.n_gpu)
    for r in records:
        assert r.device == "cuda:0"
        assert (r.forward_passes, r.backward_passes, r.optimizer_steps) == (1, 1, 1)
        assert r.feature_maps > 0
    last = records[-1]
    assert last.weights == last.gradients == storage_bytes(model.parameters())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    on_device = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    assert last.optimizer_state == storage_bytes(on_device) > 0
