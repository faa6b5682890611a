"""Small models and loops shared by the tests, with their byte counts computed by hand."""

from __future__ import annotations

import functools
import gc
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler.measure.saved_tensors import can_chain

#: Feature maps by layer watch saved tensors behind the user's hooks, which torch can tell from 2.8 on.
needs_saved_tensor_watch = pytest.mark.skipif(
    not can_chain(), reason="torch < 2.8 cannot tell which saved-tensor hooks are active: no per-layer feature maps"
)


def transformers_or_skip():  # type: ignore[no-untyped-def]
    """Hugging Face ``transformers``, or a skip naming why not: it does not import, or it refuses
    this torch (transformers 5 builds no models on torch < 2.6)."""
    try:
        import transformers
    except Exception as err:  # noqa: BLE001 - any failure to import means: not here
        pytest.skip(f"transformers is not importable: {type(err).__name__}: {err}")
    if not transformers.utils.is_torch_available():
        pytest.skip(f"transformers {transformers.__version__} refuses torch {torch.__version__}: it builds no models")
    return transformers


@functools.lru_cache(maxsize=None)
def cpu_lacks_bf16_lstm() -> str | None:
    """Why this CPU cannot run a bf16 ``nn.LSTM`` (oneDNN's bf16 RNN needs AVX-512 bf16 or AMX, and
    refuses to make its primitive elsewhere), or ``None`` where it can."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError as err:
        return f"this CPU's oneDNN cannot run a bf16 LSTM: {str(err).splitlines()[0][:120]}"
    return None


def nbytes(t: torch.Tensor) -> int:
    """The independent byte count the tests compare against."""
    return t.numel() * t.element_size()


def unique_storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the tensors' unique storages, computed apart from any counter."""
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(unique.values())


def local_storage_bytes(tensors) -> int:
    """:func:`unique_storage_bytes` of ``tensors``, a DTensor counted by its local shard."""
    return unique_storage_bytes(*(t.to_local() if hasattr(t, "to_local") else t for t in tensors))


class SavedBytes:
    """The user's own pack hook: unique storages autograd saved inside :meth:`hooks`, the
    parameters of ``model`` and the tensors ``skip`` left out (the independent count of what a
    forward keeps for backward).

    Example::

        saved = SavedBytes(model, (x,))
        with saved.hooks():
            out = model(x)
        saved.total
    """

    def __init__(self, model: nn.Module, skip: tuple[torch.Tensor, ...] = ()) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.skip |= {t.untyped_storage().data_ptr() for t in skip}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def grown(counter, base: int) -> int:
    """What a counter's allocated figure grew by since ``base``."""
    return counter.read().allocated - base


def mlp(d_in: int = 32, hidden: int = 64, d_out: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, x: torch.Tensor) -> None:
    out = model(x)
    out.pow(2).mean().backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()


class BackwardScratch(torch.autograd.Function):
    """Identity whose backward allocates a known temporary: a transient of backward."""

    SCRATCH_ELEMS = 1_000_000  # 4 MB of float32

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 1

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        scratch = torch.ones(BackwardScratch.SCRATCH_ELEMS, device=grad.device)
        return grad * scratch[0]


class ScratchNet(nn.Module):
    """Linear -> backward scratch -> ReLU -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(BackwardScratch.apply(self.a(x)).relu())


def measured_peak(build, make_input, optimizer, *, autocast=None, loss_fn=None, make_targets=None, steps=2) -> int:
    """The profiler's CPU peak over the same two steps ``estimate_memory`` runs: the largest
    ``iteration_peak_allocated`` (the CPU counter counts live storages exactly). The batch (and
    the targets) are made while profiled, as the estimate counts them; the forward runs under
    ``autocast``, the loss (``loss_fn(output, *targets)``, default the output's float sum) outside it.
    An input that is a dict is given as keywords."""
    from pytorch_mem_profiler import MemoryProfiler

    model = build()
    opt = optimizer(model.parameters())
    gc.collect()
    peaks = []
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt) as profiler:
        x = make_input()
        targets = make_targets() if make_targets is not None else ()
        targets = targets if isinstance(targets, tuple) else (targets,)
        for _ in range(steps):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(**x) if isinstance(x, dict) else model(x)
            if loss_fn is not None:
                loss = loss_fn(out, *targets)
            else:
                loss = out.float().sum() if out.dtype != torch.float32 else out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss
            peaks.append(profiler.record_stats().iteration_peak_allocated)
    return max(peaks)


def cuda_measured_peak(build, inputs, loss_fn, optimizer=None) -> int:
    """Peak ``torch.cuda.max_memory_allocated()`` over two steps (AdamW unless ``optimizer`` says) above
    what was allocated before the model (after a warm-up step, whose libraries' workspaces stay), as the
    zoo's conformance run measures. ``inputs``: a tensor, a dict of keywords, or a list of positional
    parts handed over as one argument; the output is held through backward, as in the estimate's step."""

    def steps(n: int) -> None:
        model = build().cuda()
        opt = (optimizer or functools.partial(torch.optim.AdamW, lr=1e-4))(model.parameters())
        if isinstance(inputs, dict):
            x = {k: v.cuda() for k, v in inputs.items()}
        elif isinstance(inputs, (list, tuple)):
            x = [v.cuda() for v in inputs]
        else:
            x = inputs.cuda()
        for _ in range(n):
            out = model(**x) if isinstance(x, dict) else model(x)
            loss = loss_fn(out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss

    steps(1)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    steps(2)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


class KeywordInputs(torch.nn.Module):
    """A model given its inputs as one dict (as ``measured_peak`` calls it) or as keywords (as the
    estimate calls a model whose example inputs are a dict): a transformers model's batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict | None = None, **keywords: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.model(**(batch if batch is not None else keywords))


class ByteBuffers(TorchDispatchMode):
    """While on: the sizes, in order, of the uint8 buffers made by ``new_empty`` (the estimate's
    cuDNN reserve spaces, workspaces and dropout state), in ``sizes``."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.new_empty.default and (kwargs or {}).get("dtype") is torch.uint8:
            self.sizes.append(out.numel())
        return out
