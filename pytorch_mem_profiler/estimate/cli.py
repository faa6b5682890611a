"""``pytorch-mem-profiler estimate``: a training step's memory and the largest batch, before running it.

MODEL is a torchvision model's name (``resnet50``; needs torchvision) or a Python
file that defines ``build_model()`` and ``example_inputs()`` (or
``example_inputs(batch_size)``), and may define ``batch_size``, ``loss_fn(output,
*targets)``, ``targets(batch_size)`` and ``optimizer(parameters)``::

    pytorch-mem-profiler estimate resnet50 --batch-size 64 --memory 80GB
    pytorch-mem-profiler estimate my_model.py --device cuda --autocast bf16 --memory 24GiB --compare
    pytorch-mem-profiler estimate my_model.py --parallel fsdp2 --world-size 8 --what-if ddp:2,fsdp2:2,fsdp2:8

This module imports torch only when the command runs, so that the rest of the
command line starts without it.

Example::

    >>> parse_memory("80GB"), parse_memory("1.5 GiB"), parse_memory("4096")
    (80000000000, 1610612736, 4096)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from ..units import UNITS
from .allocator import PROCESSES

__all__ = ["add_arguments", "run", "parse_memory", "load_model_file"]

#: Optimizers by the name ``--optimizer`` takes.
OPTIMIZER_NAMES = ("adam", "adamw", "sgd")


def parse_memory(text: str) -> int:
    """``"80GB"``, ``"24 GiB"``, ``"512MB"`` or a plain number of bytes, as bytes."""
    cleaned = str(text).strip().replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if cleaned.lower().endswith(unit.lower()) and unit != "B":
            number = cleaned[: -len(unit)]
            break
    else:
        unit, number = "B", cleaned[:-1] if cleaned.upper().endswith("B") else cleaned
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an amount like 80GB or 24GiB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive amount, got {text!r}")
    return int(value * UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``estimate`` subcommand's arguments."""
    parser.add_argument("model", metavar="MODEL", help="a torchvision model name, or a .py file defining build_model() and example_inputs()")
    parser.add_argument("--batch-size", type=int, help="the batch size (default: the file's batch_size, else 32)")
    parser.add_argument("--memory", type=parse_memory, help="the device's memory (80GB, 24GiB): print the largest batch that fits")
    parser.add_argument("--margin", type=float, default=0.1, help="share taken off the largest batch (default: 0.1)")
    parser.add_argument(
        "--process", choices=PROCESSES, default="fresh",
        help="with --memory on CUDA: cuBLAS's workspaces made at the first matrix product (fresh: a new process's first "
        "step, the default), before the step (warmed: after a warm-up or validation step), or either",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", help="the device to estimate for (default: cuda)")
    parser.add_argument("--optimizer", choices=OPTIMIZER_NAMES, help="the optimizer (default: the file's optimizer, else adam)")
    parser.add_argument("--autocast", choices=("bf16", "fp16"), help="run the forward under torch.autocast")
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint the model's repeated blocks")
    parser.add_argument("--compare", action="store_true", help="also estimate checkpointing, bf16 autocast and both")
    parser.add_argument("--image-size", type=int, default=224, help="torchvision models: image height and width (default: 224)")
    parser.add_argument("--units", choices=list(UNITS), default="MB", help="the unit of the figures (default: MB)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), help="estimate one rank of DDP or FSDP2 (with --world-size)")
    parser.add_argument("--world-size", type=int, help="the number of ranks for --parallel (the batch size is per rank)")
    parser.add_argument("--accumulation-steps", type=int, default=1, help="forwards and backwards per optimizer step (default: 1)")
    parser.add_argument("--max-grad-norm", type=float, help="clip the gradients' norm to this before each step")
    parser.add_argument("--keep-grads", action="store_true", help="zero_grad(set_to_none=False): gradients stay between steps")
    parser.add_argument("--grad-scaler", action="store_true", help="fp16 loss scaling with torch.amp.GradScaler (with --autocast fp16)")
    parser.add_argument("--seeded-draws", action="store_true",
                        help="a branch on a random draw (LayerDrop) takes the estimate's seeded draws (default: the largest step)")
    parser.add_argument(
        "--what-if",
        metavar="STRATEGY:N,...",
        help="also estimate each rank's peak for these strategies and world sizes: ddp:2,fsdp2:2,fsdp2:8",
    )


def load_model_file(path: Path) -> Any:
    """Import the Python file ``path`` as a module; ``ValueError`` if it lacks the functions needed."""
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no such file")
    spec = importlib.util.spec_from_file_location(f"_estimated_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    missing = [name for name in ("build_model", "example_inputs") if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(f"{str(path)!r} must define {' and '.join(f'{m}()' for m in missing)}")
    return module


def _optimizer(name: str | None, default: Any) -> Callable:
    import functools

    import torch

    if name is None:
        return default if default is not None else torch.optim.Adam
    return {
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    }[name]


def _from_file(args: argparse.Namespace) -> dict[str, Any]:
    import inspect

    from .fake import fake_mode

    module = load_model_file(Path(args.model))
    batch = args.batch_size or getattr(module, "batch_size", None)
    make_inputs = module.example_inputs
    takes_batch = bool(inspect.signature(make_inputs).parameters)
    if takes_batch and batch is None:
        batch = 32
    if takes_batch:
        example = make_inputs
    else:
        with fake_mode():  # a template of shapes and types: no memory for the example batch
            example = make_inputs()
    kwargs: dict[str, Any] = {
        "model": module.build_model,
        "example_inputs": example,
        "batch_size": batch,
        "optimizer": _optimizer(args.optimizer, getattr(module, "optimizer", None)),
        "loss_fn": getattr(module, "loss_fn", None),
        "targets": getattr(module, "targets", None),
    }
    return kwargs


def _from_torchvision(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import torchvision
    except ImportError as err:
        raise ValueError(
            f"the model name {args.model!r} needs torchvision (pip install torchvision); or give a "
            "Python file that defines build_model() and example_inputs()"
        ) from err
    import torch
    import torch.nn.functional as F

    names = torchvision.models.list_models()
    if args.model not in names:
        raise ValueError(f"{args.model!r} is neither a file nor a torchvision model (e.g. {', '.join(names[:5])}, ...)")
    batch = args.batch_size or 32
    size = args.image_size
    return {
        "model": lambda: torchvision.models.get_model(args.model, weights=None),
        "example_inputs": lambda b: torch.empty(b, 3, size, size),
        "batch_size": batch,
        "optimizer": _optimizer(args.optimizer, None),
        "loss_fn": lambda output, labels: F.cross_entropy(output, labels),
        "targets": lambda b: torch.empty(b, dtype=torch.long),
    }


def run(args: argparse.Namespace, fail: Callable[[str], int]) -> int:
    """Run the ``estimate`` command; returns the exit status (``fail(message)`` for bad input)."""
    if args.batch_size is not None and args.batch_size < 1:
        return fail(f"--batch-size must be at least 1, got {args.batch_size}")
    if not 0 <= args.margin < 1:
        return fail(f"--margin must be at least 0 and less than 1, got {args.margin}")
    if args.world_size is not None and args.world_size < 1:
        return fail(f"--world-size must be at least 1, got {args.world_size}")
    if args.parallel is not None and args.world_size is None:
        return fail("--parallel needs --world-size (the number of ranks)")
    from .api import OPTIMIZATIONS, estimate_memory
    from .parallel import what_ifs
    from .step import EstimateUnsupported

    try:
        compare = dict(OPTIMIZATIONS) if args.compare else {}
        if args.what_if:
            compare.update(what_ifs(args.what_if))
        if args.model.endswith(".py") or Path(args.model).is_file():
            kwargs = _from_file(args)
        else:
            kwargs = _from_torchvision(args)
        estimate = estimate_memory(
            **kwargs,
            device=args.device,
            autocast=args.autocast,
            checkpointing=args.checkpointing,
            compare=compare or None,
            parallel=args.parallel,
            world_size=args.world_size,
            accumulation_steps=args.accumulation_steps,
            max_grad_norm=args.max_grad_norm,
            set_to_none=not args.keep_grads,
            grad_scaler=args.grad_scaler,
            random_draws="seeded" if args.seeded_draws else "largest",
        )
    except (ValueError, TypeError, EstimateUnsupported) as err:
        return fail(str(err))
    print(estimate.format(args.units))
    if args.memory is not None:
        unit = args.units
        from ..units import format_amount

        memory = format_amount(args.memory, unit, digits=3)
        if estimate.fit is None:
            verdict = "fits" if estimate.fits(args.memory) else "does not fit"
            print(f"\nOn a device of {memory}: the step {verdict}.")
        else:
            try:
                search = estimate.batch_search(args.memory, margin=args.margin, process=args.process)
            except ValueError as err:
                return fail(str(err))
            where = f"Largest batch on a device of {memory}: {search.batch_size} ("
            if estimate.parallel is not None:
                total = search.batch_size * estimate.world_size
                where = f"Largest batch per rank on a device of {memory}: {search.batch_size} ({total} across the {estimate.world_size} ranks; "
            left = f"; {format_amount(search.bound, unit, digits=3)} left free for the stated ±" if search.bound else ""
            if estimate.fallback_bounds:
                left += "; cuDNN's convolution workspaces give way where they do not fit (cuDNN runs another plan), their ± not left free"
            if search.layout:
                left += f"; {format_amount(search.layout, unit, digits=3)} for where the device's blocks may lie otherwise"
            if search.process != "fresh":
                left += "; a warmed process's workspaces" if search.process == "warmed" else "; fits a fresh and a warmed process"
            print(
                f"\n{where}margin {100 * args.margin:g}%; {format_amount(estimate.outside, unit, digits=3)} allowed outside PyTorch{left}; "
                f"verified with {len(search.tried)} fake steps, the line alone said {search.line})"
            )
            if search.peak_moves:
                print(f"The peak moves with the batch: {search.peak_moves}")
    return 0
