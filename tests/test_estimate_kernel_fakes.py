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


def _grouped_mm_runs_on_the_cpu() -> bool:
    if not hasattr(aten, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 16), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


GROUPED_MM = pytest.mark.skipif(not _grouped_mm_runs_on_the_cpu(), reason="this torch has no CPU grouped matmul")


def _grouped_operands(case: str, dtype: torch.dtype):
    """(mat_a, mat_b, offs) for each layout grouped matmul takes. The kernels want each operand's
    rows on 16 bytes; the second operand is column-major with an odd width (as a transposed
    ``nn.Linear`` weight is), so the output's rows are padded where ATen pads them."""
    g = torch.Generator().manual_seed(0)
    k, n = 16, 9

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if case == "2d3d":  # the tokens' rows split by expert
        return randn(9, k), randn(3, n, k).transpose(-2, -1), torch.tensor([3, 5, 9], dtype=torch.int32)
    if case == "3d3d":  # one matmul per group
        return randn(3, 4, k), randn(3, n, k).transpose(-2, -1), None
    if case == "2d2d":  # the contraction split (a weight gradient)
        return randn(4, 3 * k), randn(n, 3 * k).transpose(0, 1), torch.tensor([k, 2 * k, 3 * k], dtype=torch.int32)
    return randn(3, 4, k), randn(n, k).transpose(0, 1), torch.tensor([3, 5, 9], dtype=torch.int32)  # the columns split


@GROUPED_MM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["2d3d", "3d3d", "2d2d", "3d2d"])
def test_grouped_matmul_returns_what_the_cpu_kernel_returns_in_any_dtype(case, dtype):
    """The meta kernel takes bfloat16 and float16 only; the CPU kernel takes float32 too (transformers'
    mixture of experts in float32): the rule gives the real output's shape, dtype, strides and bytes."""
    a, b, offs = _grouped_operands(case, dtype)
    real = torch._grouped_mm(a, b, offs=offs)
    mode = fake_mode()
    with mode:
        fa, fb = torch.empty_like(a), torch.empty_like(b)
        foffs = None if offs is None else torch.empty_like(offs)
        out = kernel_rule(aten._grouped_mm.default)((fa, fb, foffs), {})
    assert (tuple(out.shape), out.stride(), out.dtype) == (tuple(real.shape), real.stride(), real.dtype)
    assert out.untyped_storage().nbytes() == real.untyped_storage().nbytes()


class _Experts(torch.nn.Module):
    """A mixture of experts routed top-1 by a learned gate, the tokens sorted by expert and multiplied by
    each expert's weights in one grouped matmul (as transformers 5 and torchtitan run their MoE layers)."""

    def __init__(self, width: int = 24, experts: int = 4, hidden: int = 40) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, experts)
        self.up = torch.nn.Parameter(torch.randn(experts, width, hidden) / width**0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, width) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        expert = self.gate(tokens).argmax(-1)
        order = expert.argsort()
        counts = torch.zeros(self.up.shape[0], dtype=torch.long, device=x.device).scatter_add_(0, expert, torch.ones_like(expert))
        offs = counts.cumsum(0).to(torch.int32)
        sorted_tokens = tokens[order]
        h = torch._grouped_mm(sorted_tokens, self.up, offs=offs).relu()
        out = torch._grouped_mm(h, self.down, offs=offs)
        return torch.empty_like(out).index_copy(0, order, out).reshape(x.shape)


@GROUPED_MM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixture_of_experts_in_grouped_matmuls_is_estimated_to_the_byte(dtype):
    from pytorch_mem_profiler import estimate_memory

    from .helpers import measured_peak

    def build():
        torch.manual_seed(0)
        return _Experts().to(dtype)

    inputs = lambda batch=4: torch.randn(batch, 16, 24, dtype=dtype)  # noqa: E731
    adam = torch.optim.Adam
    measured = measured_peak(build, inputs, adam)
    est = estimate_memory(build, lambda b: inputs(b), batch_size=4, optimizer=adam, device="cpu", fit=False)
    assert est.peak == measured


def test_a_fake_kernel_that_refuses_the_call_is_named_with_the_line():
    """A plain RuntimeError from a fake kernel (a check stricter than the real kernel's, or the step's
    own mistake) comes out as EstimateUnsupported naming the operator and the model's line."""
    from pytorch_mem_profiler import estimate_memory
    from pytorch_mem_profiler.estimate import EstimateUnsupported

    class Mismatched(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.t()  # (n, 8) @ (4, 8): the shapes do not multiply

    with pytest.raises(EstimateUnsupported) as caught:
        estimate_memory(Mismatched(), torch.randn(2, 8), device="cpu", fit=False)
    assert caught.value.operation is not None and "aten.mm" in caught.value.operation
    torch_message = str(caught.value.__cause__)
    assert "x @ self.w.t()" in str(caught.value) and torch_message and torch_message in str(caught.value)


def test_every_fused_optimizer_step_without_a_fake_kernel_has_one_that_allocates_nothing():
    """torch's fused optimizer steps (``aten._fused_<name>_``, in place, returning nothing): each overload
    this torch leaves without a fake kernel gets the rule, and the rule makes no storage, as the real
    kernel updates its arguments in place."""
    missing = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        packet = getattr(aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if not op._schema.returns and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                missing.append(op)
    assert all(kernel_rule(op) is not None for op in missing)
    if not hasattr(aten, "_fused_sgd_"):
        pytest.skip("this torch has no fused SGD")

    def run(Watch):
        params, grads, bufs = [torch.empty(64)], [torch.empty(64)], [torch.empty(64)]
        with Watch():
            result = aten._fused_sgd_.default(params, grads, bufs, weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                                              nesterov=False, maximize=False, is_first_step=True)  # fmt: skip
        return result

    result, made = _allocations(run)
    assert result is None and made == []
