"""estimate_memory on the CPU: the fake step's figures against the profiler's measured CPU peaks,
byte for byte, and against bytes counted independently."""

from __future__ import annotations

import functools
import gc
import io
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pytorch_mem_profiler import MemoryProfiler, estimate_memory
from pytorch_mem_profiler.estimate import OPTIMIZATIONS, EstimateUnsupported
from pytorch_mem_profiler.estimate.allocator import block_size, cublas_workspace_bytes, segment_size, simulate_reserved
from pytorch_mem_profiler.estimate.records import max_batch_from_records
from pytorch_mem_profiler.measure.saved_tensors import can_chain, top_saved_tensors_hooks
from pytorch_mem_profiler.stats import PEAK_CATEGORIES, WEIGHT_COPIES

from .helpers import measured_peak, nbytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from optimizations import FeedForwardStack  # noqa: E402

CPU = "cpu"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.Flatten(), nn.LazyLinear(10)
    )


SGD = functools.partial(torch.optim.SGD, lr=0.1)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(
    "build, shape, optimizer",
    [
        (mlp, (8, 64), torch.optim.Adam),
        (mlp, (200, 64), torch.optim.AdamW),
        (mlp, (32, 64), MOMENTUM),
        (lambda: FeedForwardStack(64, 3), (4, 32, 64), torch.optim.Adam),
        (lambda: FeedForwardStack(32, 2), (2, 16, 32), SGD),
    ],
    ids=["mlp-adam-8", "mlp-adamw-200", "mlp-momentum-32", "ffstack-adam", "ffstack-sgd"],
)
def test_estimate_equals_the_measured_cpu_peak_to_the_byte(build, shape, optimizer):
    estimate = estimate_memory(build(), torch.zeros(shape), optimizer=optimizer, device=CPU, fit=False)
    assert estimate.peak == measured_peak(build, lambda: torch.randn(shape), optimizer)
    assert sum(estimate.peak_breakdown.values()) == estimate.peak
    assert set(estimate.peak_breakdown) == set(PEAK_CATEGORIES)


OPTIMIZERS = {
    "adagrad": torch.optim.Adagrad,  # its state is made when it is built, not at its first step
    "adagrad-loop": functools.partial(torch.optim.Adagrad, foreach=False),
    "rmsprop-centered-momentum": functools.partial(torch.optim.RMSprop, momentum=0.9, centered=True),
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adamax": torch.optim.Adamax,
    "adadelta": torch.optim.Adadelta,
    "asgd": torch.optim.ASGD,
    "rprop": torch.optim.Rprop,
    "adam-amsgrad": functools.partial(torch.optim.Adam, amsgrad=True),
    "adamw-loop": functools.partial(torch.optim.AdamW, foreach=False),
    "sgd-nesterov": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
}
if hasattr(torch.optim, "Adafactor"):  # torch 2.5 and later: its step reads each weight's norm (.item())
    OPTIMIZERS["adafactor"] = torch.optim.Adafactor


def _steps_on_the_cpu(optimizer) -> bool:
    """Whether this torch's ``optimizer`` takes a real step on the CPU (fused kernels came to it late)."""
    weight = nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    try:
        optimizer([weight]).step()
    except (RuntimeError, ValueError, TypeError, AssertionError):
        return False
    return True


# torch's fused steps (no fake kernel for some of them) and settings given as tensors (the constructor
# checks ``0.0 <= lr`` in Python): each as a user writes it
SETTINGS_AS_TENSORS = {
    "sgd-fused": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True),
    "adagrad-fused": functools.partial(torch.optim.Adagrad, fused=True),
    "adam-fused-tensor-lr": functools.partial(torch.optim.Adam, lr=torch.tensor(1e-3), fused=True),
    "adamw-tensor-lr": functools.partial(torch.optim.AdamW, lr=torch.tensor(1e-3)),
    "adam-tensor-betas": functools.partial(torch.optim.Adam, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=False),
    "sgd-tensor-lr": functools.partial(torch.optim.SGD, lr=torch.tensor(0.1), momentum=0.9),
}
OPTIMIZERS.update((name, made) for name, made in SETTINGS_AS_TENSORS.items() if _steps_on_the_cpu(made))


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_every_torch_optimizer_is_estimated_to_the_byte(optimizer):
    """torch's optimizers beside Adam and SGD, on the CPU: the estimate equals the measured peak, and
    its optimizer state equals the state's unique storages after the real step."""
    estimate = estimate_memory(mlp, torch.zeros(8, 64), optimizer=optimizer, device=CPU, fit=False)
    assert estimate.peak == measured_peak(mlp, lambda: torch.randn(8, 64), optimizer)
    model = mlp()
    opt = optimizer(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)}  # fmt: skip
    assert estimate.optimizer_state == sum(state.values())


