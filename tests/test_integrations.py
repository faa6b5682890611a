"""The framework integrations, with the real frameworks: Lightning, the Hugging Face Trainer, accelerate.

Each run's records are compared with figures computed independently (bytes of
the tensors themselves, a hand-written loop over the same model and batch).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

from .helpers import nbytes, needs_saved_tensor_watch, transformers_or_skip

BATCH, D_IN, HIDDEN, D_OUT = 64, 32, 64, 10


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: the independent count."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_storage_bytes(optimizer) -> int:
    return storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))


def batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, D_IN, generator=generator) for _ in range(n)]


def hand_written_records(n: int, by_layer: bool = False) -> list:
    """The same model, optimizer and batches as the Lightning module, in a plain loop."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    records = []
    data = batches(n)  # made before the profiler, as the Lightning loader's are
    with MemoryProfiler(net, 1, optimizer=opt, stream=io.StringIO(), strict=True, by_layer=by_layer) as profiler:
        for x in data:
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            records.append(profiler.record_stats())
    return records


# -- Lightning ---------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")


class Regressor(pl.LightningModule):
    """A LightningModule whose training_step calls ``self.net``: the root's forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class MemoryLogger(pl.loggers.Logger):
    """A logger that keeps what it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory-test"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))


def fit(callback, epochs: int = 2, batches_per_epoch: int = 4, **trainer_kwargs):
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback  # noqa: F401

    module = Regressor()
    logger = MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        limit_train_batches=batches_per_epoch,
        callbacks=[callback],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    loader = torch.utils.data.DataLoader(batches(batches_per_epoch * epochs), batch_size=None)
    trainer.fit(module, loader)
    return module, trainer, logger


