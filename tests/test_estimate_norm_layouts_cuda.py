"""Normalization layers' outputs and input gradients on CUDA, as the real kernels lay them out: the
fake kernels with the estimate's CUDA rules (``estimate.cpu_kernels.CpuKernels(device_type="cuda")``)
against the real ones, for inputs in channels-last and transposed layouts, float32 and bfloat16,
training and evaluation."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pytorch_mem_profiler.estimate.cpu_kernels import CpuKernels

pytestmark = pytest.mark.cuda


class _Layouts(TorchDispatchMode):
    """Each normalization operator's tensor outputs' strides, after ``kernels`` (if given)."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.seen: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if "norm" in str(func):
            if self.kernels is not None:
                out = self.kernels(func, args, kwargs, out)
            self.seen.append((str(func), [tuple(t.stride()) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() > 1]))
        return out


def _step(shape, order, train, dtype, kernels=None):
    channels = shape[order[1]]
    norm = (nn.BatchNorm1d if len(shape) == 3 else nn.BatchNorm2d)(channels, device="cuda", dtype=dtype).train(train)
    x = torch.randn(*shape, device="cuda", dtype=dtype).permute(*order).requires_grad_()
    log = _Layouts(kernels)
    with log:
        norm(x).sum().backward()
    return log.seen


LAYOUTS = [((6, 8, 32), (0, 2, 1)), ((6, 8, 5, 32), (0, 3, 1, 2)), ((6, 8, 32, 5), (0, 2, 1, 3))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape, order", LAYOUTS, ids=["transposed-sequence", "channels-last", "transposed-image"])
def test_batch_norm_on_fake_cuda_tensors_lays_out_what_the_device_does(shape, order, train, dtype):
    real = _step(shape, order, train, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _step(shape, order, train, dtype, CpuKernels(device_type="cuda"))
    assert [op for op, _ in fake] == [op for op, _ in real]
    assert fake == real
