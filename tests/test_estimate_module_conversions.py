"""A model whose forward converts its own layers (``module.to(dtype)``) is estimated as it runs.

``nn.Module._apply`` sets a real parameter's ``.data`` but swaps a fake one in place
(``torch.utils.swap_tensors``), which torch refuses while weak references point to it: the estimate
raised ``_apply(): Couldn't swap Linear.weight`` on such a model (``estimate/module_conversions.py``). Each case is estimated on the CPU and compared with the measured
peak of the same two steps, to the byte.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .helpers import KeywordInputs, measured_peak, transformers_or_skip

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class _Router(nn.Module):
    """A body and a small router that the forward converts to ``dtype`` at every call, as Switch
    Transformers' router does (``self.classifier = self.classifier.to(self.dtype)``); ``after``:
    the router and the body converted after they ran, in the same forward."""

    def __init__(self, dtype: torch.dtype, after: bool = False) -> None:
        super().__init__()
        self.dtype, self.after = dtype, after
        self.body = nn.Linear(64, 64)
        self.classifier = nn.Linear(64, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.after:
            y = self.classifier(torch.relu(self.body(x)))
            self.classifier = self.classifier.to(self.dtype)
            self.body = self.body.float()
            return y.float()
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(torch.relu(self.body(x)).to(self.dtype)).float()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
def test_layers_converted_after_they_ran_are_estimated_to_the_byte(autocast):
    """A swap would leave the backward already recorded unable to reach the parameters (and under
    autocast its cast cache refuses it); the conversion takes the real tensors' path instead."""
    build = functools.partial(_Router, torch.float32, after=True)
    x = lambda batch=8: torch.randn(batch, 64)  # noqa: E731
    measured = measured_peak(build, x, SGD, autocast=autocast)
    est = estimate_memory(build, lambda b: x(b), batch_size=8, optimizer=SGD, device="cpu", fit=False,
                          **({"autocast": autocast} if autocast is not None else {}))  # fmt: skip
    assert est.peak == measured


def test_a_conversion_swaps_where_the_user_asked_torch_to_swap():
    """Under ``set_swap_module_params_on_conversion(True)`` real parameters are swapped too: so are
    the fake ones, once the fake mode's memo lets them go."""
    build = functools.partial(_Router, torch.float64)
    x = lambda batch=8: torch.randn(batch, 64)  # noqa: E731
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        measured = measured_peak(build, x, SGD)
        est = estimate_memory(build, lambda b: x(b), batch_size=8, optimizer=SGD, device="cpu", fit=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert est.peak == measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["same_dtype", "to_float64"])
@pytest.mark.parametrize("given", ["function", "module"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
def test_a_forward_that_converts_its_own_layer_is_estimated_to_the_byte(dtype, given, autocast):
    if autocast is not None and dtype == torch.float64:
        pytest.skip("autocast leaves float64 as it is: the same step as without it")
    build = functools.partial(_Router, dtype)
    x = lambda batch=8: torch.randn(batch, 64)  # noqa: E731
    measured = measured_peak(build, x, SGD, autocast=autocast)
    model = build if given == "function" else build()
    before = torch.utils.swap_tensors
    est = estimate_memory(model, lambda b: x(b), batch_size=8, optimizer=SGD, device="cpu", fit=False,
                          **({"autocast": autocast} if autocast is not None else {}))  # fmt: skip
    assert est.peak == measured
    assert torch.utils.swap_tensors is before  # the fake step's swap is put back
    if given == "module":
        assert model.classifier.weight.dtype == torch.float32  # the user's model is not converted


def test_switch_transformers_gets_past_its_routers_conversion_to_its_data_dependent_routing():
    """The case as met: a small Switch Transformers model, its router converting its classifier in
    every forward. It raised torch's ``_apply(): Couldn't swap Linear.weight``; it now runs to the
    experts' routing, a data-dependent shape (``nonzero``), refused by name as the zoo's MoE is."""
    from pytorch_mem_profiler.estimate.step import EstimateUnsupported

    transformers = transformers_or_skip()
    vocab, seq = 64, 16

    def build():
        torch.manual_seed(0)
        config = transformers.SwitchTransformersConfig(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, decoder_start_token_id=0,
        )  # fmt: skip
        return KeywordInputs(transformers.SwitchTransformersForConditionalGeneration(config))

    ids = lambda batch: {"input_ids": torch.randint(1, vocab, (batch, seq)), "labels": torch.randint(1, vocab, (batch, seq))}  # noqa: E731
    with pytest.raises(EstimateUnsupported) as refused:
        estimate_memory(build, ids, batch_size=2, optimizer=SGD, loss_fn=lambda out: out.loss, device="cpu", fit=False)
    assert refused.value.operation == "aten.nonzero.default"