def test_numbers_the_optimizers_step_reads_get_a_stand_in_and_a_note_but_the_models_are_refused():
    """A number read inside ``optimizer.step()`` only scales an update in place: 1 stands in and the
    report says which line read it. The same read in the model's forward is still refused."""
    from pytorch_mem_profiler.estimate import EstimateUnsupported

    class NormScaledSGD(torch.optim.Optimizer):
        def __init__(self, params):  # type: ignore[no-untyped-def]
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            for group in self.param_groups:
                for p in group["params"]:
                    scale = p.norm().item()  # a number the update is scaled by
                    p.add_(p.grad, alpha=-group["lr"] * scale)

    estimate = estimate_memory(mlp, torch.zeros(8, 64), optimizer=NormScaledSGD, device=CPU, fit=False)
    assert estimate.peak == measured_peak(mlp, lambda: torch.randn(8, 64), NormScaledSGD)
    assert any("scale = p.norm().item()" in note and "stood in" in note for note in estimate.notes), estimate.notes

    class ReadsInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * x.norm().item()

    with pytest.raises(EstimateUnsupported):
        estimate_memory(ReadsInForward(), torch.zeros(8, 64), optimizer=NormScaledSGD, device=CPU, fit=False)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_by_name():
    """LBFGS runs the forward and backward inside its step, as often as the loss's value decides: refused
    with its name, not a TypeError from inside the step."""
    from pytorch_mem_profiler.estimate import EstimateUnsupported

    with pytest.raises(EstimateUnsupported) as refused:
        estimate_memory(mlp, torch.zeros(8, 64), optimizer=torch.optim.LBFGS, device=CPU, fit=False)
    assert refused.value.operation == "LBFGS.step(closure)" and "MemoryProfiler" in str(refused.value)


def test_model_state_figures_equal_bytes_counted_by_hand():
    model = mlp()
    estimate = estimate_memory(model, torch.zeros(16, 64), optimizer=torch.optim.Adam, device=CPU, fit=False)
    weights = sum(nbytes(p) for p in model.parameters())
    assert estimate.weights == weights == (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10) * 4
    assert estimate.gradients == weights
    # Adam: two moments per parameter, and a 4-byte step counter per parameter
    assert estimate.optimizer_state == 2 * weights + 4 * len(list(model.parameters()))
    assert estimate.inputs == 16 * 64 * 4
    assert estimate.buffers == 0 and estimate.batch_size == 16


def test_a_linear_layer_with_plain_sgd_peaks_as_computed_by_hand():
    # y = x W^T, loss = y.sum(): forward keeps x (the input) and makes y; backward makes
    # the gradient of the loss (4 bytes, expanded), then grad W = ones^T x. The peak is in
    # backward: W + x + y (alive as the output) + grad W + the loss and its gradient.
    d_in, d_out, batch = 100, 30, 50
    model = nn.Linear(d_in, d_out, bias=False)
    estimate = estimate_memory(model, torch.zeros(batch, d_in), optimizer=SGD, device=CPU, fit=False)
    w, x, y = d_in * d_out * 4, batch * d_in * 4, batch * d_out * 4
    assert estimate.peak == w + x + y + w + 4 + 4
    assert estimate.peak == measured_peak(lambda: nn.Linear(d_in, d_out, bias=False), lambda: torch.randn(batch, d_in), SGD)


def test_buffers_and_a_lazy_layer_count_as_measured():
    build = convnet
    model = build()
    model(torch.zeros(1, 3, 12, 12))  # materialize the lazy layer
    estimate = estimate_memory(model, torch.zeros(6, 3, 12, 12), device=CPU, fit=False)
    built = build()
    built(torch.zeros(1, 3, 12, 12))
    assert estimate.peak == measured_peak(lambda: built, lambda: torch.randn(6, 3, 12, 12), torch.optim.Adam)
    buffers = sum(nbytes(b) for b in model.buffers())
    assert estimate.buffers == buffers > 0


