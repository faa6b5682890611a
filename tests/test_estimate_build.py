"""A model given as a function: its constructor computes on small real tensors, its weights never take memory."""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.build import SMALL_TENSOR_BYTES, build_model

from .helpers import measured_peak, nbytes, transformers_or_skip


def _optional(name: str):
    """The module, or a skip naming why it cannot import (torchvision on a CPU wheel of torch, say)."""
    try:
        return __import__(name)
    except Exception as err:  # noqa: BLE001 - any import failure means: not here
        pytest.skip(f"{name} cannot be imported here: {type(err).__name__}: {err}")


class DropPathNet(nn.Module):
    """timm's pattern: stochastic-depth rates read from a small tensor in ``__init__``, then a branch on them."""

    def __init__(self, depth: int = 4, width: int = 64, rate: float = 0.2) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, rate, depth)]
        self.blocks = nn.Sequential(*[nn.Linear(width, width) if r < rate else nn.Identity() for r in self.rates])
        mask = torch.zeros(8, 8)
        mask[torch.arange(8) > 3] = 1.0
        self.register_buffer("mask", mask)
        self.ones = int(mask.sum().item())  # a Python value from a buffer's values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.mask.sum()


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_constructor_reading_small_tensors_builds_and_equals_the_model_handed_over_built():
    built = DropPathNet()
    assert built.ones == 32 and len(built.blocks) == 4
    by_function = estimate_memory(DropPathNet, torch.zeros(16, 64), device="cpu", fit=False)
    handed = estimate_memory(built, torch.zeros(16, 64), device="cpu", fit=False)
    linear = 3 * (64 * 64 + 64) * 4  # the last rate equals the limit: an Identity
    assert by_function.weights == handed.weights == linear
    assert by_function.buffers == nbytes(built.mask)
    assert by_function.peak == handed.peak


def test_large_tensors_go_to_meta_small_ones_stay_real_and_the_random_state_is_kept():
    state = torch.random.get_rng_state()
    model = build_model(lambda: nn.Sequential(nn.Linear(4096, 4096), nn.LayerNorm(4096)))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model[0].weight.device.type == "meta"  # 64 MiB
    assert model[0].bias.device.type == model[1].weight.device.type == "cpu"  # 16 KiB each
    assert nbytes(model[0].bias) <= SMALL_TENSOR_BYTES < nbytes(model[0].weight)
    assert model[1].weight.sum().item() == 4096  # initialised for real: ones


def test_a_small_tensors_result_above_the_size_goes_to_meta_and_moves_keep_tensors_where_they_are():
    def build() -> nn.Module:
        small = torch.ones(1024)
        module = nn.Module()
        module.register_buffer("outer", small[:, None] * small[None, :])  # 4 MiB computed from 4 KiB
        module.register_buffer("moved", torch.arange(10).to("cuda", torch.float64))  # no GPU needed
        return module

    module = build_model(build)
    assert module.outer.device.type == "meta" and module.outer.shape == (1024, 1024)
    assert module.moved.device.type == "cpu" and module.moved.dtype == torch.float64 and module.moved[-1].item() == 9


def test_a_model_of_billions_of_parameters_by_function_takes_little_host_memory():
    width, depth = 16384, 16  # 16 x 16384^2 float32 weights: 17 GB
    estimate_memory(lambda: nn.Linear(8, 8), torch.zeros(2, 8), device="cpu", fit=False)  # imports done
    gc.collect()
    before = _rss()
    estimate = estimate_memory(
        lambda: nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]),
        torch.zeros(2, width),
        device="cuda",
        fit=False,
        optimizer=torch.optim.SGD,
    )
    grown = _rss() - before
    assert estimate.weights == depth * (width * width * 4 + 65536)  # weights and 64 KiB biases in 512-byte blocks
    assert grown < 300e6, f"resident memory grew by {grown / 1e6:.0f} MB"


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("vit_small_patch16_224", {"drop_path_rate": 0.1}),
        ("swin_tiny_patch4_window7_224", {"drop_path_rate": 0.2}),
    ],
)
def test_timm_models_with_stochastic_depth_build_by_function_as_they_are_handed_over_built(name, kwargs):
    timm = _optional("timm")
    handed = timm.create_model(name, pretrained=False, **kwargs)
    by_function = estimate_memory(lambda: timm.create_model(name, pretrained=False, **kwargs), torch.zeros(2, 3, 224, 224), device="cpu", fit=False)
    from_built = estimate_memory(handed, torch.zeros(2, 3, 224, 224), device="cpu", fit=False)
    assert by_function.weights == sum(nbytes(p) for p in handed.parameters())
    assert by_function.peak == from_built.peak


