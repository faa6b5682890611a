"""Training workloads for the benchmarks, on synthetic data.

Each workload builds a model, an optimizer and a batch, and gives a ``step()``
that runs forward, loss, backward, optimizer step and ``zero_grad()``.

- ``gpt2``: a GPT-2-small-size decoder (124M parameters, tied embeddings),
  bf16 autocast, batch 8 x 512 tokens, AdamW;
- ``resnet50``: torchvision's ResNet-50, fp32, batch 64, SGD with momentum;
- ``neumf``: NeuMF with the MovieLens-20M sizes, batch 65,536, Adam;
- ``tiny_mlp``: 8 x Linear(1024), batch 64, where any Python cost shows.

``build(name, device, quick=True)`` makes each of them small enough for a
CPU smoke test in seconds; ``WorkloadUnavailable`` says why one cannot be
built here (ResNet-50 needs torchvision).

Two more for training on the CPU itself (``CPU_WORKLOADS``, used by
``benchmarks/cpu_overhead.py``), where every operator passes through the CPU
counter's dispatch mode:

- ``cpu_mlp``: an MNIST-size MLP, 784-256-256-10, batch 128, cross-entropy, Adam
  (about 3.5-4 ms a step on one thread of a 2-core EPYC);
- ``small_cnn``: two 3x3 convolutions (16 and 32 channels) with pooling and a
  linear head on 32x32 images, batch 24, Adam (about 8 ms a step there).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@dataclass
class Workload:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], torch.Tensor]
    description: str
    #: the batch tensors that stay alive from one step to the next
    inputs: tuple[torch.Tensor, ...] = ()


class WorkloadUnavailable(RuntimeError):
    """The workload cannot be built on this machine (a missing package, say)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 small: 12 layers, 12 heads, 768 wide, 50,257 tokens, 1,024 positions, tied head."""

    def __init__(self, vocab: int = 50_257, ctx: int = 1024, dim: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(device: torch.device, batch: int = 8, seq: int = 512, **sizes: int) -> Workload:
    torch.manual_seed(0)
    model = GPT(**sizes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model.wte.num_embeddings, (batch, seq + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = device.type in ("cuda", "cpu")

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    n = sum(p.numel() for p in model.parameters())
    return Workload(
        "gpt2", model, opt, step, f"GPT-2 ({n / 1e6:.1f}M params, tied), bf16 autocast, batch {batch}x{seq}, AdamW", (idx,)
    )


def resnet50(device: torch.device, batch: int = 64, image: int = 224) -> Workload:
    try:
        import torchvision
    except ImportError as err:
        raise WorkloadUnavailable(f"resnet50 needs torchvision ({err})") from err

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Workload("resnet50", model, opt, step, f"ResNet-50, fp32, batch {batch}x{image}x{image}, SGD momentum", (x, y))


def neumf(device: torch.device, batch: int = 65_536, num_users: int = 0, num_items: int = 0) -> Workload:
    from neumf import NUM_ITEMS, NUM_USERS, NeuMF

    num_users, num_items = num_users or NUM_USERS, num_items or NUM_ITEMS
    torch.manual_seed(0)
    model = NeuMF(num_users, num_items).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    users = torch.randint(0, num_users, (batch,), device=device)
    items = torch.randint(0, num_items, (batch,), device=device)
    labels = torch.randint(0, 2, (batch,), device=device).float()

    def step() -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(model(users, items), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sizes = "MovieLens-20M sizes" if (num_users, num_items) == (NUM_USERS, NUM_ITEMS) else f"{num_users} users, {num_items} items"
    return Workload("neumf", model, opt, step, f"NeuMF ({sizes}), batch {batch}, Adam", (users, items, labels))


def tiny_mlp(device: torch.device, batch: int = 64, width: int = 1024, depth: int = 8) -> Workload:
    return _mlp("tiny_mlp", device, batch, width, depth, f"{depth} x Linear({width}), batch {batch}, Adam")


def _mlp(name: str, device: torch.device, batch: int, width: int, depth: int, description: str) -> Workload:
    """``depth`` blocks of Linear(width) and ReLU, Adam, one fixed batch."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)

    def step() -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Workload(name, model, opt, step, description, (x,))


def cpu_mlp(device: torch.device, batch: int = 128, hidden: int = 256) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Workload("cpu_mlp", model, opt, step, f"MLP 784-{hidden}-{hidden}-10, batch {batch}, cross-entropy, Adam", (x, y))


def small_cnn(device: torch.device, batch: int = 24, channels: int = 16, image: int = 32) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * (image // 4) ** 2, 10),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Workload(
        "small_cnn", model, opt, step, f"CNN conv{channels}-conv{2 * channels}-linear, batch {batch}x3x{image}x{image}, Adam", (x, y)
    )


def deep_mlp(device: torch.device, depth: int = 64, batch: int = 32, width: int = 64) -> Workload:
    """``depth`` blocks of Linear and ReLU, narrow: a host-bound step whose cost grows with the
    number of modules (the scaling sweep: 64, 512 and 4,096 layers)."""
    return _mlp(f"deep_{depth}", device, batch, width, depth, f"{depth} x Linear({width}) + ReLU, batch {batch}, Adam")


def _deep(depth: int) -> Callable[..., Workload]:
    def make(device: torch.device, **sizes: int) -> Workload:
        return deep_mlp(device, depth=depth, **sizes)

    return make


#: The scaling sweep: the same narrow MLP at 64, 512 and 4,096 layers.
SCALING: dict[str, Callable[..., Workload]] = {f"deep_{n}": _deep(n) for n in (64, 512, 4096)}

#: Workloads for training on the CPU (``benchmarks/cpu_overhead.py``).
CPU_WORKLOADS: dict[str, Callable[..., Workload]] = {"cpu_mlp": cpu_mlp, "small_cnn": small_cnn}

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "gpt2": gpt2,
    "resnet50": resnet50,
    "neumf": neumf,
    "tiny_mlp": tiny_mlp,
    **SCALING,
}

#: Sizes for a smoke test on a CPU: each step takes milliseconds.
QUICK: dict[str, dict[str, int]] = {
    "gpt2": {"batch": 2, "seq": 32, "vocab": 512, "ctx": 64, "dim": 64, "layers": 2, "heads": 2},
    "resnet50": {"batch": 2, "image": 64},
    "neumf": {"batch": 512, "num_users": 2_000, "num_items": 500},
    "tiny_mlp": {"batch": 16, "width": 128, "depth": 8},
    "cpu_mlp": {"batch": 16, "hidden": 32},
    "small_cnn": {"batch": 2, "channels": 4, "image": 16},
    **{name: {"batch": 4, "width": 16} for name in SCALING},
}


def build(name: str, device: torch.device, quick: bool = False) -> Workload:
    """The workload ``name`` on ``device``, at full size or at the ``QUICK`` sizes.

    Raises:
        WorkloadUnavailable: it cannot be built here (e.g. torchvision is missing).
    """
    known = {**WORKLOADS, **CPU_WORKLOADS}
    if name not in known:
        raise ValueError(f"workload must be one of {', '.join(known)}; got {name!r}")
    return known[name](device, **(QUICK[name] if quick else {}))


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