def test_checkpointing_and_autocast_equal_the_measured_cpu_runs():
    shape = (4, 32, 64)
    estimate = estimate_memory(FeedForwardStack(64, 3), torch.zeros(shape), device=CPU, fit=False, compare=OPTIMIZATIONS)
    checkpointed = estimate.alternatives["gradient checkpointing"]
    assert checkpointed.peak == measured_peak(lambda: FeedForwardStack(64, 3, checkpointing=True), lambda: torch.randn(shape), torch.optim.Adam)
    assert checkpointed.peak < estimate.peak
    bf16 = estimate.alternatives["bf16 autocast"]
    assert bf16.peak == measured_peak(
        lambda: FeedForwardStack(64, 3), lambda: torch.randn(shape), torch.optim.Adam, autocast=torch.bfloat16
    )
    assert bf16.peak < estimate.peak
    both = estimate.alternatives["checkpointing + bf16 autocast"]
    assert both.peak < min(bf16.peak, checkpointed.peak)
    table = estimate.format_comparison()
    assert "| gradient checkpointing |" in table and "| baseline |" in table


def test_autocasts_cached_weight_copies_live_until_the_region_exits_as_measured():
    # Under autocast each fp32 weight is cast to bf16 once and the copy cached until the
    # autocast region exits. The first layer's input needs no gradient, so nothing saves
    # its weight's copy for backward: only the cache keeps it alive, to the forward's end.
    d, batch = 512, 4
    build = lambda: nn.Sequential(nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False))  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(batch, d), optimizer=SGD, autocast=torch.bfloat16, device=CPU, fit=False)
    weights, copy = 2 * d * d * 4, d * d * 2
    x, x16 = batch * d * 4, batch * d * 2
    # at the forward's end: weights, the input, its bf16 cast, both cached copies, both outputs
    assert estimate.phases["forward"] == weights + x + x16 + copy + x16 + copy + x16
    # what the layers saved: the second layer's weight copy (its input needs a gradient), not the first's
    assert estimate.layers.by_module.get(("1", WEIGHT_COPIES)) == copy
    assert ("0", WEIGHT_COPIES) not in estimate.layers.by_module
    measured = measured_peak(build, lambda: torch.randn(batch, d), SGD, autocast=torch.bfloat16)
    assert estimate.peak == measured


def test_saved_activations_by_layer_equal_what_a_pack_hook_sees():
    model = FeedForwardStack(64, 2)
    x = torch.randn(4, 32, 64)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.untyped_storage().data_ptr():
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    estimate = estimate_memory(model, x, device=CPU, fit=False)
    assert estimate.activations == sum(saved.values())
    assert estimate.layers.by_module[("blocks.0.norm", "activations")] > 0
    assert estimate.layers.inputs == nbytes(x)  # the first LayerNorm saves the batch


def test_the_peak_breakdown_puts_activations_down_to_layers_at_a_backward_peak():
    estimate = estimate_memory(FeedForwardStack(64, 4), torch.zeros(16, 64, 64), device=CPU, fit=False)
    assert estimate.peak_phase in ("forward", "backward")
    assert estimate.peak_breakdown["activations"] == sum(estimate.peak_layers.values()) > 0
    assert estimate.peak_breakdown["weights"] == estimate.weights


def test_a_tied_weight_counts_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, idx):
            return self.head(self.embed(idx))

    estimate = estimate_memory(Tied(), torch.zeros(4, 8, dtype=torch.long), device=CPU, fit=False)
    assert estimate.weights == 100 * 16 * 4
    assert estimate.peak == measured_peak(Tied, lambda: torch.randint(0, 100, (4, 8)), torch.optim.Adam)


def test_the_users_model_and_process_are_left_as_they_were():
    model = mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    estimate_memory(model, torch.zeros(8, 64), device=CPU, checkpointing=lambda name, m: name == "0")
    assert [id(p) for p in model.parameters()] == ids
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert "forward" not in model[0].__dict__
    assert _get_current_dispatch_mode_stack() == []
    assert not can_chain() or top_saved_tensors_hooks() is None  # torch < 2.8 cannot tell


