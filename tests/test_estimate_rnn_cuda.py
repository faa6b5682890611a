"""On a GPU: recurrent layers estimated on fake CUDA tensors against the real step (cuDNN's RNN kernels)."""

from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class LanguageModel(nn.Module):
    def __init__(self, kind: type[nn.Module], **kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(10_000, 256)
        self.rnn = kind(256, 512, num_layers=2, batch_first=True, **kwargs)
        self.head = nn.Linear(512 * (2 if kwargs.get("bidirectional") else 1), 10_000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def _measured(build, batch: int, seq: int, autocast, *, optimizer=SGD, loss=lambda out: out.float().sum()) -> int:  # type: ignore[no-untyped-def]
    """max_memory_allocated over two steps (SGD, a sum loss by default) of token batches of ``seq``,
    above what was allocated before the model (after a warm-up)."""
    for size in (1, batch):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = build().to(CUDA)
        opt = optimizer(model.parameters())
        x = torch.zeros(size, seq, dtype=torch.long, device=CUDA)
        for _ in range(2):
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                out = model(x)
            loss(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del model, opt, x
    return peak


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_recurrent_language_model_on_fake_cuda_is_within_its_bound_of_the_real_step(kind, autocast):
    build = functools.partial(LanguageModel, kind)
    est = estimate_memory(
        build, lambda b: torch.zeros(b, 64, dtype=torch.long), batch_size=32, optimizer=SGD, autocast=autocast,
        device=CUDA, workspace=0, fit=False,
    )  # fmt: skip
    assert not est.emulated
    measured = _measured(build, 32, 64, autocast)
    # the warm-up's cuBLAS workspaces stay allocated: both sides are the tensors and cuDNN's buffers
    assert abs(est.peak_allocated - measured) <= est.error_bound + 0.02 * measured, (est.peak_allocated, measured, est.error_bound)


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        (nn.GRU, {}),
        (nn.LSTM, {}),
        (nn.LSTM, {"bidirectional": True}),
        (nn.LSTM, {"proj_size": 128}),
        pytest.param(
            nn.RNN, {"bias": False},
            marks=pytest.mark.xfail(strict=True, reason="a plain RNN without biases: the flat buffer is not the weights' sum on the H200 (torch 2.11, cuDNN 9); not modelled"),
        ),  # fmt: skip
    ],
)
def test_model_to_cuda_leaves_a_recurrent_layer_s_weights_in_one_buffer_of_their_sum(kind, kwargs):
    """cuDNN's weight space is the weights' sum: the rule the estimate's flat buffer follows."""
    rnn = kind(256, 512, num_layers=2, **kwargs).to(CUDA)
    storages = {p.untyped_storage().data_ptr() for p in rnn.parameters()}
    assert len(storages) == 1
    assert rnn.weight_ih_l0.untyped_storage().nbytes() == sum(p.numel() * p.element_size() for p in rnn.parameters())


@pytest.mark.xfail(
    strict=False,  # it passes where tests before it in the same process left the allocator so (test order)
    reason="the GRU language model's weights before the step peak at 41,795,072 bytes estimated against 42,286,592 "
    "measured (H200, torch 2.11): 491,520 bytes that model.to(cuda) holds and the flat-buffer rule does not",
)
def test_the_weights_before_the_step_peak_as_model_to_cuda_does():
    """What allocated peaks at while model.to(CUDA) runs, against the estimate's weights before the step."""
    build = functools.partial(LanguageModel, nn.GRU)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = build().to(CUDA)
    real_peak, real_kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    del model
    est = estimate_memory(build, lambda b: torch.zeros(b, 16, dtype=torch.long), batch_size=4, optimizer=SGD, device=CUDA, fit=False)
    events = est.step_events
    now = peak = 0
    for key, nbytes in events.events[: events.marks[0][0]]:
        if key >= 0 and events.sources[key].endswith("weights"):
            now += nbytes
            peak = max(peak, now)
    assert (peak, now) == (real_peak, real_kept)


def test_cudnn_s_dropout_state_is_the_rule_s_size_for_this_card():
    from pytorch_mem_profiler.estimate.rnn import dropout_state_bytes
    from pytorch_mem_profiler.measure.devices import cuda_multiprocessors

    state = torch._cudnn_init_dropout_state(0.5, True, 0, dtype=torch.uint8, device=CUDA)
    size, bound = dropout_state_bytes(cuda_multiprocessors(CUDA))
    assert abs(state.numel() - size) <= bound, (state.numel(), size, torch.cuda.get_device_name())
    print(f"cuDNN dropout state on {torch.cuda.get_device_name()}: {state.numel()} bytes, rule {size}")


def test_the_probe_measures_a_recurrent_layers_workspace_as_this_process_does():
    from pytorch_mem_profiler.estimate.kernel_probe import MEASURED, measure_convolutions, recurrent_key
    from pytorch_mem_profiler.measure.kernel_scratch import run_recurrent

    key = recurrent_key("gru", seq_len=128, batch=97, input_size=512, hidden=512, proj=512, layers=2, directions=1,
                        bias=True, batch_first=True, dtype=torch.float32, dropout=0.0, train=True)  # fmt: skip
    here = run_recurrent(list(key), CUDA)
    gc.collect()
    torch.cuda.empty_cache()
    MEASURED.pop(key, None)
    assert here is not None and here > 0
    assert measure_convolutions([key], CUDA) == {key: here}


@pytest.mark.parametrize("name", ["lstm_lm", "gru_lm"])
def test_recurrent_language_models_with_measured_workspaces_meet_the_goals(name):
    """With ``measure_kernels=True`` (and on fake CUDA tensors anyway) cuDNN's own sizes are taken: no
    bound is left for them and the peak is within 2% of the real step (the zoo's real sizes). Reserved
    is checked in a fresh process by ``benchmarks/zoo_conformance.py``: inside a test session the
    segments earlier tests leave behind (an xfailed test's traceback keeps its tensors) change what
    this step reserves, 2.63 GB here against 1.73 GB fresh for the LSTM on an H100."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from zoo import ZOO
    from zoo_conformance import measure_step

    entry = ZOO[name]
    batch = entry.batch["real"]
    measured = measure_step(entry, batch, CUDA)
    est = estimate_memory(**entry.estimate_kwargs("real"), batch_size=batch, device=CUDA, fit=False, measure_kernels=True)
    detail = (f"{name}: measured {measured['allocated']:,} / reserved {measured['reserved']:,}; estimated "
              f"{est.peak:,} / {est.reserved:,} (bounds {dict(est.error_bounds)})")  # fmt: skip
    print(detail)
    assert not any("_cudnn_rnn" in op and "reserve" not in op for op in est.error_bounds), detail
    assert abs(est.peak - measured["allocated"]) <= 0.02 * measured["allocated"], detail
