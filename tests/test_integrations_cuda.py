"""The framework integrations on a GPU: Lightning and the Hugging Face Trainer, real packages."""

from __future__ import annotations

import io

import pytest
import torch

from .test_integrations import (
    BATCH,
    D_OUT,
    HIDDEN,
    Regressor,
    TokenData,
    batches,
    recording_hf_callback,
    storage_bytes,
    tiny_gpt2,
)

pytestmark = pytest.mark.cuda

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")


def test_lightning_on_a_gpu():
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback

    records, moments = [], []

    class Keep(MemoryProfilerCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            records.append(self.profiler.last_record)
            # Read now: at the end of fit, Lightning moves the optimizer's state to the CPU.
            # Adam's step counters stay on the CPU: only the moments are on the device.
            state = trainer.optimizers[0].state
            moments.append(storage_bytes(v for s in state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda))

    callback = Keep(print_period=1, stream=io.StringIO(), strict=True)
    module = Regressor()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=4, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches(4), batch_size=None))
    assert len(records) == 4
    last = records[-1]
    assert last.device.startswith("cuda")
    for r in records:
        assert (r.forward_passes, r.backward_passes, r.optimizer_steps) == (1, 1, 1)
    assert last.weights == storage_bytes(module.parameters())
    assert last.gradients == last.weights
    assert [r.optimizer_state for r in records] == moments and moments[-1] > 0
    assert last.feature_maps == BATCH * (HIDDEN + D_OUT) * 4
    assert last.device_total == torch.cuda.get_device_properties(0).total_memory


def test_hf_trainer_on_a_gpu(tmp_path):
    records = []
    callback = recording_hf_callback(records)
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=1, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(16))
    callback.add_to(trainer)
    trainer.train()
    # on a machine with several GPUs the Trainer runs nn.DataParallel over them (a batch of 4 each)
    assert len(records) == 16 // (args.train_batch_size * 2)
    for r in records:
        assert r.device.startswith("cuda")
        assert (r.forward_passes, r.backward_passes, r.optimizer_steps) == (2, 2, 1)
    last = records[-1]
    assert last.weights == storage_bytes(model.parameters())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    on_device = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.is_cuda]
    assert last.optimizer_state == storage_bytes(on_device) > 0
    logged = [h for h in trainer.state.log_history if "memory/iteration_peak_MB" in h]
    assert logged and logged[-1]["memory/iteration_peak_MB"] == last.iteration_peak_allocated / 1e6
