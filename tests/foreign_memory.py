"""The foreign-memory battery: memory in the process that is not the profiled model's, and the advice
that must not be read from it. Shared by the CPU tests (``test_foreign_memory.py``) and the GPU ones
(``test_foreign_memory_cuda.py``).

Each case trains the same model, with the same seeds, beside one kind of foreign memory: a frozen
reference model run without gradients (DPO, a teacher), an EMA copy updated in place, a dataset
cached on the device, a second model trained with its own optimizer, a leak (a list that keeps a
tensor from every iteration), a frozen model on the device that is never run, and a pre-allocated
buffer reused in place (a KV cache). The foreign memory is made after the profiler starts (the
CPU counter counts what is made while it runs). What it holds is computed here, independently:
the bytes of its unique storages.

Two model setups: ``optimizer-heavy`` (Adam with ``foreach=True`` over four equal layers and a
small batch: the peak in the optimizer step, with 8-bit and foreach advice) and
``activation-heavy`` (a deep MLP of repeated blocks and a large batch: the peak in backward or
forward, with checkpointing advice).
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.accounting import optimizer_state_tensors
from pytorch_mem_profiler.outputs.advice import advise
from pytorch_mem_profiler.stats import IterationRecord

#: the iteration whose record is checked (the foreign memory made in earlier ones exists before it)
CHECKED = 3


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the unique storages of ``tensors`` (each storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr() or id(s)] = s.nbytes()
    return sum(seen.values())


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Deep(nn.Module):
    """Repeated blocks (``blocks.0`` ... ``blocks.7``): the checkpointing advice names them."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class Setup:
    name: str
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: int
    width: int


def setups(scale: int = 1) -> dict[str, Setup]:
    """The two setups, ``scale`` times wider (and the activation-heavy one's batch too): on a GPU
    the libraries' workspaces (cuBLAS's 32 MiB and more) are in the peak, and advice worth less
    than 5% of it is not given, so the models there must be large enough to get advice at all."""
    return {
        "optimizer-heavy": Setup(
            "optimizer-heavy",
            lambda: nn.Sequential(*(nn.Linear(256 * scale, 256 * scale, bias=False) for _ in range(4))),
            lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True),
            batch=4,
            width=256 * scale,
        ),
        "activation-heavy": Setup(
            "activation-heavy",
            lambda: Deep(128 * scale, 8),
            lambda m: torch.optim.SGD(m.parameters(), lr=1e-3),
            batch=512 * scale,
            width=128 * scale,
        ),
    }


SETUPS = setups()


