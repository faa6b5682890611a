"""torch.nn's fused fast paths in the estimate's step (``estimate.fast_paths``): a frozen encoder (eval
mode, no gradients) runs ``_transformer_encoder_layer_fwd`` in the fake CUDA step as on the device,
with the blocks ATen's CUDA code asks for, and the estimate's own function modes hide from no one
else."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.fast_paths import FusedFastPaths, fast_paths_kept

BATCH, LENGTH, WIDTH, HEADS, INNER, LAYERS = 8, 32, 64, 4, 128, 2
F32 = 4


class FrozenTeacher(nn.Module):
    """A frozen encoder (and, with ``attention``, a frozen ``nn.MultiheadAttention`` after it, asked
    for its weights as by default) under a trained head."""

    def __init__(self, masked: bool = False, attention: bool = False, norm_first: bool = False, gelu: bool = False) -> None:
        super().__init__()
        self.masked, self.attention = masked, attention
        self.embed = nn.Embedding(100, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, INNER, dropout=0.1, batch_first=True, norm_first=norm_first,
                                           activation="gelu" if gelu else "relu")  # fmt: skip
        self.teacher = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval().requires_grad_(False)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True).eval().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 4)

    def train(self, mode: bool = True) -> FrozenTeacher:
        super().train(mode)
        self.teacher.eval()  # frozen: in eval mode always, as a teacher is
        self.attn.eval()
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        with torch.no_grad():
            features = self.teacher(x.detach(), src_key_padding_mask=(ids == 0) if self.masked else None)
            if self.attention:
                features = self.attn(features, features, features)[0]
        return self.head((x + features)[:, 0])


def _ids() -> torch.Tensor:
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (BATCH, LENGTH))
    ids[:, -4:] = 0
    return ids


@pytest.fixture
def fused_calls(monkeypatch) -> Iterator[collections.Counter]:
    """How often the model calls each fused operator (the ``torch`` functions the modules call)."""
    calls: collections.Counter = collections.Counter()
    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
        original = getattr(torch, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    yield calls


def _estimate(model: nn.Module) -> object:
    return estimate_memory(model, _ids(), targets=torch.zeros(BATCH, dtype=torch.long), loss_fn=F.cross_entropy,
                           device="cuda", fit=False)  # fmt: skip


@pytest.mark.parametrize("masked, attention", [(False, False), (True, False), (False, True)])
def test_the_fake_cuda_step_takes_the_fused_path_where_the_real_step_does(fused_calls, masked, attention):
    """The real forward calls the fused operators once per layer (and attention); the estimate's two
    fake steps call them twice as often: its rules' function modes no longer send the modules down
    their slow path (they did: no fused call at all)."""
    model = FrozenTeacher(masked, attention)
    model.train()
    model(_ids())
    real = dict(fused_calls)
    assert real["_transformer_encoder_layer_fwd"] == LAYERS
    fused_calls.clear()
    _estimate(model)
    assert dict(fused_calls) == {name: 2 * n for name, n in real.items()}


def _forward_requests(estimate) -> collections.Counter:
    """(operator, bytes) of the blocks the first fake step's forward asks for."""
    events = estimate.step_events
    asked: collections.Counter = collections.Counter()
    for index, (key, nbytes) in enumerate(events.events):
        if nbytes > 0 and events.phase_at(index) == (1, "forward"):
            asked[(events.sources.get(key, "").split(";")[0], nbytes)] += 1
    return asked


def test_the_fused_layer_asks_for_the_blocks_atens_cuda_code_asks_for():
    """Per layer, as ``transformer_encoder_layer_forward`` and ``native_multi_head_attention_cuda`` run
    it with no mask: the packed projection (B x T x 3E, with its bias), the attention kernel's output,
    the output projection, two layer norms, the feed-forward's inner activation inside its matmul
    (``_addmm_activation``: no ReLU of its own) and its output; not the slow path's out-of-place ReLU
    nor its contiguous copy of the packed projection."""
    asked = _forward_requests(_estimate(FrozenTeacher()))
    tokens = BATCH * LENGTH
    assert asked[("aten.addmm.default", tokens * 3 * WIDTH * F32)] == LAYERS
    assert asked[("aten._addmm_activation.default", tokens * INNER * F32)] == LAYERS
    assert asked[("aten._scaled_dot_product_efficient_attention.default", tokens * WIDTH * F32)] == LAYERS
    assert asked[("aten.native_layer_norm.default", tokens * WIDTH * F32)] == 2 * LAYERS
    # the output projection and the feed-forward's output, and the head's input sum (x + features)
    assert asked[("aten.addmm.default", tokens * WIDTH * F32)] == 2 * LAYERS
    assert not asked[("aten.relu.default", tokens * INNER * F32)]
    assert not asked[("aten.clone.default", tokens * 3 * WIDTH * F32)]


def test_with_a_padding_mask_the_fused_attention_takes_atens_other_branch():
    """With a mask ATen's attention projects without the bias (``mm``), makes the three heads-first
    tensors in one block, the scores, their masked softmax (a new matrix) and the heads' copy back
    (``transform_0213``) before the output projection."""
    asked = _forward_requests(_estimate(FrozenTeacher(masked=True)))
    tokens = BATCH * LENGTH
    scores = BATCH * HEADS * LENGTH * LENGTH * F32
    assert asked[("aten.mm.default", tokens * 3 * WIDTH * F32)] == LAYERS
    assert asked[("aten.new_empty.default", 3 * tokens * WIDTH * F32)] == LAYERS
    assert asked[("aten.bmm.default", scores)] == LAYERS
    assert asked[("aten.new_empty.default", scores)] == LAYERS
    assert not asked[("aten._scaled_dot_product_efficient_attention.default", tokens * WIDTH * F32)]


@pytest.mark.parametrize("norm_first, gelu", [(False, False), (True, True)])
def test_on_real_tensors_the_rule_computes_what_the_fused_layer_computes(norm_first, gelu):
    """The rule's operators, run on real CPU tensors, give the fused operator's output: the same
    arguments in the same places (norms before or after, GELU or ReLU, residuals)."""
    torch.manual_seed(0)
    model = FrozenTeacher(norm_first=norm_first, gelu=gelu)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    with torch.no_grad():
        fused = model.teacher(x)
        with FusedFastPaths():
            ruled = model.teacher(x)
    torch.testing.assert_close(ruled, fused, rtol=1e-4, atol=1e-5)


class UsersMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class OwnMode(UsersMode):
    pass


def _asked_from(module: str) -> bool:
    """``torch.overrides.has_torch_function`` asked from code whose module is ``module``."""
    scope = {"__name__": module, "torch": torch, "x": torch.ones(2)}
    exec("answer = torch.overrides.has_torch_function((x,))", scope)  # noqa: S102 - the caller's module is the point
    return scope["answer"]


def test_the_estimates_modes_hide_from_the_modules_fast_path_checks_alone():
    """Under the estimate's own mode, the transformer modules' check sees none; any other caller sees
    it; under a user's mode the check sees that one (the device's step sends the module down its slow
    path too); and the original function is back afterwards."""
    original = torch.overrides.has_torch_function
    with OwnMode(), fast_paths_kept((OwnMode,)):
        assert _asked_from("torch.nn.modules.transformer") is False
        assert _asked_from("torch.nn.modules.activation") is False
        assert _asked_from("some.library") is True
    with UsersMode(), OwnMode(), fast_paths_kept((OwnMode,)):
        assert _asked_from("torch.nn.modules.transformer") is True
    assert torch.overrides.has_torch_function is original
