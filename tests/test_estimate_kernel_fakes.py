"""CUDA operators without a fake kernel, given one by the estimate (``estimate/kernel_fakes.py``)."""

from __future__ import annotations

import pytest
import torch

from pytorch_mem_profiler.estimate.fake import fake_mode
from pytorch_mem_profiler.estimate.kernel_fakes import kernel_rule

aten = torch.ops.aten


def _allocations(run):
    """The storages made inside ``run()`` under the estimate's fake mode, in bytes, in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list[int] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and func not in (aten.t.default, aten.view.default, aten.permute.default):
                    made.append(t.untyped_storage().nbytes())
            return out

    with fake_mode():
        result = run(Watch)
    return result, made


@pytest.mark.skipif(not hasattr(aten, "cudnn_grid_sampler"), reason="no cuDNN grid sampler in this torch")
def test_cudnn_grid_sampler_returns_the_sampled_shape_and_its_backward_the_two_gradients():
    def run(watch):
        x = torch.empty(2, 3, 16, 16)
        grid = torch.empty(2, 7, 9, 2).transpose(1, 2)  # not contiguous: copied inside the kernel
        with watch():
            out = aten.cudnn_grid_sampler.default(x, grid)
            grads = aten.cudnn_grid_sampler_backward.default(x, grid.contiguous(), torch.empty_like(out))
        return out, grads

    (out, (grad_x, grad_grid)), made = _allocations(run)
    assert tuple(out.shape) == (2, 3, 9, 7) and out.is_contiguous()
    assert tuple(grad_x.shape) == (2, 3, 16, 16) and tuple(grad_grid.shape) == (2, 9, 7, 2)
    grid_bytes, out_bytes, x_bytes = 2 * 9 * 7 * 2 * 4, 2 * 3 * 9 * 7 * 4, 2 * 3 * 16 * 16 * 4
    # what each call returns, as storages: the output; (the test's contiguous grid and output gradient); the two gradients
    assert made == [out_bytes, grid_bytes, out_bytes, x_bytes, grid_bytes]
    assert kernel_rule(aten.add.Tensor) is None
