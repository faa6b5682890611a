"""The command line: ``pytorch-mem-profiler`` (or ``python -m pytorch_mem_profiler``).

Subcommands, over the CSV files the profiler writes (RUN is a file; a folder
or nothing means the newest ``memory_stats_*.csv`` in it or in ``--dir``):

- ``summary [RUN]``: peaks and times per epoch, the largest layers;
- ``plot [RUN] -o FILE.png``: memory over iterations by category;
- ``report [RUN] -o FILE.html``: one self-contained HTML file;
- ``compare RUN_A RUN_B ... [--names ...] [--csv FILE]``: the comparison tables (peak and
  time; each category), and a note where the runs differ in model or device.

Bad input (a missing file, a CSV the profiler did not write, a plot without
matplotlib) gets one line on standard error and exit status 2.

``estimate MODEL [--batch-size N] [--memory 80GB] ...`` (a training step's memory
before running it) is :mod:`pytorch_mem_profiler.estimate.cli`, loaded by name; it
imports torch only when it runs.

Example::

    >>> main(["compare", "no/such/run.csv"])  # stderr: ...error: 'no/such/run.csv': no such file
    2
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Sequence

from ..units import UNITS
from .runs import Run, RunFileError, find_run, load_run

__all__ = ["main", "build_parser", "PROGRAM"]

#: The console script's name.
PROGRAM = "pytorch-mem-profiler"

#: Exit status for bad input, as argparse uses for a bad command line.
EXIT_BAD_INPUT = 2


class _BadInput(Exception):
    """Input that ends the command with one line on stderr and status 2."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command line."""
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description="Look at the CSV files pytorch_mem_profiler wrote: summaries, plots, "
        "HTML reports and comparisons of runs.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    def run_arguments(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "run",
            nargs="?",
            metavar="RUN",
            help="a run's CSV file, or a folder; default: the newest memory_stats_*.csv in --dir",
        )
        sub.add_argument(
            "--dir",
            default="memory_csv_data",
            help="the folder searched when RUN is omitted (default: %(default)s)",
        )

    def unit_argument(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--units", choices=list(UNITS), help="the unit of the figures (default: the file's)"
        )

    summary = commands.add_parser(
        "summary", help="peaks, headroom and times per epoch, what the peak holds, the largest layers"
    )
    run_arguments(summary)
    unit_argument(summary)
    summary.add_argument(
        "--top", type=_positive, default=5, help="layers per category (default: 5)"
    )

    plot = commands.add_parser(
        "plot", help="memory over iterations by category (and the peak's breakdown), as a PNG"
    )
    run_arguments(plot)
    unit_argument(plot)
    plot.add_argument("-o", "--output", help="the PNG file (default: RUN's name with .png, here)")
    plot.add_argument("--width", type=_positive, default=1200, help="pixels (default: 1200)")
    plot.add_argument("--height", type=_positive, default=600, help="pixels (default: 600)")
    plot.add_argument("--dpi", type=_positive, default=100, help="dots per inch (default: 100)")

    report = commands.add_parser(
        "report", help="one self-contained HTML file: charts, tables, settings"
    )
    run_arguments(report)
    unit_argument(report)
    report.add_argument(
        "-o", "--output", help="the HTML file (default: RUN's name with .html, here)"
    )

    compare = commands.add_parser(
        "compare", help="peak memory, time per iteration and categories of runs, against the first"
    )
    compare.add_argument(
        "runs", nargs="+", metavar="RUN", help="runs' CSV files; the first is the reference"
    )
    compare.add_argument(
        "--names",
        nargs="+",
        metavar="NAME",
        help="a name per run (default: the runs' folders where the files have the profiler's "
        "dated names and the folders tell them apart, else the file names)",
    )
    compare.add_argument("--csv", metavar="FILE", help="also write the table to this CSV file")
    unit_argument(compare)

    estimate = commands.add_parser("estimate", help="a training step's memory and the largest batch, before running it")
    _estimate_cli().add_arguments(estimate)
    return parser


def _estimate_cli():  # type: ignore[no-untyped-def]
    # By name, not an import statement: the one place the command line reaches the
    # estimate layer; that module imports torch only when its command runs.
    return importlib.import_module("pytorch_mem_profiler.estimate.cli")


def _load(run: str | None, folder: str) -> Run:
    loaded = load_run(find_run(run, folder))
    for warning in loaded.warnings:
        print(f"{PROGRAM}: warning: {warning}", file=sys.stderr)
    return loaded


def _output(given: str | None, run: Run, suffix: str) -> Path:
    path = Path(given) if given else Path(run.name + suffix)
    if path.parent != Path("") and not path.parent.is_dir():
        raise _BadInput(f"cannot write {str(path)!r}: no folder {str(path.parent)!r}")
    return path


def _summary(args: argparse.Namespace) -> None:
    from .summary import format_summary

    run = _load(args.run, args.dir)
    print(format_summary(run, args.units, top=args.top))


def _plot(args: argparse.Namespace) -> None:
    from .plot import plot_memory

    run = _load(args.run, args.dir)
    path = _output(args.output, run, ".png")
    plot_memory(run, path, unit=args.units, width=args.width, height=args.height, dpi=args.dpi)
    print(f"wrote {path} ({args.width}x{args.height} pixels)")


def _report(args: argparse.Namespace) -> None:
    from .html_report import write_html

    run = _load(args.run, args.dir)
    path = _output(args.output, run, ".html")
    write_html(run, path, args.units)
    print(f"wrote {path}")


def _compare(args: argparse.Namespace) -> None:
    from .compare import (
        comparison_notes,
        compare_runs,
        default_names,
        format_categories_markdown,
        format_markdown,
        write_comparison_csv,
    )

    if args.names is not None and len(args.names) != len(args.runs):
        raise _BadInput(f"--names gives {len(args.names)} name(s) for {len(args.runs)} run(s)")
    runs = [_load(path, ".") for path in args.runs]
    unit = args.units or runs[0].unit
    names, source = (args.names, "") if args.names is not None else default_names(runs)
    rows = compare_runs(runs, names)
    print(format_markdown(rows, unit))
    categories = format_categories_markdown(rows, unit)
    if categories:
        print()
        print(categories)
    print()
    from .compare import MIN_TIMED_ITERATIONS, NOISE_FLOOR

    print(
        f"Peak memory: the largest peak_allocated of each run ({unit} = {UNITS[unit]:,} bytes); "
        "time per iteration: the median of iteration_time_s over the run's records, with its "
        "interquartile range (IQR) and the iterations timed; a time change is given only where "
        f"the IQRs do not overlap and the medians differ by {NOISE_FLOOR:.0%} or more (else \"within noise\") "
        f"and each run timed {MIN_TIMED_ITERATIONS} "
        "or more (the CSV has a row per reported iteration: print_period=1 times them all)."
    )
    if categories:
        explained = "Categories: each at its largest over the run's records"
        if any(key.startswith("peak_") for row in rows for key in row.categories):
            explained += (
                "; \"at the peak\": what was alive at the run's highest iteration peak "
                "(peak_<category>)"
            )
        print(explained + "; in brackets, the change against the first run.")
    if source:
        print(f"Runs named by their {source}; --names gives others.")
    for note in comparison_notes(rows, unit):
        print(f"Note: {note}.")
    if args.csv:
        write_comparison_csv(rows, args.csv, unit)
        print(f"wrote {args.csv}")


def _estimate(args: argparse.Namespace) -> int:
    return _estimate_cli().run(args, _fail)


_COMMANDS = {"summary": _summary, "plot": _plot, "report": _report, "compare": _compare, "estimate": _estimate}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for bad input).

    Args:
        argv: the arguments without the program name; default ``sys.argv[1:]``.
    """
    args = build_parser().parse_args(argv)
    try:
        status = _COMMANDS[args.command](args)
    except (RunFileError, _BadInput) as err:
        return _fail(str(err))
    except ImportError as err:  # an optional dependency (matplotlib) is missing
        return _fail(str(err))
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        return 0
    except OSError as err:  # the output cannot be written (reading errors are RunFileError)
        where = f" {str(err.filename)!r}" if err.filename else ""
        return _fail(f"cannot write{where}: {err.strerror or err}")
    return status or 0


def _fail(message: str) -> int:
    print(f"{PROGRAM}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT
