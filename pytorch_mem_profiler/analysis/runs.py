"""Read back a run's CSV files: the one place the command line, plots and reports load them.

A run is the CSV file one profiler wrote (``memory_stats_<date>-<time>.csv``)
and, when present, its per-layer companion ``<run>_layers.csv`` in long format
(``epoch, iteration, step, module, category, calls, bytes``). :func:`load_run` turns them
into a :class:`Run` whose figures are all in bytes, under the names of
:class:`~pytorch_mem_profiler.stats.IterationRecord`'s fields, whatever unit
the file was written in.

Parameter columns are found by the file's fixed columns, not by position: a
parameter ``p`` is a column that is none of the fixed ones, comes before
``total_layer_weight_gradient_usage`` and has a partner column ``p_grad``.
Columns a later version adds are carried along and ignored.

Files from versions that record the device's size and the peak's breakdown
have ``device_total`` (an amount), ``peak_share`` (a fraction of the device,
read as it is) and one ``peak_<category>`` amount per
:data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES` (:data:`PEAK_COLUMNS`);
older files lack them, and the records then hold ``NaN`` there.

Example::

    >>> import io, tempfile, torch
    >>> from pytorch_mem_profiler import memory_profiler
    >>> model = torch.nn.Linear(4, 2)
    >>> folder = tempfile.mkdtemp()
    >>> with memory_profiler(model, 1, True, csv_dir=folder, stream=io.StringIO()) as profiler:
    ...     model(torch.randn(3, 4)).sum().backward()
    ...     _ = profiler.record_stats()
    >>> run = load_run(profiler.csv_path)
    >>> run.parameters
    ['weight', 'bias']
    >>> int(run.weights.iloc[-1]["weight"])    # bytes: 4 * 2 float32
    32
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..outputs.export import EXTRA_COLUMNS, NON_AMOUNT_COLUMNS, record_columns
from ..stats import PEAK_CATEGORIES
from ..units import UNITS

__all__ = [
    "Run",
    "RunFileError",
    "load_run",
    "newest_run",
    "find_run",
    "layers_path",
    "module_of",
    "RUN_GLOB",
    "MODEL",
    "PEAK_COLUMNS",
]

#: The names of the profiler's run files in a CSV folder.
RUN_GLOB = "memory_stats_*.csv"

#: How the model itself is named where a module name is expected (its name is empty).
MODEL = "(model)"

#: The suffix of a run's per-layer companion file.
_LAYERS_SUFFIX = "_layers.csv"

#: CSV column -> record field, for the columns whose names differ.
_RENAMED = {
    "total_feature_map_usage": "feature_maps",
    "total_weight_usage": "weights",
    "total_layer_weight_gradient_usage": "gradients",
}

#: The CSV column of each peak category (:data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES`):
#: bytes alive at the iteration's peak, summing to ``iteration_peak_allocated``.
PEAK_COLUMNS = {category: f"peak_{category}" for category in PEAK_CATEGORIES}

#: Plain numbers: counts, seconds, and the peak as a fraction (0 to 1) of the device.
_NUMBERS = (
    "forward_passes",
    "backward_passes",
    "optimizer_steps",
    "iteration_time_s",
    "step",
    "peak_share",
)

#: Figures in the file's unit, by record field name; converted to bytes on reading.
#: Named here as well as taken from the writer's list, so that files with the device's
#: size and the peak's breakdown are read right whichever version wrote them.
_AMOUNTS = tuple(
    dict.fromkeys(
        (
            "peak_cached",
            "current_cached",
            "feature_maps",
            "weights",
            "gradients",
            "intermediate_gradients",
            *(c for c in EXTRA_COLUMNS if c not in NON_AMOUNT_COLUMNS and c not in _NUMBERS),
            "device_total",
            *PEAK_COLUMNS.values(),
        )
    )
)

#: Without these a file is not one the profiler wrote.
_REQUIRED = (
    "epoch",
    "iteration",
    "unit",
    "total_weight_usage",
    "total_layer_weight_gradient_usage",
    "allocated",
    "peak_allocated",
)

_FIXED = frozenset(record_columns([]))


class RunFileError(ValueError):
    """A run file that is missing, unreadable, or not one the profiler wrote.

    The message is one line that names the file and says what is wrong.
    """


@dataclass(frozen=True)
class Run:
    """One profiled run, read back from its CSV files; every figure in bytes.

    Attributes:
        path: the run's CSV file.
        unit: the unit the file was written in (the default for showing it).
        records: one row per reported iteration, columns named like
            :class:`~pytorch_mem_profiler.stats.IterationRecord`'s fields
            (``epoch``, ``iteration``, ``step``, ``allocated``, ``weights``,
            ``feature_maps``...). Amounts are bytes (float, ``NaN`` where the
            device did not know), ``iteration_time_s`` seconds. ``device_total``
            (bytes), ``peak_share`` (0 to 1) and the :data:`PEAK_COLUMNS` are
            ``NaN`` where the file does not have them.
        weights: bytes per parameter (columns) per reported iteration (rows).
        gradients: gradient bytes per parameter, same shape as ``weights``.
        layers: the per-layer file in long format (``epoch, iteration,
            module, category, calls, bytes``; the model's own forward is the
            module ``"(model)"``), or ``None`` when the run has none.
        warnings: problems that did not stop the reading, one line each
            (e.g. a per-layer file that could not be used).
    """

    path: Path
    unit: str
    records: pd.DataFrame
    weights: pd.DataFrame
    gradients: pd.DataFrame
    layers: pd.DataFrame | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        """The file's name without ``.csv``."""
        return self.path.stem

    @property
    def parameters(self) -> list[str]:
        """The parameter names, in the file's order."""
        return list(self.weights.columns)

    @property
    def device(self) -> str:
        """The device the run was profiled on (``"unknown"`` if the file does not say)."""
        if "device" not in self.records:
            return "unknown"
        known = self.records["device"].dropna()
        return str(known.iloc[-1]) if len(known) else "unknown"

    @property
    def device_total(self) -> float | None:
        """Bytes of memory the device has, as the last record that knew it said; ``None``
        where the file does not say (older files, the CPU)."""
        known = self.records["device_total"].dropna()
        known = known[known > 0]
        return float(known.iloc[-1]) if len(known) else None

    @property
    def has_peak_breakdown(self) -> bool:
        """Whether any record says what was alive at its peak (the ``peak_<category>`` columns)."""
        return bool(self.records[list(PEAK_COLUMNS.values())].notna().any().any())

    @property
    def epochs(self) -> list[int]:
        """The epochs that have at least one reported iteration, in order."""
        return sorted(int(e) for e in self.records["epoch"].unique())


