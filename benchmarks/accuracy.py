"""The profiler's figures against independent measurements, on the benchmark workloads.

    python benchmarks/accuracy.py                        # every workload, on the GPU
    python benchmarks/accuracy.py --device cpu --quick   # a smoke test in seconds

For each workload, after a few warm-up steps:

- weights, buffers: ``numel() * element_size()`` of the model's unique
  parameter (buffer) storages;
- gradients: the same over the parameters' ``.grad`` when ``optimizer.step()``
  starts (backward has ended; the profiler measures them then too);
- optimizer state: the same over the optimizer's state tensors on the device;
- feature maps: the bytes of the storages autograd saved for backward during
  the model's forward, seen by this script's own ``saved_tensors_hooks`` pack
  hook in an identical unprofiled step (each storage once; parameters, buffers
  and the forward's inputs left out), against the profiler's per-layer total
  (``record.layers.total``) and its allocator delta (``record.feature_maps``,
  which also holds the forward's outputs and what autocast caches);
- iteration peak: ``torch.cuda.max_memory_allocated()`` over an identical
  unprofiled step (allocations repeat exactly once warmed up);
- allocated: ``torch.cuda.memory_allocated()`` right after ``record_stats()``;
- categories plus other: weights + optimizer state + buffers + gradients still
  held + the batch (other) against ``memory_allocated()``; what is left is what
  no category explains (the allocator's rounding to 512 bytes, cuBLAS workspaces);
- peak breakdown (sum): the sum of ``record.peak_breakdown`` against
  ``max_memory_allocated()`` over an identical unprofiled step (on the CPU,
  against the profiler's own iteration peak: the sum must be exact);
- feature maps at the peak: ``peak_breakdown["activations"]`` against the bytes
  this script's pack hook saw (equal where the peak is reached before backward
  has freed any of them, as where backward begins; smaller otherwise).

Errors are the profiler's figure minus the independent one, in bytes and in
percent of the independent one. Prints a Markdown table; with ``--out DIR``
(default: ``$OUT`` when set) writes ``accuracy.md`` and ``accuracy.csv`` there.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, mb, output_dir, quiet_collector, sync, write_csv  # noqa: E402
from workloads import WORKLOADS, Workload, WorkloadUnavailable, build  # noqa: E402

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.measure.saved_tensors import can_chain  # noqa: E402

#: The figures compared, in the table's order.
FIGURES = (
    "weights",
    "gradients",
    "optimizer state",
    "buffers",
    "feature maps by layer",
    "feature maps (allocator delta)",
    "iteration peak",
    "allocated",
    "categories + other",
    "peak breakdown (sum)",
    "feature maps at the peak",
)


@dataclass
class Comparison:
    workload: str
    figure: str
    profiler: int | None
    independent: int | None
    method: str
    status: str = "ok"

    @property
    def error(self) -> int | None:
        if self.profiler is None or self.independent is None:
            return None
        return self.profiler - self.independent

    @property
    def error_pct(self) -> float | None:
        error = self.error
        if error is None:
            return None
        if self.independent == 0:
            return 0.0 if error == 0 else float("inf")
        return 100.0 * error / self.independent


# -- independent measurements -------------------------------------------------------------


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.device.index or 0)


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device) -> int:
    """``numel() * element_size()`` of each storage on ``device``, the first tensor met over it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None or not _on(t, device):
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = []
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, dict) else [state]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


