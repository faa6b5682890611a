"""The package's layering, checked on its source: device calls stay in measure/, the analysis
needs no torch, every module (top-level ones included) imports only downwards."""

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

#: Each top-level module's and subpackage's layer (ARCHITECTURE.md's diagram, from the bottom):
#: a module imports only from a lower layer or from its own subpackage.
LAYERS = {
    "units": 0,  # bytes to text
    "stats": 0,  # the record and the vocabulary
    "faults": 0,  # the fault guard
    "torch_versions": 0,  # what the installed torch offers, where releases differ
    "grouping": 1,  # repeated layers' names (formats with units)
    "measure": 2,  # the only device reads
    "estimate": 3,
    "distributed": 3,  # rank identity, the cross-rank exchange
    "paths": 4,  # output folders and file names (with the rank)
    "outputs": 5,
    "options": 6,
    "analysis": 7,
    "tools": 7,
    "profiler": 8,  # wiring
    "integrations": 9,
    "__init__": 10,  # the package's public names, loaded on first use
    "__main__": 10,
}

#: Names kept importable where they were before they moved up a layer: ``(module, layer it
#: reaches)``. Loaded by the module's ``__getattr__`` only when asked for, with a
#: DeprecationWarning; nothing else of the module depends on them.
MOVED_NAMES = {("distributed", "outputs")}

#: What each subpackage may import from the other subpackages, beyond the layers' rule.
ALLOWED = {
    "measure": {"measure"},
    "distributed": {"distributed", "measure"},
    "outputs": {"outputs", "distributed"},
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


def _unit(path: Path) -> str:
    """The top-level module or subpackage ``path`` belongs to (``"__init__"``: the package's own)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_units(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, unit)`` of each import of the package in ``path``, and whether it runs in the
    module-level ``__getattr__`` (a moved name kept importable). ``from .. import __version__``
    is left out: the package's version is set before any of its modules loads."""
    tree = ast.parse(path.read_text())
    here = list(path.relative_to(PACKAGE).parent.parts)
    lazy = {
        id(node)
        for top in tree.body
        if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
        for node in ast.walk(top)
    }
    found = []
    for node in ast.walk(tree):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            module = node.module.split(".") if node.module else []
            if module:
                targets.append(base + module)
            else:  # from . import x: x is a module of base, or a name of base's __init__
                for alias in node.names:
                    if alias.name == "__version__" and not base:
                        continue
                    candidate = PACKAGE.joinpath(*base, alias.name)
                    exists = candidate.is_dir() or candidate.with_suffix(".py").exists()
                    targets.append(base + [alias.name] if exists else base)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE.name:
            targets.append(node.module.split(".")[1:])
        elif isinstance(node, ast.Import):
            targets += [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == PACKAGE.name]
        for parts in targets:
            found.append((node.lineno, parts[0] if parts else "__init__", id(node) in lazy))
    return found


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackages_import_only_what_they_may(subpackage):
    folder = PACKAGE / subpackage
    if not folder.is_dir():
        pytest.skip(f"no {subpackage}/ yet")
    bad = []
    for path in folder.glob("*.py"):
        for line, target, lazy in _imported_units(path):
            if lazy and (subpackage, target) in MOVED_NAMES:
                continue
            if (PACKAGE / target).is_dir() and target not in ALLOWED[subpackage]:
                bad.append(f"{path.name}:{line}: {target}")
            if target == "profiler" and subpackage != "integrations":  # only integrations drive the profiler
                bad.append(f"{path.name}:{line}: {target}")
    assert bad == []


def test_every_module_has_a_layer():
    units = {_unit(p) for p in _modules()}
    assert units - set(LAYERS) == set(), "give each new top-level module or subpackage a layer"
    assert set(LAYERS) - units == set(), "a layer for a module that is gone"


def test_every_import_points_downwards():
    """Top-level modules as well as subpackages: nothing imports from its own layer or above,
    but its own subpackage (and the moved names of :data:`MOVED_NAMES`, loaded lazily)."""
    bad, moved = [], set()
    for path in _modules():
        unit = _unit(path)
        for line, target, lazy in _imported_units(path):
            if target == unit or LAYERS[target] < LAYERS[unit]:
                continue
            if lazy and (unit, target) in MOVED_NAMES:
                moved.add((unit, target))
                continue
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {unit} (layer {LAYERS[unit]}) imports "
                       f"{target} (layer {LAYERS[target]})")
    assert bad == []
    assert moved == MOVED_NAMES  # each moved name still imports from where it was