def module_of(parameter: str) -> str:
    """The module a parameter belongs to: ``"encoder.0.weight"`` -> ``"encoder.0"``.

    Parameters of the model itself (no dot) belong to ``"(model)"``.
    """
    module, _, _ = parameter.rpartition(".")
    return module or MODEL


def layers_path(path: str | os.PathLike) -> Path:
    """Where a run's per-layer companion file lives: ``<run>_layers.csv`` beside it."""
    path = Path(path)
    return path.with_name(path.stem + _LAYERS_SUFFIX)


def newest_run(folder: str | os.PathLike) -> Path:
    """The run file in ``folder`` written most recently (``memory_stats_*.csv``).

    Raises:
        RunFileError: the folder is missing or holds no run file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise RunFileError(
            f"no folder {str(folder)!r}: name a run's CSV file, or the folder with --dir"
        )
    candidates = [
        p for p in folder.glob(RUN_GLOB) if p.is_file() and not p.name.endswith(_LAYERS_SUFFIX)
    ]
    if not candidates:
        raise RunFileError(f"no {RUN_GLOB} file in {str(folder)!r}: name a run's CSV file")
    # The file appended to last is the run written most recently; the name breaks ties.
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name))


def find_run(run: str | os.PathLike | None, folder: str | os.PathLike) -> Path:
    """The file a user means: ``run`` itself, the newest in ``run`` if it is a folder,
    or the newest in ``folder`` when ``run`` is ``None``."""
    if run is None:
        return newest_run(folder)
    path = Path(run)
    if path.is_dir():
        return newest_run(path)
    return path


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise RunFileError(f"{str(path)!r}: no such file")
    if not path.is_file():
        raise RunFileError(f"{str(path)!r} is not a file")
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise RunFileError(f"{str(path)!r} is empty, not a pytorch_mem_profiler CSV") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunFileError(f"{str(path)!r} is not a pytorch_mem_profiler CSV: {detail}") from None
    except OSError as err:
        raise RunFileError(f"{str(path)!r} cannot be read: {err.strerror or err}") from None


def _numeric(frame: pd.DataFrame, columns: list[str], path: Path) -> pd.DataFrame:
    out = {}
    for column in columns:
        try:
            out[column] = pd.to_numeric(frame[column], errors="raise").astype(float)
        except (ValueError, TypeError):
            raise RunFileError(
                f"{str(path)!r} is not a pytorch_mem_profiler CSV: column {column!r} "
                "holds something that is not a number"
            ) from None
    return pd.DataFrame(out, index=frame.index, columns=columns)


def _unit(frame: pd.DataFrame, path: Path) -> str:
    units = [str(u) for u in frame["unit"].dropna().unique()]
    if len(units) != 1:
        found = ", ".join(units) if units else "none"
        raise RunFileError(f"{str(path)!r}: expected one unit in column 'unit', found {found}")
    if units[0] not in UNITS:
        raise RunFileError(f"{str(path)!r}: unknown unit {units[0]!r} (known: {', '.join(UNITS)})")
    return units[0]


def _parameters(columns: list[str]) -> list[str]:
    end = columns.index("total_layer_weight_gradient_usage")
    present = set(columns)
    return [c for c in columns[:end] if c not in _FIXED and f"{c}_grad" in present]


def _to_bytes(values: pd.DataFrame, unit: str) -> pd.DataFrame:
    # The file holds bytes / unit as decimal text; rounding gives the bytes back exactly.
    return (values * UNITS[unit]).round()


def load_run(path: str | os.PathLike) -> Run:
    """Read a run's CSV file (and its ``_layers.csv`` companion, if any).

    Args:
        path: a CSV file the profiler wrote.

    Returns:
        The :class:`Run`, every figure in bytes.

    Raises:
        RunFileError: the file is missing, unreadable, not the profiler's, or has no rows.

    Example::

        >>> load_run("no/such/run.csv")
        Traceback (most recent call last):
        ...
        pytorch_mem_profiler.analysis.runs.RunFileError: 'no/such/run.csv': no such file
    """
    path = Path(path)
    frame = _read_csv(path)
    columns = [str(c) for c in frame.columns]
    missing = [c for c in _REQUIRED if c not in columns]
    if missing:
        raise RunFileError(
            f"{str(path)!r} is not a pytorch_mem_profiler CSV: missing column(s) {', '.join(missing)}"
        )
    if frame.empty:
        raise RunFileError(
            f"{str(path)!r} has no records yet (rows are written at epoch_end(), close() "
            "and every 1000 reported iterations)"
        )
    unit = _unit(frame, path)
    frame = frame.rename(columns=_RENAMED)

    counters = _numeric(frame, ["epoch", "iteration"], path)
    if counters.isna().any().any():
        raise RunFileError(f"{str(path)!r} has a row without its epoch or iteration")
    numbers = _numeric(frame, [c for c in _NUMBERS if c in frame], path)
    amounts = _to_bytes(_numeric(frame, [c for c in _AMOUNTS if c in frame], path), unit)
    records = pd.concat([counters.astype(int), amounts, numbers], axis=1)
    for absent in [c for c in _AMOUNTS + _NUMBERS if c not in records]:
        records[absent] = float("nan")
    if records["step"].isna().all():
        records["step"] = range(1, len(records) + 1)
    for text in ("device", "peak_phase", "peak_location"):
        records[text] = frame[text] if text in frame else None

    parameters = _parameters(columns)
    weights = _to_bytes(_numeric(frame, parameters, path), unit)
    grads = _to_bytes(_numeric(frame, [f"{p}_grad" for p in parameters], path), unit)
    grads.columns = parameters

    layers, warnings = _load_layers(layers_path(path))
    return Run(path, unit, records, weights, grads, layers, tuple(warnings))


def _load_layers(path: Path) -> tuple[pd.DataFrame | None, list[str]]:
    """The per-layer file, or ``None`` when there is none; a bad one becomes a warning."""
    if not path.is_file():
        return None, []
    try:
        frame = _read_csv(path)
    except RunFileError as err:
        return None, [f"per-layer file ignored: {err}"]
    keys = ["epoch", "iteration", "module", "category"]
    missing = [c for c in keys if c not in frame]
    if missing:
        return None, [
            f"per-layer file {str(path)!r} ignored: missing column(s) {', '.join(missing)}"
        ]
    if "bytes" in frame:
        amounts = pd.to_numeric(frame["bytes"], errors="coerce")
    else:
        # A file in the run's unit: one figure column, and a unit column naming the unit.
        figures = [c for c in frame.columns if c not in keys + ["unit", "step", "device", "calls"]]
        file_unit = (
            str(frame["unit"].dropna().iloc[0])
            if "unit" in frame and frame["unit"].notna().any()
            else None
        )
        if len(figures) != 1 or file_unit not in UNITS:
            return None, [f"per-layer file {str(path)!r} ignored: no 'bytes' column"]
        amounts = (pd.to_numeric(frame[figures[0]], errors="coerce") * UNITS[file_unit]).round()
    if amounts.isna().all() and len(amounts):
        return None, [f"per-layer file {str(path)!r} ignored: its sizes are not numbers"]
    layers = pd.DataFrame(
        {
            "epoch": pd.to_numeric(frame["epoch"], errors="coerce"),
            "iteration": pd.to_numeric(frame["iteration"], errors="coerce"),
            # the model's own forward is the module with the empty name, read back as NaN
            "module": frame["module"].fillna("").astype(str).replace("", MODEL),
            "category": frame["category"].fillna("").astype(str),
            "calls": pd.to_numeric(frame["calls"], errors="coerce")
            if "calls" in frame
            else float("nan"),
            "bytes": amounts.astype(float),
        }
    ).dropna(subset=["epoch", "iteration", "bytes"])
    layers[["epoch", "iteration"]] = layers[["epoch", "iteration"]].astype(int)
    return layers.reset_index(drop=True), []