class SavedTensorCounter:
    """Bytes of the storages autograd saves for backward during the model's (outermost) forward.

    Each storage counts once, by its ``nbytes()``; storages of parameters,
    buffers and the forward's tensor arguments are left out. Only the model's
    forward is watched: the loss and the optimizer save nothing of the model's.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.saved_bytes = 0
        self.saved_storages = 0
        self._seen: set[tuple[int, int]] = set()
        self._excluded: set[tuple[int, int]] = set()
        self._depth = 0
        self._context: Any = None
        self._handles: list = []

    def __enter__(self) -> SavedTensorCounter:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre),
            self.model.register_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        state = [*self.model.parameters(), *self.model.buffers(), *_flat_tensors(args)]
        self._excluded = {_storage_key(t) for t in state if t is not None}
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._context.__enter__()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if _on(t, self.device):
            key = _storage_key(t)
            if key[0] != 0 and key not in self._seen and key not in self._excluded:
                self._seen.add(key)
                self.saved_bytes += t.untyped_storage().nbytes()
                self.saved_storages += 1
        return t


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _flat_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _flat_tensors(item)]
    return []


# -- one workload ---------------------------------------------------------------------





def compare(work: Workload, device: torch.device, warmup: int) -> list[Comparison]:
    cuda = device.type == "cuda"
    model, opt = work.model, work.optimizer
    for _ in range(warmup):
        work.step()

    reference_peaks = []

    def reference_peak() -> None:
        if cuda:
            with quiet_collector():
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                work.step()
                sync(device)
            reference_peaks.append(torch.cuda.max_memory_allocated(device))

    reference_peak()
    with SavedTensorCounter(model, device) as saved:
        work.step()

    grads_at_step: list[int] = []

    def count_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads_at_step.append(unique_storage_bytes((p.grad for p in model.parameters()), device))

    with open(os.devnull, "w") as sink:
        profiler = MemoryProfiler(model, 1, stream=sink, by_layer=True, strict=True)
        try:
            work.step()
            profiler.record_stats()
            handle = opt.register_step_pre_hook(count_gradients)
            try:
                with quiet_collector():
                    work.step()
                    record = profiler.record_stats()
                allocated_now = torch.cuda.memory_allocated(device) if cuda else None
            finally:
                handle.remove()
        finally:
            profiler.close()
    reference_peak()  # once more: allocations repeat step after step

    assert record is not None
    weights = unique_storage_bytes(model.parameters(), device)
    buffers = unique_storage_bytes(model.buffers(), device)
    state = unique_storage_bytes(optimizer_tensors(opt), device)
    grads_held = unique_storage_bytes((p.grad for p in model.parameters()), device)
    batch = unique_storage_bytes(work.inputs, device)
    saved_method = f"storages saved for backward in the model's forward ({saved.saved_storages}, unique)"

    def row(figure: str, profiler_bytes: int | None, independent: int | None, method: str) -> Comparison:
        return Comparison(work.name, figure, profiler_bytes, independent, method)

    def no_allocator(figure: str, profiler_bytes: int | None) -> Comparison:
        return Comparison(work.name, figure, profiler_bytes, None, "", "n/a on CPU (no allocator counters)")

    rows = [
        row("weights", record.weights, weights, "numel*element_size of unique parameter storages"),
        row("gradients", record.gradients, grads_at_step[-1] if grads_at_step else None, ".grad at optimizer.step(), unique storages"),
        row("optimizer state", record.optimizer_state, state, "optimizer.state tensors on the device, unique storages"),
        row("buffers", record.buffers, buffers, "numel*element_size of unique buffer storages"),
        row("feature maps by layer", record.layers.total if record.layers is not None else None, saved.saved_bytes, saved_method)
        if can_chain()
        else Comparison(
            work.name, "feature maps by layer", None, saved.saved_bytes, saved_method,
            f"n/a on torch {torch.__version__} (by layer needs torch 2.8 or later)",
        ),
        row("feature maps (allocator delta)", record.feature_maps, saved.saved_bytes, saved_method),
    ]
    if cuda:
        peaks = sorted(set(reference_peaks))
        method = "max_memory_allocated() over an identical unprofiled step"
        if len(peaks) > 1:
            method += f" (it varied: {', '.join(f'{p:,}' for p in peaks)}; first taken)"
        accounted = record.weights + record.optimizer_state + record.buffers + grads_held + batch
        rows += [
            row("iteration peak", record.iteration_peak_allocated, reference_peaks[0], method),
            row("allocated", record.allocated, allocated_now, "memory_allocated() right after record_stats()"),
            row(
                "categories + other",
                accounted,
                allocated_now,
                f"weights + optimizer state + buffers + gradients held ({grads_held:,}) + batch ({batch:,}) "
                "vs memory_allocated()",
            ),
        ]
    breakdown = record.peak_breakdown
    breakdown_sum = sum(breakdown.values()) if breakdown is not None else None
    if cuda:
        rows.append(row("peak breakdown (sum)", breakdown_sum, reference_peaks[0], method))
    else:
        rows.append(
            row("peak breakdown (sum)", breakdown_sum, record.iteration_peak_allocated, "the profiler's own iteration peak (CPU counter)")
        )
    rows.append(
        row(
            "feature maps at the peak",
            breakdown["activations"] if breakdown is not None else None,
            saved.saved_bytes,
            saved_method + f"; peak in {record.peak_phase}",
        )
    )
    if not cuda:
        rows += [
            no_allocator("iteration peak", record.iteration_peak_allocated),
            no_allocator("allocated", record.allocated),
            no_allocator("categories + other", record.weights + record.optimizer_state + record.buffers + grads_held + batch),
        ]
    return rows


# -- the run ---------------------------------------------------------------------


def _pct(c: Comparison) -> str:
    pct = c.error_pct
    if pct is None:
        return ""
    return "inf" if pct == float("inf") else f"{pct:+.3f}%"


def main(argv: list[str] | None = None) -> list[Comparison]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small models: a smoke test")
    parser.add_argument("--out", default=None, help="folder for accuracy.md and accuracy.csv (default: $OUT)")
    parser.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = output_dir(args.out)

    results: list[Comparison] = []
    descriptions = []
    for name in args.workloads:
        try:
            work = build(name, device, quick=args.quick)
        except WorkloadUnavailable as exc:
            results.append(Comparison(name, "(all)", None, None, "", f"unavailable: {exc}"))
            print(f"{name}: unavailable: {exc}", flush=True)
            continue
        descriptions.append(f"- {name}: {work.description}")
        try:
            rows = compare(work, device, args.warmup)
        except Exception as exc:  # noqa: BLE001 - one failing workload must not end the run
            message = " ".join(str(exc).split())[:200]
            rows = [Comparison(name, "(all)", None, None, "", f"failed: {type(exc).__name__}: {message}")]
        results += rows
        for c in rows:
            error = "" if c.error is None else f"{c.error:+,} B ({_pct(c)})"
            print(f"{name:9s} {c.figure:32s} {error or c.status}", flush=True)
        del work
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    lines = [
        "",
        environment_line(device),
        "Error = the profiler's figure minus the independent measurement (bytes; % of the independent one).",
        "",
        "Workloads:",
        *descriptions,
        "",
    ]
    headers = ["Workload", "Figure", "Profiler (MB)", "Independent (MB)", "Error (bytes)", "Error (%)", "Independent measurement"]
    table = []
    for c in results:
        if c.status != "ok":
            table.append([c.workload, c.figure, mb(c.profiler), "", c.status, "", c.method])
        else:
            error = "n/a" if c.error is None else f"{c.error:+,}"
            table.append([c.workload, c.figure, mb(c.profiler), mb(c.independent), error, _pct(c), c.method])
    lines.append(markdown_table(headers, table))
    lines.append("")
    lines.append("MB = 10^6 bytes.")
    print("\n".join(lines), flush=True)

    csv_headers = ["workload", "figure", "status", "profiler_bytes", "independent_bytes", "error_bytes", "error_pct", "method", "device", "torch"]
    env = environment_line(device)
    csv_rows = [
        [c.workload, c.figure, c.status, c.profiler, c.independent, c.error, c.error_pct, c.method, env, torch.__version__]
        for c in results
    ]
    if args.csv:
        write_csv(Path(args.csv), csv_headers, csv_rows)
    if out is not None:
        write_csv(out / "accuracy.csv", csv_headers, csv_rows)
        (out / "accuracy.md").write_text("\n".join(lines) + "\n")
        print(f"\nwrote accuracy.md and accuracy.csv in {out}")
    return results


if __name__ == "__main__":
    main()
