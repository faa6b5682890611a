"""A pair of saved-tensor hooks the model pushes inside its forward, on a CUDA GPU: the layers under it
are attributed as that pair keeps their tensors on the device (float16 copies here), and the peak's
make-up counts them as feature maps."""

from __future__ import annotations

import io

import pytest
import torch

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure import saved_tensors

from .helpers import needs_saved_tensor_watch
from .test_user_saved_tensor_hooks import HalfPrecisionActivations, _kept_by_module, model_with_own_hooks

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


@needs_saved_tensor_watch
def test_a_pair_pushed_inside_the_forward_is_attributed_on_the_gpu():
    x = torch.randn(64, 32, device=DEV)
    counted = HalfPrecisionActivations()
    truth = _kept_by_module(counted, model_with_own_hooks(counted).to(DEV), x)
    user = HalfPrecisionActivations()
    model = model_with_own_hooks(user).to(DEV)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True, overhead=None) as profiler:
        for _ in range(2):
            model(x).sum().backward()
            record = profiler.record_stats()
    assert saved_tensors.top_saved_tensors_hooks() is None
    by_module = {m: n for (m, _), n in record.layers.by_module.items()}
    assert {name: by_module.get(name) for name in truth} == truth
    # the first Linear keeps the input (allocated before forward), Tanh its output: float32, outside the pair
    assert by_module["(input)"] == 64 * 32 * 4 and by_module["1"] == 64 * 64 * 4
    assert record.layers.unattributed == 64 * 10 * 4  # the output alone
    # what forward left allocated on the device (the allocator's figure): the layers' (the input apart) and the output
    assert record.feature_maps == record.layers.total + record.layers.unattributed
