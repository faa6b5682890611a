"""``estimate_memory`` against the GPU: estimated and measured peaks, and the largest batch that fits.

    python benchmarks/estimate_accuracy.py --out results/     # GPT-2 small bf16, ResNet-50, NeuMF; about 3-4 minutes on an H200
    python benchmarks/estimate_accuracy.py --quick --device cpu  # small sizes on the CPU, seconds: a smoke test

For each workload of ``benchmarks/workloads.py`` (the same model, batch,
optimizer and step), at two batch sizes:

- warm-up: one step of the workload at a batch of one, then everything dropped,
  so that the libraries' workspaces (cuBLAS, cuBLASLt, cuDNN) exist before
  measuring; what stays allocated after it is reported as "persistent";
- measured: ``torch.cuda.max_memory_allocated()`` over the workload's first two
  steps (forward, loss, backward, optimizer step, ``zero_grad``) less what was
  allocated before the model (the persistent workspaces), from an empty cache;
  on the CPU, the profiler's exact CPU counter over the same steps;
- estimated: ``estimate_memory(...).peak`` (the tensors, in 512-byte blocks on
  CUDA), made on the GPU's own device type; and the same made on fake CPU tensors
  standing in for CUDA (what a machine without a GPU computes).

Then, on CUDA, the largest batch: on a "small card" made with
``torch.cuda.set_per_process_memory_fraction`` (a few GB of the GPU, never all
of it), the batch ``max_batch_size(limit, margin=0, outside=0)`` predicts from the
allocator replay (the limit is on reserved segments; nothing outside PyTorch
counts) runs for real and must fit; one 10% larger must fail with an
out-of-memory error or come within 5% of the limit (its ``max_memory_reserved()``).

Prints two Markdown tables; ``--out DIR`` (default: ``$OUT``) also writes
``estimate_accuracy.md``, ``estimate_peaks.csv`` and ``estimate_batches.csv``.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, output_dir, write_csv  # noqa: E402
from workloads import GPT, WORKLOADS, WorkloadUnavailable  # noqa: E402

from pytorch_mem_profiler import estimate_memory  # noqa: E402

#: Per workload: the two batch sizes compared, and the small card's size for the largest batch.
FULL = {"gpt2": ((4, 8), 12 << 30), "resnet50": ((32, 64), 8 << 30), "neumf": ((32_768, 65_536), 2 << 30)}
QUICK = {"gpt2": ((2, 4), 1 << 30), "resnet50": ((2, 4), 1 << 30), "neumf": ((512, 1024), 1 << 30)}
QUICK_SIZES = {"gpt2": {"seq": 32, "vocab": 512, "ctx": 64, "dim": 64, "layers": 2, "heads": 2}, "resnet50": {"image": 64}, "neumf": {"num_users": 2_000, "num_items": 500}}


def estimate_kwargs(name: str, sizes: dict[str, int]) -> dict[str, Any]:
    """``estimate_memory`` arguments for the workload ``name``: its model, batch, optimizer and loss."""
    if name == "gpt2":
        seq = sizes.get("seq", 512)
        shape = {k: v for k, v in sizes.items() if k != "seq"}
        vocab = shape.get("vocab", 50_257)
        return {
            "model": lambda: GPT(**shape),
            "example_inputs": lambda b: torch.zeros(b, seq, dtype=torch.long),
            "targets": lambda b: torch.zeros(b, seq, dtype=torch.long),
            "loss_fn": lambda logits, y: F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1)),
            "optimizer": lambda p: torch.optim.AdamW(p, lr=1e-4),
            "autocast": torch.bfloat16,
        }
    if name == "resnet50":
        import torchvision

        image = sizes.get("image", 224)
        return {
            "model": torchvision.models.resnet50,
            "example_inputs": lambda b: torch.zeros(b, 3, image, image),
            "targets": lambda b: torch.zeros(b, dtype=torch.long),
            "loss_fn": F.cross_entropy,
            "optimizer": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        }
    if name == "neumf":
        from neumf import NUM_ITEMS, NUM_USERS, NeuMF

        users, items = sizes.get("num_users", NUM_USERS), sizes.get("num_items", NUM_ITEMS)
        return {
            "model": lambda: NeuMF(users, items),
            "example_inputs": lambda b: (torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)),
            "targets": lambda b: torch.zeros(b),
            "loss_fn": F.binary_cross_entropy_with_logits,
            "optimizer": lambda p: torch.optim.Adam(p, lr=1e-3),
        }
    raise ValueError(f"no estimate for workload {name!r}")


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _warm_up(name: str, sizes: dict[str, int], device: torch.device) -> None:
    """One step at a batch of one, dropped: the libraries' workspaces exist from here on."""
    work = WORKLOADS[name](device, batch=1, **sizes)
    work.step()
    del work
    _fresh(device)


def measure(name: str, batch: int, sizes: dict[str, int], device: torch.device) -> tuple[int, int | None, int]:
    """The peak allocated over two steps of the workload at ``batch`` above what was allocated before
    it, the peak reserved (``None`` on the CPU), and that persistent base (the workspaces)."""
    if device.type == "cpu":
        return _measure_cpu(name, batch, sizes, device), None, 0
    _warm_up(name, sizes, device)
    base = torch.cuda.memory_allocated(device)
    work = WORKLOADS[name](device, batch=batch, **sizes)
    for _ in range(2):
        work.step()
    torch.cuda.synchronize(device)
    peaks = torch.cuda.max_memory_allocated(device) - base, torch.cuda.max_memory_reserved(device), base
    del work
    _fresh(device)
    return peaks