class RegistersWhenWalked(nn.Module):
    """A module that registers its weight again whenever it is walked, as peft's LoRA over
    ``nn.MultiheadAttention`` does in ``named_modules()`` (``nn.Parameter(weight.data)``): walked
    inside the estimate's fake mode, the user's model would get a fake weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def named_modules(self, *args, **kwargs):
        weight = self.inner.weight
        del self.inner.weight
        self.inner.weight = nn.Parameter(weight.data, requires_grad=weight.requires_grad)
        return super().named_modules(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # cuda: emulated where no GPU is here
def test_a_model_that_acts_when_walked_is_read_not_walked(device):
    from torch._subclasses.fake_tensor import FakeTensor

    model = RegistersWhenWalked()
    weight = model.inner.weight
    est = estimate_memory(model, torch.zeros(8, 16), device=device, fit=False)
    assert model.inner.weight is weight and not isinstance(model.inner.weight.data, FakeTensor)
    assert est.weights == (16 * 16 + 16) * 4 if device == "cpu" else est.weights > 0
    assert torch.isfinite(model(torch.ones(2, 16))).all()


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_five_gigabyte_model_is_estimated_in_little_host_memory():
    width, depth = 8192, 20  # 20 x 8192^2 float32 weights: 5.4 GB
    estimate_memory(lambda: nn.Linear(8, 8), torch.zeros(2, 8), device=CPU, fit=False)  # imports done
    gc.collect()
    before = _rss()
    estimate = estimate_memory(
        lambda: nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]), torch.zeros(4, width), device=CPU
    )
    grown = _rss() - before
    weights = depth * (width * width + width) * 4
    assert estimate.weights == weights > 5e9
    assert estimate.peak > 4 * weights  # weights, gradients and Adam's two moments
    assert grown < 300e6, f"resident memory grew by {grown / 1e6:.0f} MB"


def test_max_batch_size_holds_against_measured_cpu_runs():
    build = lambda: FeedForwardStack(32, 2)  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(4, 16, 32), device=CPU)
    fit = estimate.fit
    assert fit is not None and fit.batch_sizes == (4, 8) and fit.checked_at == 12 and fit.error < 0.001
    device_memory = fit.peak_at(50) + 12345  # a device that holds a batch of about 50
    predicted = estimate.max_batch_size(device_memory, margin=0)
    assert predicted >= 40
    assert measured_peak(build, lambda: torch.randn(predicted, 16, 32), torch.optim.Adam) <= device_memory
    larger = math.ceil(predicted * 1.1)
    assert measured_peak(build, lambda: torch.randn(larger, 16, 32), torch.optim.Adam) > device_memory
    assert estimate.max_batch_size(device_memory) == int(predicted * 0.9)
    assert estimate.fits(device_memory) and not estimate.fits(estimate.peak - 1)


def test_the_profilers_own_prediction_holds_against_measured_cpu_runs():
    build = lambda: FeedForwardStack(32, 2)  # noqa: E731
    model = build()
    opt = torch.optim.Adam(model.parameters())
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt, by_layer=True) as profiler:
        x = torch.randn(8, 16, 32)
        for _ in range(2):  # the loop measured_peak runs: the output is held through the step
            out = model(x)
            loss = out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
            profiler.record_stats()
        estimate = estimate_memory(build(), torch.zeros(8, 16, 32), device=CPU)
        device_memory = estimate.fit.peak_at(60)
        predicted = profiler.max_batch_size(batch_size=8, device_memory=device_memory, margin=0)
        with pytest.raises(ValueError, match="device_memory"):
            profiler.max_batch_size(batch_size=8)  # the CPU has no total to default to
    assert measured_peak(build, lambda: torch.randn(predicted, 16, 32), torch.optim.Adam) <= device_memory
    # the breakdown splits backward's peak: weight gradients and Adam's state stay, the rest grows;
    # at most one below the largest batch that fits (the loss's few bytes, in "other", count as
    # growing: the safe side), and at most 20% below the estimate's
    assert measured_peak(build, lambda: torch.randn(predicted + 2, 16, 32), torch.optim.Adam) > device_memory
    assert predicted >= 0.8 * estimate.max_batch_size(device_memory, margin=0)
    assert max_batch_from_records(list(profiler.records), 8, device_memory, margin=0.5) == int(predicted * 0.5)


def test_unsupported_operations_name_the_operation_and_point_to_the_real_profiler():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y[y > 0]

    class Branch(Masked):
        def forward(self, x):
            y = self.fc(x)
            return y if y.sum() > 0 else -y

    with pytest.raises(EstimateUnsupported, match="aten.nonzero") as caught:
        estimate_memory(Masked(), torch.zeros(2, 4), device=CPU)
    assert caught.value.operation == "aten.nonzero.default"
    assert "MemoryProfiler" in str(caught.value)
    with pytest.raises(EstimateUnsupported, match="_local_scalar_dense") as caught:
        estimate_memory(Branch(), torch.zeros(2, 4), device=CPU)
    assert ".item()" in str(caught.value)
    # the line that read the value, in the model's own code (the first frame outside torch)
    assert f"{__file__}:" in str(caught.value) and "return y if y.sum() > 0 else -y" in str(caught.value)


def test_an_operator_without_a_fake_kernel_is_refused_not_run():
    calls = []

    def scale(x):
        calls.append(1)
        return x * 2

    # Real annotations, not this file's strings: torch 2.4 infers the schema from objects only.
    scale.__annotations__ = {"x": torch.Tensor, "return": torch.Tensor}
    scale = torch.library.custom_op("pmp_estimate_test::scale", mutates_args=())(scale)

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return scale(self.fc(x))

    with pytest.raises(EstimateUnsupported, match="pmp_estimate_test::scale") as caught:
        estimate_memory(Custom(), torch.zeros(2, 4), device=CPU)
    assert "fake" in str(caught.value) and calls == []


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"autocast": "int8"}, ValueError, "autocast"),
        ({"optimizer": 3}, TypeError, "optimizer"),
        ({"loss_fn": "sum"}, TypeError, "loss_fn"),
        ({"device": "nonsense"}, ValueError, "device"),
        ({"outside": -1}, ValueError, "outside"),
        ({"compare": {"x": {"lr": 1}}}, ValueError, "compare"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        estimate_memory(mlp(), torch.zeros(2, 64), **{"device": CPU, **kwargs})


def test_inputs_as_a_function_need_a_batch_size_and_follow_it():
    with pytest.raises(ValueError, match="batch_size"):
        estimate_memory(mlp, lambda b: torch.zeros(b, 64), device=CPU)
    estimate = estimate_memory(mlp, lambda b: torch.zeros(b, 64), batch_size=24, device=CPU)
    assert estimate.batch_size == 24 and estimate.inputs == 24 * 64 * 4
    assert estimate.peak == measured_peak(mlp, lambda: torch.randn(24, 64), torch.optim.Adam)


def test_a_cuda_estimate_without_a_gpu_rounds_each_storage_to_512_byte_blocks():
    model = mlp()
    estimate = estimate_memory(model, torch.zeros(8, 64), device="cuda", fit=False)
    if not torch.cuda.is_available():
        assert estimate.emulated
    assert estimate.weights == sum(block_size(nbytes(p)) for p in model.parameters())
    assert estimate.peak % 512 == 0
    assert estimate.workspace == 2 * (32 << 20) and estimate.outside == 1 << 30
    assert estimate.peak_allocated == estimate.peak + estimate.workspace
    assert estimate.reserved >= estimate.peak_allocated
    assert estimate.required == estimate.needed + estimate.outside == estimate.reserved + estimate.outside
    assert "Needed on the device" in str(estimate)


class _FrozenProjection(nn.Module):
    """A frozen linear layer under a trained scale: its matmul runs in the forward alone."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