def test_transformers_and_torchvision_models_build_by_function_with_their_weights_on_meta():
    transformers = transformers_or_skip()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
    )
    model = build_model(lambda: transformers.LlamaForCausalLM(config))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 6_738_415_616  # Llama-2 7B
    real = sum(nbytes(p) for p in params if p.device.type != "meta")
    assert real < 2e6  # the norms' weights, 16 KiB each
    tiny = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16, num_heads=4, vocab_size=256,
        decoder_start_token_id=0, pad_token_id=0,
    )
    t5 = transformers.T5ForConditionalGeneration(tiny)
    est = estimate_memory(
        lambda: transformers.T5ForConditionalGeneration(tiny),
        {"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)},
        device="cpu",
        fit=False,
        loss_fn=lambda out: out.loss,
    )
    assert est.weights == sum(nbytes(p) for p in t5.parameters())
    torchvision = _optional("torchvision")
    resnet = build_model(torchvision.models.resnet18)
    assert {p.device.type for p in resnet.parameters()} == {"meta", "cpu"}


class ListedAnchors(nn.Module):
    """Tensors kept in a list, not registered (torchvision's ``AnchorGenerator.cell_anchors``), and
    moved to the input's device in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.anchors = [torch.randn(15, 4), torch.randn(15, 4)]
        self.scales = {"small": (torch.ones(4),)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchors = torch.cat([a.to(x.device) for a in self.anchors]) * self.scales["small"][0].to(x.device)
        return self.proj(x) @ anchors.t()


def test_a_model_by_function_keeping_tensors_in_lists_and_dicts_estimates_as_measured():
    from .helpers import measured_peak

    estimate = estimate_memory(ListedAnchors, torch.randn(8, 4), device="cpu", fit=False)
    measured = measured_peak(ListedAnchors, lambda: torch.randn(8, 4), torch.optim.AdamW)
    assert estimate.weights == (4 * 4 + 4) * 4
    assert estimate.peak == measured, (estimate.peak, measured)
    # and the emulated CUDA step runs too: the plain tensors follow the model to its device
    assert estimate_memory(ListedAnchors, torch.randn(8, 4), device="cuda", fit=False).peak > 0


class _MisconfiguredNet(nn.Module):
    """A constructor that reads small tensors' values, then refuses its own configuration (as a
    transformers BiT whose group norm's groups do not divide its channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.1, 4)]
        self.norm = nn.GroupNorm(32, 16)  # ValueError: num_channels must be divisible by num_groups


def test_a_constructor_that_fails_for_real_raises_its_own_error_not_a_refusal():
    """Built with its small tensors real the constructor raises its own ValueError (a mistake in it);
    built inside the fake mode it stops earlier, at ``.item()``. The estimate raises the constructor's
    ValueError, as a real build does: not an ``EstimateUnsupported``, which callers take as an operation
    the estimate cannot run."""
    with pytest.raises(ValueError) as real:
        _MisconfiguredNet()
    with pytest.raises(ValueError) as raised:
        estimate_memory(_MisconfiguredNet, lambda b: torch.randn(b, 16), batch_size=2, device="cpu", fit=False)
    assert str(raised.value) == str(real.value)


def test_a_constructor_that_fails_on_its_meta_tensors_is_refused_naming_the_operation():
    """Where the build outside the fake mode failed on a large tensor it put on ``meta`` (a value read
    from it) and the fake build stops at that read too, the refusal names the operation, after the
    constructor's own error."""
    from pytorch_mem_profiler.estimate import EstimateUnsupported

    class ReadsALargeWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(2048, 2048)  # large: on meta outside the fake mode
            self.scale = float(self.body.weight.abs().max())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * self.scale

    with pytest.raises(EstimateUnsupported) as refused:
        estimate_memory(ReadsALargeWeight, lambda b: torch.randn(b, 2048), batch_size=2, device="cpu", fit=False)
    assert refused.value.operation == "aten._local_scalar_dense.default"
    assert str(refused.value).startswith("model() raised")

class _ChannelsLastBlock(torch.nn.Module):
    """A ResNet downsampling pair without batch norm: a 3x3 and a 1x1 stride-2 convolution of one input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)
        self.conv = torch.nn.Conv2d(64, 128, 3, 2, 1, bias=False)
        self.down = torch.nn.Conv2d(64, 128, 1, 2, bias=False)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.down(x) + torch.relu(self.conv(x))
        return self.head(x.mean((2, 3)))


def _channels_last_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return _ChannelsLastBlock().to(memory_format=torch.channels_last)


def test_a_model_built_by_function_keeps_the_memory_format_its_constructor_moves_it_to():
    """``model.to(memory_format=torch.channels_last)`` inside the function lays the weights out channels
    last, as for real: built with them contiguous, each weight's gradient (channels-last, from the
    convolution) took a copy into the parameter's layout, and under bf16 autocast the estimate was
    16,384 bytes over the measured step (torchvision's channels-last SqueezeNet, ResNet-34 and
    DeepLabV3 up to 1 MB over)."""
    built = build_model(_channels_last_block)
    real = _channels_last_block()
    for (name, made), (_, expected) in zip(built.named_parameters(), real.named_parameters()):
        assert made.stride() == expected.stride(), name
    assert built.conv.weight.is_contiguous(memory_format=torch.channels_last)
    make_input = lambda: torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)  # noqa: E731
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    estimate = estimate_memory(_channels_last_block, make_input(), optimizer=sgd, autocast=torch.bfloat16, device="cpu", fit=False)
    assert estimate.peak == measured_peak(_channels_last_block, make_input, sgd, autocast=torch.bfloat16)


class SizedByBuffer(nn.Module):
    """A layer that keeps a shape in a small integer buffer and reads it in Python (peft's FroD:
    ``self.frod_s_size[adapter].tolist()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("size", torch.tensor([8, 8]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.size.tolist()
        return self.fc(x).reshape(x.shape[0], rows, cols).softmax(-1).flatten(1)


def _cumulative_batch_norm() -> nn.Module:
    # momentum=None: a cumulative average, its factor read from num_batches_tracked in every forward
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=None), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 2))


@pytest.mark.parametrize("build, shape", [(SizedByBuffer, (16, 64)), (_cumulative_batch_norm, (4, 3, 16, 16))], ids=["size-table", "bn-momentum-none"])
def test_a_models_small_integer_buffers_keep_their_values(build, shape):
    x = torch.zeros(shape)
    measured = measured_peak(build, lambda: x.clone(), torch.optim.Adam)
    model = build()
    before = {name: b.clone() for name, b in model.named_buffers()}
    handed = estimate_memory(model, x, optimizer=torch.optim.Adam, device="cpu", fit=False)
    by_function = estimate_memory(build, x, optimizer=torch.optim.Adam, device="cpu", fit=False)
    assert handed.peak == by_function.peak == measured
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())  # the user's buffers as they were
    if not torch.cuda.is_available():  # emulated: the values kept on the CPU stand-ins too
        assert estimate_memory(build, x, optimizer=torch.optim.Adam, device="cuda", fit=False).peak > 0