def test_lightning_records_match_the_hand_written_loop(tmp_path):
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback

    records = []

    class Keep(MemoryProfilerCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            records.append(self.profiler.last_record)

    callback = Keep(print_period=2, csv=True, csv_dir=tmp_path, stream=io.StringIO(), strict=True)
    module, trainer, logger = fit(callback)
    assert len(records) == 8
    assert [(r.epoch, r.iteration) for r in records] == [(e, i) for e in (1, 2) for i in (1, 2, 3, 4)]
    for r in records:
        # Watched: the first iteration (where the forward enters the module is learned) and
        # the reported ones; between them the hooks are off and the counts unknown.
        watched = r.reported or (r.epoch, r.iteration) == (1, 1)
        assert (r.forward_passes, r.backward_passes, r.optimizer_steps) == ((1, 1, 1) if watched else (None,) * 3)
    # Weights, gradients and optimizer state: the tensors' own bytes.
    params = list(module.parameters())
    last = records[-1]
    assert last.weights == sum(nbytes(p) for p in params)
    assert last.gradients == last.weights
    assert last.optimizer_state == optimizer_state_storage_bytes(trainer.optimizers[0]) > 0
    # What forward keeps for backward: ReLU's output and the net's output.
    assert last.feature_maps == BATCH * (HIDDEN + D_OUT) * 4
    # The same figures as the plain loop, iteration by iteration, the peak's phase included.
    plain = hand_written_records(4)
    for ours, theirs in zip(records[:4], plain):
        for figure in ("weights", "optimizer_state", "allocated"):
            assert getattr(ours, figure) == getattr(theirs, figure), figure
        # Lightning keeps a detached copy of the loss for its logs (ClosureResult): one float32 more.
        assert ours.iteration_peak_allocated == theirs.iteration_peak_allocated + 4
        if ours.reported:  # the figures measured phase by phase (print_period=2: iterations 2 and 4)
            for figure in ("feature_maps", "gradients", "peak_phase"):
                assert getattr(ours, figure) == getattr(theirs, figure), figure
        else:
            assert ours.feature_maps is ours.gradients is ours.peak_phase is None
    # The closed profiler left nothing on the module.
    assert callback.profiler.closed
    assert not module.net._forward_pre_hooks and not module._forward_pre_hooks
    # Reported records went to the trainer's loggers, a handful of figures in the profiler's unit.
    sent = [m for _, m in logger.metrics if any(k.startswith("memory/") for k in m)]
    assert len(sent) == 4  # iterations 2 and 4 of each epoch
    assert sent[-1]["memory/iteration_peak_MB"] == last.iteration_peak_allocated / 1e6
    assert sent[-1]["memory/feature_maps_MB"] == last.feature_maps / 1e6
    assert len(sent[-1]) <= 8
    # One CSV file, a row per reported batch.
    import pandas as pd

    frame = pd.read_csv(callback.profiler.csv_path)
    assert list(zip(frame["epoch"], frame["iteration"])) == [(1, 2), (1, 4), (2, 2), (2, 4)]


@needs_saved_tensor_watch
def test_lightning_per_layer_names_come_from_the_module(tmp_path):
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback

    callback = MemoryProfilerCallback(1, by_layer=True, stream=io.StringIO(), strict=True)
    fit(callback, epochs=1, batches_per_epoch=2)
    layers = callback.profiler.last_record.layers
    assert layers is not None
    # ReLU keeps its output; the second Linear keeps its input (the same storage: counted once, by ReLU).
    assert dict(layers.by_module) == {("net.1", "activations"): BATCH * HIDDEN * 4, ("(input)", "activations"): BATCH * D_IN * 4}


def test_lightning_callback_checks_its_arguments_when_made():
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback

    with pytest.raises(ValueError, match="print_period"):
        MemoryProfilerCallback(print_period=0)
    with pytest.raises(TypeError, match="no_such_option"):
        MemoryProfilerCallback(no_such_option=True)


# -- Hugging Face Trainer -----------------------------------------------------------
transformers = pytest.importorskip("transformers")


def tiny_gpt2():
    """A two-block GPT-2; skips the test where this transformers refuses this torch."""
    refusal = f"transformers {transformers.__version__} refuses torch {torch.__version__}"
    if not transformers.utils.is_torch_available():
        pytest.skip(f"{refusal}: it builds no models")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    try:
        return transformers.GPT2LMHeadModel(config)
    except ImportError as err:  # transformers' stand-in class for a torch it does not support
        if "requires PyTorch" not in str(err):
            raise
        pytest.skip(f"{refusal}: {' '.join(str(err).split()[:6])}")


def hf_callback():  # type: ignore[no-untyped-def]
    """The integration's callback class; skips the test where this transformers refuses this torch."""
    transformers_or_skip()
    from pytorch_mem_profiler.integrations.transformers import MemoryProfilerCallback

    return MemoryProfilerCallback


def recording_hf_callback(records: list, **options):  # type: ignore[no-untyped-def]
    """The Trainer callback (``print_period=1``, strict, quiet), appending each optimizer step's
    record to ``records``."""
    MemoryProfilerCallback = hf_callback()

    class Keep(MemoryProfilerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            super().on_step_end(args, state, control, **kwargs)
            records.append(self.profiler.last_record)

    return Keep(**{"print_period": 1, "stream": io.StringIO(), "strict": True, **options})


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 97, (n, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_hf(tmp_path, callback, *, accumulation: int = 2, epochs: int = 2, examples: int = 16, first: bool = False):
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(examples))
    if first:
        callback.add_to(trainer)
    else:
        trainer.add_callback(callback)
    trainer.train()
    return model, trainer


def test_hf_trainer_a_record_per_optimizer_step(tmp_path):
    records = []
    callback = recording_hf_callback(records)
    model, trainer = train_hf(tmp_path, callback)
    # 16 examples, batches of 4, 2 micro-batches per step: 2 steps an epoch, 2 epochs.
    assert [(r.epoch, r.iteration) for r in records] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in records:
        assert (r.forward_passes, r.backward_passes, r.optimizer_steps) == (2, 2, 1)
    last = records[-1]
    # GPT-2 ties its input embedding and output projection: one storage, counted once.
    assert last.weights == storage_bytes(model.parameters())
    assert last.optimizer_state == optimizer_state_storage_bytes(trainer.optimizer.optimizer
                                                                 if hasattr(trainer.optimizer, "optimizer")
                                                                 else trainer.optimizer) > 0
    # The figures are in the Trainer's logs.
    logged = [h for h in trainer.state.log_history if "memory/iteration_peak_MB" in h]
    assert logged and logged[-1]["memory/iteration_peak_MB"] == last.iteration_peak_allocated / 1e6


def test_hf_reporting_callbacks_see_the_figures_when_added_first(tmp_path):
    MemoryProfilerCallback = hf_callback()

    seen = []

    class Reporter(transformers.TrainerCallback):  # stands for TensorBoard, W&B, ...
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    callback = MemoryProfilerCallback(print_period=1, stream=io.StringIO(), strict=True)
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(8), callbacks=[Reporter()])
    callback.add_to(trainer)
    trainer.train()
    with_memory = [s for s in seen if "memory/allocated_MB" in s]
    assert len(with_memory) >= 2


# -- accelerate, a plain loop ---------------------------------------------------------
accelerate = pytest.importorskip("accelerate")


def test_accelerate_prepared_loop_is_exact(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True)
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net, opt = accelerator.prepare(net, opt)
    # The prepared optimizer may be given as it is: the profiler counts the one it wraps.
    data = batches(3)
    with MemoryProfiler(net, 1, optimizer=opt, stream=io.StringIO(), strict=True) as profiler:
        for x in data:
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            record = profiler.record_stats()
    assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (1, 1, 1)
    assert record.weights == sum(nbytes(p) for p in net.parameters())
    assert record.gradients == record.weights
    inner = opt.optimizer
    assert record.optimizer_state == optimizer_state_storage_bytes(inner) > 0
    assert record.feature_maps == BATCH * (HIDDEN + D_OUT) * 4
    plain = hand_written_records(3)[-1]
    assert record.allocated == plain.allocated
    # accelerator.backward divides the loss by the accumulation steps: one more float32 scalar.
    assert record.iteration_peak_allocated == plain.iteration_peak_allocated + 4


def test_lightning_progress_bar_and_compact_reports_share_the_console(capsys):
    from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback

    callback = MemoryProfilerCallback(print_period=2, strict=True)
    module = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=4, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches(4), batch_size=None))
    out = capsys.readouterr()
    console = out.out + out.err
    # The compact report's first line starts a line of its own: never glued to the bar's.
    heads = [line for line in console.splitlines() if "Memory at iteration" in line]
    assert [h.split("(")[0].strip() for h in heads] == ["Memory at iteration 2 of epoch 1", "Memory at iteration 4 of epoch 1"]
    assert all(line.startswith("Memory at iteration") for line in heads)


@pytest.mark.parametrize("module", ["lightning", "pytorch_lightning", "transformers"])
def test_a_missing_framework_says_what_to_install(module, monkeypatch):
    import importlib
    import sys

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, f"pytorch_mem_profiler.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match="pip install"):
        importlib.import_module(f"pytorch_mem_profiler.integrations.{module}")


def test_a_transformers_that_refuses_this_torch_says_what_to_install(monkeypatch):
    import importlib
    import sys

    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.utils, "is_torch_available", lambda: False)
    monkeypatch.delitem(sys.modules, "pytorch_mem_profiler.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=rf"transformers {transformers.__version__} refuses torch .*pip install 'transformers<5'"):
        importlib.import_module("pytorch_mem_profiler.integrations.transformers")