@pytest.mark.parametrize("optimizer, moments", [(torch.optim.AdamW, 2), (torch.optim.Adagrad, 1)])
def test_an_optimizers_step_counts_stay_in_host_memory_beside_cuda_parameters(optimizer, moments):
    """Adam's, AdamW's and Adagrad's per-parameter step counts are CPU tensors beside CUDA
    parameters (neither capturable nor fused): not the device's, where the step runs on fake CPU
    tensors standing in for CUDA ones either (Adagrad makes its counts when built)."""
    model = mlp()
    params = list(model.parameters())
    standing_in = estimate_memory(model, torch.zeros(8, 64), optimizer=optimizer, device="cuda", fit=False, emulate=True)
    assert standing_in.optimizer_state == moments * sum(block_size(nbytes(p)) for p in params)
    if torch.cuda.is_available():  # fake CUDA tensors: the optimizer puts its counts on the CPU itself
        on_cuda = estimate_memory(model, torch.zeros(8, 64), optimizer=optimizer, device="cuda", fit=False)
        assert on_cuda.optimizer_state == standing_in.optimizer_state
    # on the CPU, the counts are on the device: a float32 each
    on_cpu = estimate_memory(model, torch.zeros(8, 64), optimizer=optimizer, device="cpu", fit=False)
    assert on_cpu.optimizer_state == moments * sum(nbytes(p) for p in params) + 4 * len(params)


