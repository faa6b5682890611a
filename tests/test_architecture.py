"""The package's layering, checked on its source: device calls stay in measure/, the analysis
needs no torch, subpackages import only downwards."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pytorch_mem_profiler"

#: Attribute chains that reach a device's memory API.
DEVICE_APIS = (
    "torch.cuda",
    "torch.xpu",
    "torch.mps",
    "torch.accelerator",
    "torch.backends.mps",
    "torch._C._cuda",
    "pynvml",
)

#: Pure-Python renderers that live under torch.cuda but read files, not devices.
RENDERERS = ("torch.cuda._memory_viz",)

#: What each subpackage may import from the package (top-level modules are always allowed).
ALLOWED = {
    "measure": {"measure"},
    "outputs": {"outputs"},
    "tools": {"tools", "measure"},
    "analysis": {"analysis", "outputs"},
    "integrations": {"integrations"},
    "estimate": {"estimate", "measure"},
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _device_calls(path: Path) -> list[str]:
    """Device-API attribute chains used in the module's code (docstrings are not code)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            # getattr(torch._C, "_cuda_...") and getattr(torch.cuda, ...)
            if node.args:
                target = _dotted(node.args[0]) or ""
                attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
                name = f"{target}.{attr}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] if node.level == 0 else []
            else:
                names = [a.name for a in node.names]
            name = next((n for n in names if n.startswith(DEVICE_APIS)), None)
        if name and name.startswith(DEVICE_APIS) and not name.startswith(RENDERERS):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return found


def test_only_measure_calls_device_memory_apis():
    outside = [p for p in _modules() if p.parent.name != "measure"]
    offenders = [hit for p in outside for hit in _device_calls(p)]
    assert offenders == []
    # and the check does find them where they are
    assert _device_calls(PACKAGE / "measure" / "devices.py")


def _relative_imports(path: Path) -> list[tuple[int, str]]:
    """``(level, dotted module)`` of each relative import of ``path``."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.level, node.module or ""))
    return out


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackages_import_only_what_they_may(subpackage):
    folder = PACKAGE / subpackage
    if not folder.is_dir():
        pytest.skip(f"no {subpackage}/ yet")
    bad = []
    for path in folder.glob("*.py"):
        for level, module in _relative_imports(path):
            if level == 1:
                continue  # a sibling
            first = module.split(".")[0]
            if first and (PACKAGE / first).is_dir() and first not in ALLOWED[subpackage]:
                bad.append(f"{path.name}: from {'.' * level}{module}")
            if first == "profiler" and subpackage != "integrations":  # only integrations drive the profiler
                bad.append(f"{path.name}: from {'.' * level}{module}")
    assert bad == []


def test_every_subpackage_says_what_it_is_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, init


def test_analysis_imports_no_torch():
    for path in (PACKAGE / "analysis").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert (node.module or "").split(".")[0] != "torch", path


def test_command_line_summary_starts_without_torch(tmp_path):
    """``pytorch-mem-profiler summary`` on a run file imports pandas, never torch."""
    run = tmp_path / "memory_stats_20260101-000000.csv"
    run.write_text(
        "epoch,iteration,peak_cached,current_cached,total_feature_map_usage,total_weight_usage,"
        "fc.weight,total_layer_weight_gradient_usage,fc.weight_grad,intermediate_gradients,"
        "allocated,peak_allocated,iteration_peak_allocated,iteration_time_s,step,device,unit\n"
        "1,1,2,2,1,1,1,1,1,0,2,2,2,0.01,1,cpu,MB\n"
    )
    code = (
        "import sys\n"
        "from pytorch_mem_profiler.analysis.cli import main\n"
        f"status = main(['summary', {str(run)!r}])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "NO TORCH 0"
    assert "Peak allocated" in done.stdout


def test_import_of_the_package_loads_nothing_heavy():
    code = "import sys, pytorch_mem_profiler; print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stderr