@dataclass
class Foreign:
    """One kind of foreign memory: made by ``start``, touched by ``each`` every iteration (after the
    profiled model's step), and ``before()``: the bytes of it alive before the checked iteration and
    still alive at its peak, computed from its tensors."""

    name: str
    device: torch.device
    size: int  # elements of its main tensor
    tensors: list[Any] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    def start(self, model: nn.Module, width: int) -> None:
        kind, dev, n = self.name, self.device, self.size
        if kind == "frozen reference model":
            ref = nn.Linear(width, n // width, bias=False).to(dev).requires_grad_(False)
            self.state["ref"] = ref
        elif kind == "frozen model never run":
            self.state["ref"] = nn.Linear(width, n // width, bias=False).to(dev).requires_grad_(False)
        elif kind == "EMA copy":
            ema = copy.deepcopy(model)
            for p in ema.parameters():
                p.requires_grad_(False)
            # make it as large as the others: the EMA of a larger model's worth of memory
            self.state["ema"] = ema
            self.state["pad"] = torch.zeros(n, device=dev)
        elif kind == "dataset cached on the device":
            self.state["data"] = torch.randn(n // width, width, device=dev)
        elif kind == "second model and optimizer":
            other = nn.Sequential(nn.Linear(width, n // width // 4), nn.Linear(n // width // 4, width)).to(dev)
            self.state["model"] = other
            self.state["opt"] = torch.optim.Adam(other.parameters(), lr=1e-3)
        elif kind == "leak":
            self.state["kept"] = []
        elif kind == "buffer reused in place":
            self.state["cache"] = torch.zeros(n, device=dev)
        else:
            raise AssertionError(kind)

    def batch(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The batch the profiled model is given (from the cached dataset, a copy of its rows)."""
        data = self.state.get("data")
        if data is None:
            return x
        rows = torch.arange(x.shape[0], device=data.device) + step
        return data.index_select(0, rows % data.shape[0])

    def target_of(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """What the loss compares the output with: the reference model's, where there is one."""
        ref = self.state.get("ref") if self.name == "frozen reference model" else None
        if ref is None:
            return torch.zeros_like(out)
        with torch.no_grad():
            r = ref(x)
        return r[:, : out.shape[1]].detach()

    def each(self, model: nn.Module, x: torch.Tensor) -> None:
        """After the profiled model's step: what the foreign memory's owner does each iteration."""
        kind = self.name
        if kind == "EMA copy":
            with torch.no_grad():
                for e, p in zip(self.state["ema"].parameters(), model.parameters()):
                    e.mul_(0.99).add_(p, alpha=0.01)
        elif kind == "second model and optimizer":
            other, opt = self.state["model"], self.state["opt"]
            other(x.detach()).square().mean().backward()
            opt.step()
            opt.zero_grad()
        elif kind == "leak":
            self.state["kept"].append(torch.ones(self.size // 4, device=self.device))
        elif kind == "buffer reused in place":
            self.state["cache"][: x.numel()].copy_(x.detach().flatten())

    def before(self) -> int:
        """Bytes of it alive before the checked iteration and still alive at its peak."""
        s = self.state
        kind = self.name
        if kind in ("frozen reference model", "frozen model never run"):
            return storage_bytes(*s["ref"].parameters())
        if kind == "EMA copy":
            return storage_bytes(*s["ema"].parameters(), *s["ema"].buffers(), s["pad"])
        if kind == "dataset cached on the device":
            return storage_bytes(s["data"])
        if kind == "second model and optimizer":
            # its weights and Adam's state (its gradients are None between its steps)
            return storage_bytes(
                *s["model"].parameters(), *(t for t in optimizer_state_tensors([s["opt"]]) if t.device.type == self.device.type)
            )
        if kind == "leak":
            return storage_bytes(*s["kept"][: CHECKED - 1])  # one per iteration before the checked one
        if kind == "buffer reused in place":
            return storage_bytes(s["cache"])
        raise AssertionError(kind)


KINDS = (
    "frozen reference model",
    "frozen model never run",
    "EMA copy",
    "dataset cached on the device",
    "second model and optimizer",
    "leak",
    "buffer reused in place",
)


def run(setup: Setup, device: torch.device, kind: str | None, size: int) -> tuple[IterationRecord, int | None]:
    """Train ``setup``'s model for :data:`CHECKED` iterations beside foreign memory ``kind``
    (``None``: none), profiled with ``by_layer=True``; the checked iteration's record, and what the
    foreign memory held before it (bytes, computed from its tensors)."""
    torch.manual_seed(0)
    model = setup.make_model().to(device)
    opt = setup.make_optimizer(model)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(setup.batch, setup.width, generator=gen).to(device) for _ in range(CHECKED)]
    foreign = Foreign(kind, device, size) if kind is not None else None
    record = None
    with MemoryProfiler(model, 1, by_layer=True, overhead=None, stream=io.StringIO(), strict=True) as profiler:
        if foreign is not None:
            foreign.start(model, setup.width)
        for step, x in enumerate(xs):
            if foreign is not None:
                x = foreign.batch(x, step)
            out = model(x)
            target = foreign.target_of(x, out) if foreign is not None else torch.zeros_like(out)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            del out, target, loss
            opt.step()
            opt.zero_grad()
            if foreign is not None:
                foreign.each(model, x)
            if step == CHECKED - 1:
                expected = foreign.before() if foreign is not None else None
            record = profiler.record_stats()
    assert record is not None and record.iteration == CHECKED
    return record, expected


def advice_of(record: IterationRecord) -> dict[str, int]:
    """The advice given for ``record``, kind -> bytes it promises."""
    return {a.kind: a.saves for a in advise(record)}


def check_no_wrong_advice(baseline: IterationRecord, with_foreign: IterationRecord) -> None:
    """Every advice given beside foreign memory is one the model alone gets, promising the same
    bytes (each measured from the model's own tensors): foreign memory adds none and inflates none.
    It may drop one (the peak grew, so a saving can fall under the share that is worth a line)."""
    alone, beside = advice_of(baseline), advice_of(with_foreign)
    for kind, saves in beside.items():
        assert kind in alone, (kind, saves, alone)
        assert saves == alone[kind], (kind, saves, alone[kind])