@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.Adam, capturable=True),
    functools.partial(torch.optim.AdamW, lr=torch.tensor(1e-3), capturable=True),
    functools.partial(torch.optim.NAdam, capturable=True),
], ids=["adam", "adamw-tensor-lr", "nadam"])  # fmt: skip
def test_a_capturable_optimizer_keeps_its_counts_on_the_device_where_cuda_is_emulated(optimizer):
    """``capturable=True`` (CUDA graphs) asserts that the parameters are on a device that can capture,
    which the CPU stand-ins are not: emulated, the step takes CUDA's capturable path, its counts a
    block each on the device beside the moments (where the others keep them in host memory)."""
    model = mlp()
    params = list(model.parameters())
    estimate = estimate_memory(model, torch.zeros(8, 64), optimizer=optimizer, device="cuda", fit=False, emulate=True)
    counts = 2 if optimizer.func is torch.optim.NAdam else 1  # NAdam's mu_product beside its step
    assert estimate.optimizer_state == 2 * sum(block_size(nbytes(p)) for p in params) + counts * 512 * len(params)
    weight = nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    with pytest.raises(AssertionError, match="capturable"):  # nothing left patched: the CPU still cannot capture
        torch.optim.Adam([weight], capturable=True).step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device's own runtime is here")
def test_emulate_false_without_the_devices_runtime_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="emulate=False.*emulate=None"):
        estimate_memory(mlp, torch.zeros(8, 64), device="cuda", fit=False, emulate=False)


def test_a_data_parallel_over_several_gpus_is_refused_naming_what_to_estimate():
    """nn.DataParallel copies the module to each GPU at every forward, each copy given its share of
    the batch: one fake step cannot stand for that. Over one device (or none) it calls the module."""
    model = mlp()
    parallel = nn.DataParallel(model)
    if len(parallel.device_ids) < 2:
        parallel.device_ids = [0, 1]  # as over two GPUs (what the refusal reads; nothing runs)
    with pytest.raises(EstimateUnsupported, match=r"model\.module.*parallel='ddp', world_size=2") as refused:
        estimate_memory(parallel, torch.zeros(8, 64), device="cuda", fit=False)
    assert refused.value.operation == "nn.DataParallel"
    if not torch.cuda.is_available():  # no GPU: DataParallel calls the module itself
        alone = nn.DataParallel(mlp())
        assert alone.device_ids == []
        assert estimate_memory(alone, torch.zeros(8, 64), device="cpu", fit=False).peak == (
            estimate_memory(mlp(), torch.zeros(8, 64), device="cpu", fit=False).peak
        )


def test_the_cublas_workspaces_are_the_threads_that_run_a_matmul():
    """cuBLAS takes a workspace in each thread at its first call: none for a step of convolutions
    alone (cuDNN), one where only the forward's thread runs a matmul, two where backward does too."""
    one = cublas_workspace_bytes()
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    alone = estimate_memory(convs, torch.zeros(2, 3, 16, 16), device="cuda", fit=False)
    assert alone.workspace == 0 and alone.peak_allocated == alone.peak
    headed = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))
    assert estimate_memory(headed, torch.zeros(2, 3, 16, 16), device="cuda", fit=False).workspace == 2 * one
    frozen = estimate_memory(_FrozenProjection(), torch.zeros(4, 16), device="cuda", fit=False)
    assert frozen.workspace == one and frozen.peak_allocated == frozen.peak + one
    # the replay's segments: the workspace a segment of its own, the step's tensors a small one
    assert alone.reserved == 2 << 20 and frozen.reserved == one + (2 << 20)
    assert estimate_memory(convs, torch.zeros(2, 3, 16, 16), device="cuda", fit=False, workspace=4 << 20).workspace == 4 << 20


