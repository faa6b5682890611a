"""The zoo's models written here, as users write them: no third-party package needed.

Each class is a complete model whose ``forward`` takes the batch the zoo's inputs
function makes (see :mod:`benchmarks.zoo.registry`):

- :class:`UNet`: encoder-decoder with skip connections, BatchNorm, max-pooling down,
  transposed convolutions and bilinear interpolation up;
- :class:`TopKMoE`: a transformer-style layer whose feed-forward is a mixture of
  experts with top-k routing: tokens are gathered per expert with ``nonzero`` and the
  results scattered back with ``index_add_`` (data-dependent shapes);
- :class:`NeuMF`: neural matrix factorisation (dense embeddings);
- :class:`SparseRecommender`: a DLRM-style model with ``nn.EmbeddingBag(sparse=True)``
  tables (sparse gradients) and an MLP over their concatenation;
- :class:`RecurrentLM`: an LSTM or GRU language model (cuDNN on CUDA);
- :class:`CheckpointedTransformer`: pre-norm transformer blocks, each run through
  ``torch.utils.checkpoint`` (non-reentrant);
- :class:`BatchNormCNN`: a VGG-style stack, a BatchNorm after every convolution.

Example::

    >>> import torch
    >>> UNet(channels=4, depth=2, classes=3)(torch.zeros(1, 3, 16, 16)).shape
    torch.Size([1, 3, 16, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A UNet: ``depth`` downsamplings, channels doubling each; up by transposed convolution
    on the deepest level and by bilinear interpolation on the others; skips concatenated."""

    def __init__(self, channels: int = 32, depth: int = 4, classes: int = 2, in_channels: int = 3) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_conv_block(in_channels, widths[0])])
        self.down.extend(_conv_block(widths[i], widths[i + 1]) for i in range(depth))
        self.up_conv = nn.ConvTranspose2d(widths[-1], widths[-2], 2, stride=2)
        self.up = nn.ModuleList(
            _conv_block(widths[i] + widths[i] if i == depth - 1 else widths[i + 1] + widths[i], widths[i])
            for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for i, block in enumerate(self.up):
            skip = skips.pop()
            x = self.up_conv(x) if i == 0 else F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


class Experts(nn.Module):
    """``count`` feed-forward experts; each token goes to its ``top_k`` experts by the router's
    scores, gathered by ``nonzero`` and scattered back by ``index_add_``."""

    def __init__(self, dim: int, hidden: int, count: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, count, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert(tokens[rows]) * weights[rows, slot].unsqueeze(-1).to(tokens.dtype)
            out = out.index_add(0, rows, y.to(out.dtype))
        return out.view_as(x)


class TopKMoE(nn.Module):
    """Token embedding, ``layers`` x (self-attention, mixture-of-experts feed-forward), a head."""

    def __init__(self, vocab: int = 8192, dim: int = 512, heads: int = 8, layers: int = 2, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moe = nn.ModuleList(Experts(dim, 4 * dim, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for attn, n1, n2, moe in zip(self.attn, self.norm1, self.norm2, self.moe):
            h = n1(x)
            x = x + attn(h, h, h, need_weights=False)[0]
            x = x + moe(n2(x))
        return self.head(x)


class NeuMF(nn.Module):
    """Neural matrix factorisation: a GMF and an MLP branch over user and item embeddings."""

    def __init__(self, users: int = 138_493, items: int = 26_744, mf_dim: int = 64, mlp: tuple[int, ...] = (256, 256, 128, 64)) -> None:
        super().__init__()
        self.mf_user = nn.Embedding(users, mf_dim)
        self.mf_item = nn.Embedding(items, mf_dim)
        self.mlp_user = nn.Embedding(users, mlp[0] // 2)
        self.mlp_item = nn.Embedding(items, mlp[0] // 2)
        layers: list[nn.Module] = []
        for n_in, n_out in zip(mlp[:-1], mlp[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.final = nn.Linear(mlp[-1] + mf_dim, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        mf = self.mf_user(users) * self.mf_item(items)
        deep = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=1))
        return self.final(torch.cat([mf, deep], dim=1)).squeeze(1)


class SparseRecommender(nn.Module):
    """DLRM-style: dense features through a bottom MLP, ``tables`` sparse ``EmbeddingBag``
    tables (one bag of ``bag`` ids per table and sample), a top MLP over them all."""

    def __init__(self, rows: int = 1_000_000, dim: int = 64, tables: int = 8, dense: int = 13) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # ids: (batch, tables, bag)
        pooled = [table(ids[:, t]) for t, table in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


class RecurrentLM(nn.Module):
    """Embedding, a multi-layer ``nn.LSTM`` or ``nn.GRU``, a linear head over the vocabulary."""

    def __init__(self, kind: str = "lstm", vocab: int = 10_000, dim: int = 512, layers: int = 2) -> None:
        super().__init__()
        cell = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = cell(dim, dim, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(idx))[0])


class Block(nn.Module):
    """A pre-norm transformer block (causal attention, GELU feed-forward)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CheckpointedTransformer(nn.Module):
    """Token and position embeddings, ``layers`` blocks each recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant), a final norm and a head."""

    def __init__(self, vocab: int = 32_000, ctx: int = 1024, dim: int = 768, heads: int = 12, layers: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


class BatchNormCNN(nn.Module):
    """VGG-style: stages of (3x3 convolution, BatchNorm, ReLU) x ``per_stage``, max-pooling
    between stages, channels doubling; global average pooling and a linear head."""

    def __init__(self, channels: int = 64, stages: int = 4, per_stage: int = 2, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for s in range(stages):
            c_out = channels * 2**s
            for _ in range(per_stage):
                layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
                c_in = c_out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class MLPMixerish(nn.Module):
    """A plain residual MLP over token features: the model the zoo compiles with ``torch.compile``."""

    def __init__(self, dim: int = 1024, layers: int = 8, classes: int = 1000) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))