def test_moved_names_still_import_where_they_were():
    import warnings

    from pytorch_mem_profiler.outputs.rank_table import format_cross_rank

    import pytorch_mem_profiler.distributed as package

    vars(package).pop("format_cross_rank", None)  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from pytorch_mem_profiler.distributed import format_cross_rank as old
    assert old is format_cross_rank
    moved = [w for w in caught if "format_cross_rank moved to" in str(w.message)]
    assert [w.category for w in moved] == [DeprecationWarning]
    assert "outputs.rank_table" in str(moved[0].message)
    import pytorch_mem_profiler

    assert pytorch_mem_profiler.format_cross_rank is format_cross_rank


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The check reads what it must: a bottom module that imports the profiler, relatively
    and absolutely, and one from a subpackage that reaches the package's own names."""
    fake = tmp_path / PACKAGE.name
    (fake / "measure").mkdir(parents=True)
    (fake / "stats.py").write_text("from .profiler import MemoryProfiler\n")
    (fake / "units.py").write_text("import pytorch_mem_profiler.outputs.report\n")
    (fake / "measure" / "x.py").write_text("from .. import stats, __version__\nfrom .. import MemoryProfiler\n")
    (fake / "profiler.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _imported_units(fake / "stats.py") == [(1, "profiler", False)]
    assert _imported_units(fake / "units.py") == [(1, "outputs", False)]
    assert _imported_units(fake / "measure" / "x.py") == [(1, "stats", False), (2, "__init__", False)]


def test_objects_are_made_by_their_constructors():
    """No instance made without its constructor (``object.__new__``), and no fields set through
    ``object.__setattr__`` but an object's own (a frozen dataclass's ``__post_init__``)."""
    bad = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            first = node.args[0] if node.args else None
            if name == "object.__new__" or (
                name == "object.__setattr__" and not (isinstance(first, ast.Name) and first.id == "self")
            ):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
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


# -- measure/: readers, the hook set, the phase machine, observers, the meter's plan -------------------

MEASURE = PACKAGE / "measure"

#: The readers: the only modules of measure/ that call a device's memory API. They know nothing of
#: iterations (no plan, no phase, no observer), so they hold no per-iteration state.
READERS = {"devices", "allocator", "outside", "kernel_scratch", "cudnn_sizes"}
#: What makes an iteration's events: the hook set (torch's hooks) and the phase machine.
EVENT_SOURCES = {"hooks", "entries", "phases"}
#: The observers of an iteration (each a subclass of ``observers.Observer``).
OBSERVERS = {"intervals", "peak_breakdown", "layers", "data_parallel"}
#: Modules with no torch in them: the phase machine, its events and the plan.
TORCHLESS = {"phases", "observers", "plan"}


def _measure_imports(path: Path) -> set[str]:
    """The modules of measure/ that ``path`` imports (relatively, or by the package's name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith(f"{PACKAGE.name}.measure."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(f"{PACKAGE.name}.measure."):
                    found.add(alias.name.split(".")[2])
    return found


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_only_the_readers_call_device_memory_apis():
    callers = {p.stem for p in MEASURE.glob("*.py") if _device_calls(p)}
    assert callers <= READERS, callers - READERS


def test_readers_know_nothing_of_iterations():
    """The readers import no plan, phase machine, hook set, observer or meter, and handle no event."""
    from pytorch_mem_profiler.measure.observers import EVENTS

    stateful = EVENT_SOURCES | OBSERVERS | {"plan", "observers", "meter"}
    for name in READERS:
        path = MEASURE / f"{name}.py"
        assert _measure_imports(path) & stateful == set(), name
        methods = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert methods & {*EVENTS, "begin_iteration", "finish_iteration"} == set(), name


def test_the_phase_machine_the_events_and_the_plan_have_no_torch():
    for name in TORCHLESS:
        path = MEASURE / f"{name}.py"
        assert not _imports_torch(path), name
        assert _measure_imports(path) <= TORCHLESS | {"faults"}, name


def test_observers_import_no_event_source_and_no_meter():
    """Events reach observers as calls: an observer imports neither the hook set, nor the phase
    machine, nor the meter that wires them; and every one is an ``Observer``."""
    from pytorch_mem_profiler.measure import data_parallel, intervals, layers, peak_breakdown
    from pytorch_mem_profiler.measure.observers import Observer

    for name in OBSERVERS:
        assert _measure_imports(MEASURE / f"{name}.py") & (EVENT_SOURCES | {"meter"}) == set(), name
    for cls in (intervals.PhaseIntervals, peak_breakdown.PeakBreakdown, layers.LayerAttribution,
                data_parallel.FsdpGatherTracker):  # fmt: skip
        assert issubclass(cls, Observer), cls


def test_the_hook_set_imports_no_observer():
    """The hook set installs, removes, sleeps and wakes hooks; what they see goes to the machine."""
    for name in ("hooks", "entries"):
        assert _measure_imports(MEASURE / f"{name}.py") & (OBSERVERS | {"meter", "plan"}) == set(), name


def _own_fields(tree: ast.Module) -> set[str]:
    """Every field the classes of a module declare (class-level names, ``__slots__``) or set on
    ``self``: what code of that module may set on objects it holds."""
    fields: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields.add(item.target.id)
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name):
                        fields.add(target.id)
                        if target.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                            fields.update(e.value for e in item.value.elts if isinstance(e, ast.Constant))
        for node in ast.walk(cls):
            for target in _assigned(node):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    fields.add(target.attr)
    return fields


def _assigned(node: ast.AST) -> list[ast.expr]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    flat: list[ast.expr] = []
    for target in targets:
        flat.extend(target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])
    return flat


def _foreign_field_sets(path: Path) -> list[str]:
    """Assignments in ``path`` to a field of an object that is not one of the module's own classes:
    ``hooks.reported = ...``, ``self._fsdp.active = ...``. Patching torch (``torch.X.y = ...``) is
    not a measure object's field."""
    tree = ast.parse(path.read_text())
    fields = _own_fields(tree)
    found = []
    for node in ast.walk(tree):
        for target in _assigned(node):
            if not isinstance(target, ast.Attribute):
                continue
            base = target.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                continue
            if target.attr not in fields:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_measure_object_sets_another_ones_fields():
    """The meter tells the hook set, the machine and the observers what to do through a plan or a
    method call: nothing in measure/ sets a field of an object of another module."""
    offenders = [hit for path in sorted(MEASURE.glob("*.py")) for hit in _foreign_field_sets(path)]
    assert offenders == []


def test_the_field_check_finds_a_foreign_field(tmp_path):
    module = tmp_path / "meter.py"
    module.write_text(
        "class Meter:\n"
        "    def __init__(self, hooks):\n"
        "        self._hooks = hooks\n"
        "        self._alive = _Alive()\n"
        "    def prepare(self):\n"
        "        self._hooks.reported = True\n"
        "        self._alive.static = {}\n"
        "        hooks = self._hooks\n"
        "        hooks.breakdown, hooks.detailed = None, False\n"
        "class _Alive:\n"
        "    static = None\n"
    )
    assert _foreign_field_sets(module) == [
        "meter.py:6: self._hooks.reported",
        "meter.py:9: hooks.breakdown",
        "meter.py:9: hooks.detailed",
    ]


def test_the_machine_hands_every_event_to_the_observers_that_handle_it():
    """Each event of ``observers.EVENTS`` has its tuple of listeners in the machine's routes (a new
    event without one would never be delivered), holding exactly the observers that override it."""
    from pytorch_mem_profiler.measure.observers import EVENTS, Observer
    from pytorch_mem_profiler.measure.phases import PhaseMachine
    from pytorch_mem_profiler.measure.plan import IterationPlan

    class Everything(Observer):
        pass

    for event in EVENTS:
        setattr(Everything, event, lambda self, *args: None)
    everything, nothing = Everything(), Observer()
    machine = PhaseMachine(lambda: None, object, lambda: False)
    machine.begin_iteration(IterationPlan.make("phases", (everything, nothing)))
    for event in EVENTS:
        assert [o for o, _ in getattr(machine._routes, event)] == [everything], event


#: The classes with state over the limit below, and their counts: none now (a class listed here could
#: only shrink). Records (dataclasses whose fields are the table's figures) are not counted.
STATE_LIMIT = 20
OVER_THE_LIMIT: dict[str, int] = {}


def _state_fields(cls: ast.ClassDef) -> set[str]:
    """The fields a class's methods set on ``self`` (its state; a record's class-level fields are not)."""
    return {
        target.attr
        for node in ast.walk(cls)
        for target in _assigned(node)
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def _classes_over(limit: int, root: Path = PACKAGE) -> dict[str, int]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            count = len(_state_fields(cls))
            if count > limit:
                found[f"{path.relative_to(root).as_posix()}:{cls.name}"] = count
    return found


def test_no_class_grows_past_twenty_fields_of_state():
    """No new class holds more than twenty fields of state, and those that do hold no more than now."""
    found = _classes_over(STATE_LIMIT)
    grown = {name: n for name, n in found.items() if n > OVER_THE_LIMIT.get(name, STATE_LIMIT)}
    assert grown == {}, f"over {STATE_LIMIT} fields of state (or more than before): {grown}"


def test_the_state_count_finds_fields_set_in_any_method(tmp_path):
    (tmp_path / "big.py").write_text(
        "class Big:\n"
        "    limit: int = 3\n"
        "    def __init__(self):\n"
        "        self.a, self.b = 1, 2\n"
        "    def later(self):\n"
        "        self.c: int = 3\n"
        "        self.a += 1\n"
        "        other.d = 4\n"
    )
    assert _classes_over(2, tmp_path) == {"big.py:Big": 3}