def test_the_allocator_replay_never_holds_less_than_is_allocated():
    import random

    rng = random.Random(0)
    for _ in range(200):
        live, events, allocated, peak, key = {}, [], 0, 0, 0
        for _ in range(40):
            if live and rng.random() < 0.45:
                k = rng.choice(list(live))
                n = live.pop(k)
                events.append((k, -n))
                allocated -= block_size(n)
            else:
                n = rng.choice([100, 600, 1 << 19, 1 << 20, (1 << 20) + 1, 3 << 20, 11 << 20])
                live[key] = n
                events.append((key, n))
                key += 1
                allocated += block_size(n)
                peak = max(peak, allocated)
        assert simulate_reserved(events) >= peak
    # freed blocks are reused: a block freed and asked for again takes no new segment
    assert simulate_reserved([(1, 5 << 20), (1, -(5 << 20)), (2, 5 << 20)]) == segment_size(5 << 20)


def test_the_allocator_replay_keeps_the_pools_apart_and_gives_back_free_segments_under_a_limit():
    kib, mib = 1 << 10, 1 << 20
    # two small requests share a 2 MiB segment; one over 1 MiB takes a 20 MiB segment of the
    # large pool; a small request later fits in the small segment's rest; 3 MiB reuses the large one
    events = [(1, 600 * kib), (2, 600 * kib), (3, mib + 1), (3, -(mib + 1)), (4, 800 * kib), (5, 3 * mib)]
    assert simulate_reserved(events) == 2 * mib + 20 * mib
    # a free block of the large pool never serves a small request
    assert simulate_reserved([(1, mib + 1), (1, -(mib + 1)), (2, 1000)]) == 20 * mib + 2 * mib
    # under a limit the wholly free segment is given back first: 2 MiB then fits in 20 MiB
    assert simulate_reserved([(1, 3 * mib), (1, -(3 * mib)), (2, 1000)], limit=20 * mib) == 20 * mib
    # a segment in use is not given back: out of memory
    assert simulate_reserved([(1, 3 * mib), (2, 1000)], limit=21 * mib) is None
    assert simulate_reserved([(1, 3 * mib), (2, 1000)], limit=22 * mib) == 22 * mib


def test_the_largest_batch_on_cuda_is_what_the_allocators_segments_hold():
    # Activations of a few MiB each: the caching allocator reserves noticeably more than it
    # allocates, and a device's memory limits what it reserves.
    build = lambda: FeedForwardStack(256, 2)  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(2, 512, 256), device="cuda")
    assert estimate.reserved_at is not None and estimate.needed == estimate.reserved > estimate.peak_allocated
    limit = 256 << 20
    predicted = estimate.max_batch_size(limit, margin=0, outside=0)
    by_allocated = estimate.fit.largest_batch(limit - estimate.workspace)
    assert 2 < predicted < by_allocated
    assert estimate.reserved_at(predicted, limit) is not None
    assert estimate.reserved_at(math.ceil(predicted * 1.1), limit) is None
    # the replay at the predicted batch is the same step estimated there: the blocks fit under the limit
    there = estimate_memory(build(), torch.zeros(predicted, 512, 256), device="cuda", fit=False)
    assert there.peak_allocated <= there.reserved and there.peak_allocated <= limit
    assert estimate.max_batch_size(limit, outside=0) == int(predicted * 0.9)
    assert estimate.max_batch_size(limit + (100 << 20), margin=0, outside=100 << 20) == predicted
    assert not there.fits(there.reserved - 1, outside=0) and there.fits(there.reserved, outside=0)


def test_the_command_estimates_a_model_file(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom torch import nn\nbatch_size = 16\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 32)\n"
    )
    assert main(["estimate", str(path), "--device", "cpu", "--memory", "1MB", "--margin", "0", "--units", "KB"]) == 0
    out = capsys.readouterr().out
    expected = estimate_memory(
        lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), lambda b: torch.zeros(b, 32), batch_size=16, device=CPU
    )
    assert f"Largest batch on a device of 1,000 KB: {expected.max_batch_size(10**6, margin=0)} " in out
    assert "Batch size" in out and "16" in out


def test_the_command_explains_what_is_missing(tmp_path, capsys, monkeypatch):
    from pytorch_mem_profiler.analysis.cli import main

    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if it were not installed
    assert main(["estimate", "resnet50"]) == 2
    assert "needs torchvision (pip install torchvision)" in capsys.readouterr().err
    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    assert main(["estimate", str(bare)]) == 2
    assert "must define build_model() and example_inputs()" in capsys.readouterr().err


