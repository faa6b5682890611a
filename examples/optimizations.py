"""How much do gradient checkpointing and mixed precision save? One model, trained four ways.

The model is a stack of transformer feed-forward blocks (LayerNorm, Linear to
4x width, GELU, Linear back, residual) over a batch of long sequences: the
activations kept for backward are several times the weights, gradients and
optimizer state together, which is where both techniques act.

- baseline: float32, every activation kept for backward;
- checkpointing: ``torch.utils.checkpoint`` per block (``use_reentrant=False``):
  only each block's input is kept, the block runs again in backward;
- AMP: ``torch.autocast`` to bfloat16 (or float16 with a gradient scaler):
  activations in half the bytes;
- both.

Each configuration trains with the profiler writing its CSV file; the table
at the end is made by the same code as ``pytorch-mem-profiler compare``::

    python examples/optimizations.py                 # a GPU if there is one, else a small CPU run
    python examples/optimizations.py --device cpu --iterations 3
    python examples/optimizations.py --width 2048 --depth 12 --batch 8 --seq 2048
    pytorch-mem-profiler compare memory_csv_data/memory_stats_*.csv   # the same table, later
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    import pytorch_mem_profiler  # noqa: F401
except ImportError:  # run from a clone without installing: use the package beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.compare import Comparison, compare_runs, format_markdown
from pytorch_mem_profiler.outputs.report import UNITS
from pytorch_mem_profiler.analysis.runs import load_run

#: Sizes by device: (width, depth, batch, seq). On a GPU, activations of
#: batch * seq = 16384 tokens dominate the 8 blocks' 67M parameters.
DEFAULT_SIZES = {"cuda": (1024, 8, 16, 1024), "cpu": (64, 4, 8, 128)}

CONFIGURATIONS = (
    ("baseline", False, False),
    ("gradient checkpointing", True, False),
    ("AMP", False, True),
    ("checkpointing + AMP", True, True),
)


class FeedForwardBlock(nn.Module):
    """A transformer block's feed-forward half: x + W2 gelu(W1 norm(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class FeedForwardStack(nn.Module):
    """``depth`` blocks; with ``checkpointing`` each block keeps only its input for backward."""

    def __init__(self, width: int, depth: int, checkpointing: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeedForwardBlock(width) for _ in range(depth))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


def amp_dtype(device: torch.device, requested: str) -> torch.dtype:
    """bfloat16 where the device has it, float16 otherwise (or what was asked)."""
    if requested == "float16":
        return torch.float16
    if requested == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def train(
    name: str,
    checkpointing: bool,
    amp: bool,
    args: argparse.Namespace,
    device: torch.device,
) -> Path:
    """Train one configuration with the profiler on; returns its CSV file."""
    torch.manual_seed(0)
    model = FeedForwardStack(args.width, args.depth, checkpointing).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    dtype = amp_dtype(device, args.amp_dtype)
    # float16 gradients can underflow: scale the loss (bfloat16 has float32's range).
    scaler = torch.amp.GradScaler(device.type, enabled=amp and dtype == torch.float16)
    report = open(os.devnull, "w") if not args.verbose else None
    profiler = memory_profiler(
        model,
        print_period=args.print_period,
        csv=True,
        csv_dir=args.csv_dir,
        units=args.units,
        stream=report,
    )
    try:
        for _epoch in range(args.epochs):
            for _ in range(args.iterations):
                x = torch.randn(args.batch, args.seq, args.width, device=device)
                with torch.autocast(device.type, dtype=dtype, enabled=amp):
                    out = model(x)
                loss = out.float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                loss.item()  # waits for the device, as logging the loss would: times are real
                profiler.record_stats()
            profiler.epoch_end()
    finally:
        profiler.close()
        if report is not None:
            report.close()
    path = profiler.csv_path
    del model, optimizer, profiler, x, out, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next configuration starts from an empty cache
    print(f"{name}: {path}", flush=True)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", help="cuda, cuda:1, cpu... (default: cuda if available, else cpu)"
    )
    parser.add_argument("--width", type=int, help="model width (default: 1024 on GPU, 64 on CPU)")
    parser.add_argument("--depth", type=int, help="blocks (default: 8 on GPU, 4 on CPU)")
    parser.add_argument(
        "--batch", type=int, help="sequences per batch (default: 16 on GPU, 8 on CPU)"
    )
    parser.add_argument(
        "--seq", type=int, help="tokens per sequence (default: 1024 on GPU, 128 on CPU)"
    )
    parser.add_argument(
        "--iterations", type=int, default=10, help="iterations per epoch (default: 10)"
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument(
        "--print-period", type=int, default=1, help="report every N iterations (default: 1)"
    )
    parser.add_argument(
        "--amp-dtype",
        choices=("auto", "bfloat16", "float16"),
        default="auto",
        help="autocast type (default: bfloat16 where supported)",
    )
    parser.add_argument(
        "--units",
        default="MB",
        choices=list(UNITS),
        help="unit of the CSV files and table (default: MB)",
    )
    parser.add_argument("--csv-dir", default="memory_csv_data", help="where the CSV files go")
    parser.add_argument("--verbose", action="store_true", help="print the profiler's reports too")
    args = parser.parse_args(argv)
    for name in ("width", "depth", "batch", "seq", "iterations", "epochs", "print_period"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def measure(args: argparse.Namespace) -> list[Comparison]:
    """Train the four configurations; their comparison, the first being the baseline."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = DEFAULT_SIZES["cuda" if device.type == "cuda" else "cpu"]
    for name, default in zip(("width", "depth", "batch", "seq"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtype = amp_dtype(device, args.amp_dtype)
    print(
        f"{where}, torch {torch.__version__}: {args.depth} blocks of width {args.width}, "
        f"batch {args.batch} x {args.seq} tokens, Adam, AMP {str(dtype).replace('torch.', '')}, "
        f"{args.epochs} x {args.iterations} iterations",
        flush=True,
    )
    paths = [train(name, ckpt, amp, args, device) for name, ckpt, amp in CONFIGURATIONS]
    return compare_runs([load_run(p) for p in paths], [name for name, _, _ in CONFIGURATIONS])


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    table = format_markdown(measure(args), args.units)
    print()
    print(table)
    return table


if __name__ == "__main__":
    main()
