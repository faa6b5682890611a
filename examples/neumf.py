"""NeuMF on MovieLens-20M sizes, synthetic data, profiled every 5 iterations.

The README's demo: ``python examples/neumf.py``. Runs on the GPU when there is
one, else on the CPU (with a smaller batch so it finishes in seconds). It prints
the compact report with feature maps by layer; ``--report full`` prints the
original tool's layout, which lists the four embeddings at 35, 7, 71 and 14 MB,
127 MB of weights in all, and the same again for their gradients. The CSV lands
in ``memory_csv_data/``.

NeuMF (He et al., 2017): a matrix-factorisation branch (user and item
embeddings of 64, multiplied) beside an MLP branch (user and item embeddings
of 128 side by side, then 256-256-128-64), joined by a final Linear(64 + 64, 1).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pytorch_mem_profiler import memory_profiler

NUM_USERS = 138_493
NUM_ITEMS = 26_744
MF_DIM = 64
MLP_SIZES = (256, 256, 128, 64)


class NeuMF(nn.Module):
    """Neural matrix factorisation with the MovieLens-20M table sizes."""

    def __init__(
        self,
        num_users: int = NUM_USERS,
        num_items: int = NUM_ITEMS,
        mf_dim: int = MF_DIM,
        mlp_sizes: tuple[int, ...] = MLP_SIZES,
    ) -> None:
        super().__init__()
        half = mlp_sizes[0] // 2
        self.mf_user_embed = nn.Embedding(num_users, mf_dim)
        self.mf_item_embed = nn.Embedding(num_items, mf_dim)
        self.mlp_user_embed = nn.Embedding(num_users, half)
        self.mlp_item_embed = nn.Embedding(num_items, half)
        layers: list[nn.Module] = []
        for n_in, n_out in zip(mlp_sizes[:-1], mlp_sizes[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.final = nn.Linear(mlp_sizes[-1] + mf_dim, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        mf = self.mf_user_embed(users) * self.mf_item_embed(items)
        mlp = self.mlp(torch.cat([self.mlp_user_embed(users), self.mlp_item_embed(items)], dim=1))
        return self.final(torch.cat([mf, mlp], dim=1)).squeeze(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10, help="iterations per epoch")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 65536 on GPU, 4096 on CPU")
    parser.add_argument("--print-period", type=int, default=5)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--csv-dir", default="memory_csv_data")
    parser.add_argument("--report", default="compact", choices=("compact", "full", "line"))
    parser.add_argument("--no-by-layer", dest="by_layer", action="store_false", help="skip the per-layer figures")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch = args.batch_size or (65_536 if device.type == "cuda" else 4_096)
    torch.manual_seed(0)
    model = NeuMF().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.BCEWithLogitsLoss()

    profiler = memory_profiler(
        model, args.print_period, True, csv_dir=args.csv_dir, report=args.report, by_layer=args.by_layer
    )
    for _epoch in range(args.epochs):
        for _ in range(args.iterations):
            users = torch.randint(0, NUM_USERS, (batch,), device=device)
            items = torch.randint(0, NUM_ITEMS, (batch,), device=device)
            labels = torch.randint(0, 2, (batch,), device=device).float()
            loss = loss_fn(model(users, items), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.record_stats()
        profiler.epoch_end()
    profiler.close()
    print(f"CSV written to {profiler.csv_path} ({device})")


if __name__ == "__main__":
    main()