def test_repeated_blocks_are_found_for_checkpointing():
    from pytorch_mem_profiler.estimate.step import repeated_blocks

    assert repeated_blocks(FeedForwardStack(8, 3)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


@pytest.mark.parametrize("name", ["gpt2", "neumf"])
def test_the_benchmarks_estimates_run_on_the_quick_workloads(name):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import estimate_accuracy

    kwargs = estimate_accuracy.estimate_kwargs(name, estimate_accuracy.QUICK_SIZES[name])
    estimate = estimate_memory(**kwargs, batch_size=4, device="cuda")
    model = kwargs["model"]()
    weights = sum(block_size(nbytes(p)) for p in {id(p): p for p in model.parameters()}.values())
    assert estimate.weights == weights
    assert estimate.peak > estimate.weights + estimate.gradients + estimate.optimizer_state
    assert estimate.fit is not None and estimate.fit.error < 0.01


def test_the_accuracy_benchmark_runs_on_the_cpu_and_writes_its_tables(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import estimate_accuracy

    peaks, batches = estimate_accuracy.main(["--quick", "--device", "cpu", "--workloads", "neumf", "--out", str(tmp_path)])
    rows = [line for line in peaks.splitlines() if line.startswith("| neumf |")]
    assert len(rows) == 2
    for row in rows:  # the estimate against the profiler's exact CPU counter, within 1%
        assert abs(float(row.split("|")[5].strip().rstrip("%"))) < 1.0
    assert (tmp_path / "estimate_accuracy.md").read_text().count("| neumf |") == 3
    assert (tmp_path / "estimate_peaks.csv").exists() and (tmp_path / "estimate_batches.csv").exists()


def test_without_a_gpu_fake_cpu_tensors_take_cudas_precisions_and_attention():
    import torch.nn.functional as F

    originals = (F.layer_norm, F.softmax, F.scaled_dot_product_attention)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    estimate = estimate_memory(model, torch.zeros(32, 64), device="cuda", emulate=True, autocast=torch.bfloat16, fit=False)
    assert estimate.emulated
    # CUDA's autocast runs layer_norm on a float32 copy of the linear's bfloat16 output and keeps
    # it, with the float32 mean and 1/std of each row, for backward (each in 512-byte blocks)
    assert estimate.layers.by_module[("1", "activations")] == block_size(32 * 64 * 4) + 2 * block_size(32 * 4)
    cpu = estimate_memory(model, torch.zeros(32, 64), device="cpu", autocast=torch.bfloat16, fit=False)
    assert cpu.layers.by_module[("1", "activations")] < 32 * 64 * 4  # the CPU's autocast keeps bfloat16

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            q = self.proj(x)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)

    shape = (2, 4, 256, 64)
    on_cuda = estimate_memory(Attention(), torch.zeros(shape), device="cuda", emulate=True, optimizer=SGD, fit=False)
    on_cpu = estimate_memory(Attention(), torch.zeros(shape), device="cpu", optimizer=SGD, fit=False)
    # memory-efficient attention keeps no L x L matrix; the CPU's math path keeps several
    assert on_cpu.activations > 2 * 4 * 256 * 256 * 4 > on_cuda.activations
    assert (F.layer_norm, F.softmax, F.scaled_dot_product_attention) == originals


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def test_off_cuda_the_largest_batch_is_verified_where_the_line_through_two_batches_is_wrong():
    # At batch 8 and 16 Adam's step holds the peak and backward's grows by 9 KB a sample; at thousands
    # of samples another moment of backward holds it, growing faster: the line's answer does not fit.
    estimate = estimate_memory(wide_mlp, torch.zeros(8, 256), device=CPU)
    limit = 177_000_000
    search = estimate.batch_search(limit, margin=0)
    make = lambda b: lambda: torch.zeros(b, 256)  # noqa: E731
    assert measured_peak(wide_mlp, make(search.line), torch.optim.Adam) > limit  # the line alone is wrong
    assert measured_peak(wide_mlp, make(search.largest), torch.optim.Adam) <= limit
    assert measured_peak(wide_mlp, make(math.ceil(search.largest * 1.1)), torch.optim.Adam) > limit
    assert estimate.max_batch_size(limit) == int(search.largest * 0.9)
    assert search.peak_phase == "backward" and estimate.fit.peak_phases[8] == "optimizer"
    assert search.peak_moves.startswith("optimizer at batch 8, 16, 24") and "backward" in search.peak_moves
    assert any(not ok for _, ok in search.tried)
