"""Write the overhead run's figures into the README and docs/benchmarks.md, from ``overhead.csv``.

    python benchmarks/publish_overhead.py path/to/overhead.csv      # rewrites both blocks in place
    python benchmarks/publish_overhead.py overhead.csv --print      # shows them, writes nothing

The README's block lies between ``<!-- results: headline figures ... -->`` and
``<!-- /results -->``; the docs' between ``<!-- overhead results -->`` and
``<!-- /overhead results -->``. Every cell comes from the ``ratio`` column of
``overhead.csv`` (the other CSV files of a run, whose rows name the same
configurations, are refused: taking their byte columns for ratios is what
put "0" and "1048576" in the README's table once).

Example::

    >>> rows = [{"workload": "tiny_mlp", "tool": "profiler, print_period=1", "status": "ok",
    ...          "ratio": "1.0412", "ratios": "1.0300 1.0412 1.0500", "goal": "1.05",
    ...          "device": "Device: H200; torch 2.11; 2026-11-22"}]
    >>> print(readme_table(rows).splitlines()[2])
    | this profiler, `print_period=1` | 1.041x |
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("workload", "tool", "status", "ratio", "ratios", "goal", "device")
WORKLOADS = {"gpt2": "GPT-2", "resnet50": "ResNet-50", "neumf": "NeuMF", "tiny_mlp": "tiny MLP"}
#: overhead.py's tool names and how the README names them, in the README's order.
TOOLS = {
    "profiler, print_period=1": "this profiler, `print_period=1`",
    "profiler, print_period=10": "this profiler, `print_period=10`",
    "profiler by_layer, print_period=1": "this profiler, `by_layer=True`, `print_period=1`",
    "profiler by_layer, print_period=10": "this profiler, `by_layer=True`, `print_period=10`",
    "torch.profiler(profile_memory, record_shapes)": "`torch.profiler(profile_memory=True, record_shapes=True)`",
    '_record_memory_history, stacks="python"': '`_record_memory_history(stacks="python")`',
    '_record_memory_history, stacks="all"': '`_record_memory_history(stacks="all")`',
    "MemTracker": "`MemTracker` (one step)",
    "MemReporter(model).report() each step": "pytorch_memlab `MemReporter.report()` each step",
}
README_START, README_END = "<!-- results: headline figures", "<!-- /results -->"
DOCS_START, DOCS_END = "<!-- overhead results -->", "<!-- /overhead results -->"


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of an ``overhead.csv``; ``ValueError`` for any other file."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not overhead.py's overhead.csv: no column {', '.join(missing)}")
        return list(reader)


def _ratio(row: dict[str, str]) -> float | None:
    return float(row["ratio"]) if row.get("status") == "ok" and row.get("ratio") else None


def _spread(row: dict[str, str]) -> str:
    ratios = [float(x) for x in row.get("ratios", "").split()]
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else ""


def _verdict(row: dict[str, str]) -> str:
    ratio, goal = _ratio(row), row.get("goal")
    if ratio is None or not goal:
        return ""
    return f"goal {float(goal):.2f}x: {'met' if round(ratio, 2) <= float(goal) else '**missed**'}"


def readme_table(rows: list[dict[str, str]]) -> str:
    """Tools x workloads, each cell the median ratio ("n/a" where the tool could not run)."""
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    cells = {(r["tool"], r["workload"]): r for r in rows}
    lines = ["| Tool | " + " | ".join(WORKLOADS[w] for w in workloads) + " |", "| --- |" + " --- |" * len(workloads)]
    for tool, label in TOOLS.items():
        if not any((tool, w) in cells for w in workloads):
            continue
        values = []
        for w in workloads:
            row = cells.get((tool, w))
            ratio = _ratio(row) if row is not None else None
            values.append("" if row is None else (f"{ratio:.3f}x" if ratio is not None else "n/a"))
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def goals_line(rows: list[dict[str, str]]) -> str:
    judged = [r for r in rows if r.get("goal") and _ratio(r) is not None]
    missed = [f"{WORKLOADS.get(r['workload'], r['workload'])} {r['tool']} {_ratio(r):.3f}x > {float(r['goal']):.2f}x" for r in judged if "missed" in _verdict(r)]
    text = f"Goals: {len(judged) - len(missed)} of {len(judged)} met"
    return text + (f"; missed: {'; '.join(missed)}." if missed else ".")


def readme_block(rows: list[dict[str, str]]) -> str:
    device = rows[0]["device"].removeprefix("Device: ") if rows else "(no rows)"
    return "\n".join(
        [
            f"Measured on {device}: step time with the tool over step time without it, median of",
            "interleaved rounds in one process (method, spreads and goals in [docs/benchmarks.md](docs/benchmarks.md)):",
            "",
            readme_table(rows),
            "",
            goals_line(rows),
        ]
    )


def docs_block(rows: list[dict[str, str]]) -> str:
    device = rows[0]["device"].removeprefix("Device: ") if rows else "(no rows)"
    ours = [r for r in rows if r["tool"] in list(TOOLS)[:4]]
    labels = list(TOOLS)[:4]
    by_workload: dict[str, dict[str, str]] = {}
    for r in ours:
        ratio = _ratio(r)
        text = r["status"] if ratio is None else f"{ratio:.3f}x ({_spread(r)})"
        if _verdict(r):
            text += f", {_verdict(r)}"
        by_workload.setdefault(r["workload"], {})[r["tool"]] = text
    head = "| Workload | print_period=1 | print_period=10 | by_layer, 1 | by_layer, 10 |\n| --- | --- | --- | --- | --- |"
    body = [f"| {w} | " + " | ".join(c.get(t, "") for t in labels) + " |" for w, c in by_workload.items()]
    full = ["| Workload | Tool | Ratio | Spread | Goal |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = _ratio(r)
        full.append(
            f"| {r['workload']} | {r['tool']} | {r['status'] if ratio is None else f'{ratio:.3f}x'} | {_spread(r)} | {_verdict(r)} |"
        )
    return "\n".join(
        [
            f"{device}. Median ratio over the rounds (lowest-highest round):",
            "",
            head,
            *body,
            "",
            goals_line(rows),
            "",
            *full,
        ]
    )


def replace_block(text: str, start: str, end: str, body: str) -> str:
    """``text`` with the lines between the line starting with ``start`` and the line ``end`` replaced."""
    lines = text.split("\n")
    try:
        first = next(i for i, line in enumerate(lines) if line.startswith(start))
        last = next(i for i in range(first + 1, len(lines)) if lines[i].strip() == end)
    except StopIteration:
        raise ValueError(f"no block {start!r} ... {end!r} found") from None
    return "\n".join([*lines[: first + 1], body, *lines[last:]])


def publish(csv_path: Path, readme: Path = ROOT / "README.md", docs: Path = ROOT / "docs" / "benchmarks.md") -> None:
    rows = read_rows(csv_path)
    readme.write_text(replace_block(readme.read_text(), README_START, README_END, readme_block(rows)))
    docs.write_text(replace_block(docs.read_text(), DOCS_START, DOCS_END, docs_block(rows)))


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="overhead.csv of a run of benchmarks/overhead.py")
    parser.add_argument("--print", action="store_true", help="print the two blocks instead of writing them")
    args = parser.parse_args(argv)
    if args.print:
        rows = read_rows(args.csv)
        print(readme_block(rows), docs_block(rows), sep="\n\n")
        return None
    publish(args.csv)
    print(f"updated {ROOT / 'README.md'} and {ROOT / 'docs' / 'benchmarks.md'} from {args.csv}", file=sys.stderr)
    return None


if __name__ == "__main__":
    main()