def _measure_cpu(name: str, batch: int, sizes: dict[str, int], device: torch.device) -> int:
    """The profiler's CPU peak (its exact counter of live storages) over two steps."""
    import io

    from pytorch_mem_profiler import MemoryProfiler

    work = WORKLOADS[name](device, batch=batch, **sizes)
    peaks = []
    with MemoryProfiler(work.model, print_period=1, stream=io.StringIO(), optimizer=work.optimizer) as profiler:
        for _ in range(2):
            work.step()
            peaks.append(profiler.record_stats().iteration_peak_allocated)
    del work
    gc.collect()
    return max(peaks)


def runs_within(name: str, batch: int, sizes: dict[str, int], device: torch.device, fraction: float) -> tuple[bool, int | None]:
    """Whether two steps at ``batch`` fit under the allocator limit ``fraction``, and their peak reserved."""
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        return True, measure(name, batch, sizes, device)[1]
    except torch.cuda.OutOfMemoryError:
        _fresh(device)
        return False, None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _pct(estimated: int, measured: int) -> str:
    return f"{100 * (estimated - measured) / measured:+.2f}%"


PEAK_HEADERS = [
    "workload", "batch", "estimated (MB)", "measured max_memory_allocated (MB)", "error",
    "estimated without the GPU (MB, error)", "persistent: measured / assumed workspaces (MB)",
    "estimated / measured reserved (MB)", "estimate time (s)",
]
BATCH_HEADERS = ["workload", "card (allocator limit)", "predicted max batch", "at it", "its peak reserved", "batch +10%", "at it", "verdict"]


def main(argv: list[str] | None = None) -> tuple[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and batches: a smoke test")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is a GPU")
    parser.add_argument("--workloads", nargs="+", default=list(FULL), choices=list(FULL))
    parser.add_argument("--out", help="folder for estimate_accuracy.md and the CSV files (default: $OUT)")
    args = parser.parse_args(argv)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    peak_rows: list[list[Any]] = []
    batch_rows: list[list[Any]] = []
    for name in args.workloads:
        sizes = QUICK_SIZES[name] if args.quick else {}
        try:
            kwargs = estimate_kwargs(name, sizes)
        except (ImportError, WorkloadUnavailable) as err:
            peak_rows.append([name, "-", f"unavailable: {err}"] + [""] * (len(PEAK_HEADERS) - 3))
            continue
        (small, large), card = plan[name]
        first = None
        for batch in (small, large):
            t0 = time.perf_counter()
            est = estimate_memory(**kwargs, batch_size=batch, device=device, fit=first is None)
            seconds = time.perf_counter() - t0
            first = first or est
            measured, reserved, persistent = measure(name, batch, sizes, device)
            if device.type == "cuda":
                emulated = estimate_memory(**kwargs, batch_size=batch, device=device, fit=False, emulate=True)
                without_gpu = f"{emulated.peak / 1e6:,.1f} ({_pct(emulated.peak, measured)})"
                # both with the workspaces' segments: the estimate's assumed, the measured real
                reserved_cell = f"{(est.reserved or 0) / 1e6:,.1f} / {(reserved or 0) / 1e6:,.1f}"
                persistent_cell = f"{persistent / 1e6:,.1f} / {est.workspace / 1e6:,.1f}"
            else:
                without_gpu, reserved_cell, persistent_cell = "-", "-", "-"
            peak_rows.append([
                name, batch, f"{est.peak / 1e6:,.1f}", f"{measured / 1e6:,.1f}", _pct(est.peak, measured),
                without_gpu, persistent_cell, reserved_cell, f"{seconds:.1f}",
            ])
        assert first is not None
        if device.type != "cuda":
            batch_rows.append([name, "-", "-", "needs a GPU", "-", "-", "-", "-"])
            continue
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = card / total
        limit = int(fraction * total)  # the bytes the allocator allows, computed as it computes them
        # the runs come after a warm-up step in this process (runs_within): its workspaces made already
        predicted = first.max_batch_size(limit, margin=0, outside=0, process="warmed")
        fits, reserved_at = runs_within(name, predicted, sizes, device, fraction)
        larger = math.ceil(predicted * 1.1)
        larger_fits, larger_reserved = runs_within(name, larger, sizes, device, fraction)
        near = larger_reserved is not None and larger_reserved >= 0.95 * limit
        verdict = "ok" if fits and (not larger_fits or near) else "MISS"
        batch_rows.append([
            name, f"{card / 2**30:g} GiB", predicted, "fits" if fits else "OOM",
            f"{reserved_at / 2**30:.2f} GiB" if reserved_at else "-", larger,
            "OOM" if not larger_fits else f"fits, {(larger_reserved or 0) / 2**30:.2f} GiB", verdict,
        ])
    peaks = markdown_table(PEAK_HEADERS, peak_rows)
    batches = markdown_table(BATCH_HEADERS, batch_rows)
    text = f"{environment_line(device)}; {time.perf_counter() - started:.0f} s in all\n\n{peaks}\n\n{batches}\n"
    print(text)
    out = output_dir(args.out)
    if out is not None:
        (out / "estimate_accuracy.md").write_text(text)
        write_csv(out / "estimate_peaks.csv", PEAK_HEADERS, peak_rows)
        write_csv(out / "estimate_batches.csv", BATCH_HEADERS, batch_rows)
    return peaks, batches


if __name__ == "__main__":
    main()
