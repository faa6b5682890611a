"""One iteration's memory figures, in bytes: the record every output is made from, and its vocabulary.

``MemoryProfiler.record_stats()`` returns an :class:`IterationRecord`; the
printed report and the CSV row are views of that same record. A figure the
device cannot know (MPS keeps no peak) is ``None``, shown as "n/a".

One name per concept, in code, docs and report text:

- *feature maps*: the tensors forward keeps for backward (``saved_tensors_hooks``
  sees them); by layer, the per-layer figures;
- *intermediate gradients*: gradients with respect to the feature maps, and
  backward's temporaries;
- *reserved*: what the caching allocator holds from the device, *allocated* what
  tensors use of it (torch's words: ``memory_reserved``, ``memory_allocated``; the
  seed's "cached" is its older name for reserved).

Names that are stored keep their spelling, as the CSV keeps the seed's columns: the
seed's ``peak_cached`` and ``current_cached`` (reserved), its full report's "Peak
cached" and "Current cached" lines, and the keys whose CSV columns the files have
always had: the peak categories ``activations`` (feature maps alive at the peak,
column ``peak_activations``) and ``activation_gradients`` (intermediate gradients,
``peak_activation_gradients``), and the per-layer file's category
:data:`ACTIVATIONS` (feature maps).

Example::

    >>> rec = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0)
    >>> rec.weights, rec.feature_maps
    (0, 0)
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = [
    "PhaseStats",
    "LayerFeatureMaps",
    "IterationRecord",
    "PHASES",
    "PHASE_LABELS",
    "CATEGORIES",
    "MODEL_STATE",
    "PEAK_CATEGORIES",
    "PEAK_CATEGORY_LABELS",
    "BYTE_FIGURES",
    "INPUT",
    "ACTIVATIONS",
    "WEIGHT_COPIES",
    "diff_records",
    "records_like",
    "DETAIL_LEVELS",
    "flat_metrics",
    "PLAIN_METRICS",
]

#: The phases of an iteration, in order. "other" is everything between them:
#: data loading, the loss, gradient clipping, ``zero_grad()``.
PHASES = ("forward", "backward", "optimizer", "other")

#: How the phases are named for people.
PHASE_LABELS: Mapping[str, str] = MappingProxyType(
    {"forward": "forward", "backward": "backward", "optimizer": "optimizer step", "other": "between phases (outside forward, backward and the step: the loss, data, zero_grad)"}
)

#: The record's memory categories (its byte fields), each with the name people know it by.
CATEGORIES: Mapping[str, str] = MappingProxyType(
    {
        "weights": "weights",
        "gradients": "weight gradients",
        "optimizer_state": "optimizer state",
        "feature_maps": "feature maps",
        "intermediate_gradients": "intermediate gradients",
        "buffers": "buffers",
        "ddp_gradient_buckets": "DDP gradient buckets",
        "fsdp_gathered_parameters": "FSDP gathered parameters",
    }
)

#: What is alive at an iteration's peak, by category (:attr:`IterationRecord.peak_breakdown`):
#: the values sum to the iteration's peak. ``activations`` are the feature maps (tensors saved
#: for backward) still alive; ``activation_gradients`` the intermediate gradients (gradients
#: with respect to the feature maps, and backward's temporaries); ``inputs`` the batch;
#: ``other`` the rest (the loss, outputs, what a kernel holds between two module boundaries).
#: Each key is its CSV column's name less ``peak_`` (see the module's text).
PEAK_CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_state",
    "activations",
    "activation_gradients",
    "inputs",
    "other",
)

#: How the peak categories are named for people.
PEAK_CATEGORY_LABELS: Mapping[str, str] = MappingProxyType(
    {
        "weights": "weights",
        "gradients": "weight gradients",
        "optimizer_state": "optimizer state",
        "activations": "feature maps (saved for backward)",
        "activation_gradients": "intermediate gradients",
        "inputs": "input batch",
        "other": "other",
    }
)

#: The categories that belong to the model and its optimizer rather than to one iteration.
MODEL_STATE = ("weights", "gradients", "optimizer_state", "buffers")

#: The levels of detail a record is measured at, from the cheapest: ``"light"`` (one allocator
#: read), ``"phases"`` (phase peaks, feature maps, gradients, intermediate gradients and the
#: peak's make-up), ``"full"`` (and the per-layer figures, with ``by_layer=True``). See
#: :mod:`pytorch_mem_profiler.measure.budget`.
DETAIL_LEVELS = ("light", "phases", "full")

#: The module name under which the model's inputs are counted in per-layer figures.
INPUT = "(input)"
#: Per-layer categories of saved memory (the per-layer file's codes): feature maps, and
#: autocast's copies of weights.
ACTIVATIONS = "activations"
WEIGHT_COPIES = "weight copies"


def _empty() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class PhaseStats:
    """Allocated bytes at the end of a phase and the peak reached inside it.

    With gradient accumulation a phase occurs several times in an iteration:
    ``allocated_at_end`` is that of its last occurrence, ``peak_allocated``
    the largest of all.
    """

    allocated_at_end: int | None
    peak_allocated: int | None
    occurrences: int = 1


@dataclass(frozen=True)
class LayerFeatureMaps:
    """What one forward saved for backward, by the module that saved it, in bytes.

    ``by_module`` maps ``(module name, category)`` to bytes; categories are
    :data:`ACTIVATIONS` (feature maps) and ``"weight copies"`` (autocast's casts of weights);
    the model's inputs are under the module name ``"(input)"``. ``total`` is
    what modules saved (inputs not included); ``unattributed`` what the
    allocator shows kept by forward beyond that (outputs, temporaries still
    referenced, what checkpointed blocks keep).
    """

    by_module: Mapping[tuple[str, str], int]
    calls: Mapping[str, int]
    total: int
    inputs: int
    unattributed: int


def _fields_set_at_once(cls: type) -> type:
    """Give the frozen dataclass ``cls`` an ``__init__`` with its dataclass signature (the same
    parameters, defaults and ``TypeError`` for a name it has not) that sets the instance's
    fields in one step.

    The dataclass's own sets its fields one ``object.__setattr__`` at a time: with a record's
    39 fields, about 5 us, made at every ``record_stats()`` (a non-reported iteration costs
    about 20 us in all); this one about 2. A field whose default is made by a factory (an
    empty read-only mapping) shares one such default.
    """
    params, defaults = [], {}
    for f in fields(cls):
        if f.default is not MISSING or f.default_factory is not MISSING:
            default = f.default if f.default is not MISSING else f.default_factory()
            defaults[f"_default_{f.name}"] = default
            params.append(f"{f.name}=_default_{f.name}")
        else:
            params.append(f.name)
    values = ", ".join(f"{f.name!r}: {f.name}" for f in fields(cls))
    namespace: dict[str, Any] = {"_set": object.__setattr__, **defaults}
    exec(f"def __init__(self, {', '.join(params)}):\n    _set(self, '__dict__', {{{values}}})\n", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[misc]
    return cls


@_fields_set_at_once
@dataclass(frozen=True)
class IterationRecord:
    """The memory figures of one training iteration, all in bytes.

    Attributes:
        epoch: epoch number, from 1.
        iteration: iteration within the epoch, from 1.
        step: iterations recorded since the profiler started, from 1.
        device: the profiled device, e.g. ``"cuda:0"``.
        allocated: bytes allocated to tensors when ``record_stats()`` ran.
        peak_allocated: most bytes allocated since the profiler started.
        iteration_peak_allocated: most bytes allocated during this iteration.
        peak_phase: the phase in which this iteration's peak was reached.
        peak_cached: most bytes the caching allocator reserved since the profiler started.
        current_cached: bytes the caching allocator reserves now.
        feature_maps: allocated when forward ended minus when it started (the
            largest forward of the iteration).
        intermediate_gradients: the ``activation_gradients`` part of what was alive at
            backward's peak (gradients with respect to the feature maps and backward's
            temporaries; see :attr:`peak_breakdown`), at the ``"phases"`` and ``"full"``
            levels (:attr:`detail`); ``None`` where it was not measured.
        weights: bytes of the model's parameters (unique storages).
        weights_by_name: bytes per parameter name.
        gradients: bytes of the parameters' ``.grad`` when backward ended.
        gradients_by_name: bytes per parameter name (parameters with a gradient).
        optimizer_state: bytes of the tensors in the ``state`` of every optimizer known to
            step the model (given with ``optimizer=``, or seen stepping its parameters);
            ``None`` while none is known.
        buffers: bytes of the model's registered buffers.
        forward_passes: forwards of the model (with grad enabled) in this iteration.
        backward_passes: backwards through the model in this iteration.
        optimizer_steps: optimizer steps over the model's parameters in this iteration.
            The three counts are ``None`` on an iteration that is not reported
            when nothing watched it (the hooks are off between reported iterations).
        iteration_time_s: host wall time since the previous ``record_stats()``.
        phases: :class:`PhaseStats` by phase name (see :data:`PHASES`).
        peak_location: the module running when this iteration's peak was reached
            (per-layer mode only; ``""`` is the model's own code outside its tracked modules;
            ``None`` where unknown, as after a fault switched the per-layer attribution off).
        layers: feature maps by layer (per-layer mode, reported iterations only; ``None``
            from the iteration in which a fault switched the per-layer attribution off).
        device_used: bytes in use on the whole device (NVML, or ``mem_get_info``).
        process_used: bytes this process uses on the device (NVML, where it can tell).
        outside_pytorch: device used minus the allocator's reserved bytes: the CUDA
            context, library workspaces, other processes.
        device_total: bytes of memory the device has in all (``None`` where torch cannot
            tell, and on the CPU).
        peak_breakdown: bytes alive at this iteration's peak by category (keys
            :data:`PEAK_CATEGORIES`, summing to ``iteration_peak_allocated``), at the
            ``"phases"`` and ``"full"`` levels; ``None`` where it was not measured.
        peak_layers: per-layer mode: bytes of each module's feature maps still
            alive at the peak, by module name (``None`` where the module names are unknown).
        peak_transient: bytes of the peak that were made and freed between two
            boundaries the profiler read (CUDA and other allocators: module and phase
            boundaries), counted in ``peak_breakdown`` as
            ``activation_gradients`` in backward and ``other`` elsewhere; ``None`` where every
            byte was seen by identity (the CPU) or no breakdown was measured.
        peak_transient_in: the module (``""``: the model's own code) or the phase
            that transient ran in (``None`` for a module whose name is unknown).
        peak_other_before: the part of ``peak_breakdown["other"]`` that was alive before
            the iteration began: not this model's weights, gradients or optimizer state
            (a frozen reference model, an EMA copy, a cached dataset, tensors kept from
            earlier iterations). Exact on the CPU; on allocators read at boundaries, the
            least ``other`` seen since the iteration began (exact while that memory stays).
            The rest of ``other`` is what the iteration made. ``None`` where no breakdown
            was measured.
        peak_step_temporaries: the part of ``peak_breakdown["other"]`` that the optimizer
            step allocated and held at the peak (above what was allocated at its start,
            less the optimizer state it made): its temporaries. 0 when the peak is not in
            the step; ``None`` where no breakdown was measured.
        model_name: the model's class name (the root module, whose own forward's saved
            feature maps are under the module name ``""``); ``None`` where unknown.
        ddp_gradient_buckets: bytes of DDP's gradient buckets held apart from the
            gradients (0 with ``gradient_as_bucket_view=True``); ``None`` without DDP.
        fsdp_gathered_parameters: most bytes of FSDP2's gathered (unsharded)
            parameters alive at once in this iteration; ``None`` without FSDP2 and
            on iterations that are not reported.
        rank: the global rank under ``torch.distributed``; ``None`` in a single process.
        reported: whether the iteration was one to report (every ``print_period``-th).
            The others are measured by one read of the allocator at ``record_stats()``:
            they carry allocated, the peaks, cached, the pass counts, weights, buffers
            and optimizer state, and ``None`` for ``feature_maps``, ``gradients``,
            ``intermediate_gradients`` and ``peak_phase`` (``phases`` empty).
        detail: the level of detail the iteration was measured at (:data:`DETAIL_LEVELS`):
            ``"light"`` for one that is not reported, and for a reported one the cost budget
            could not afford more for; a figure the level does not measure is ``None``.
        overhead_budget: the cost budget (a share of the run's time) the level was chosen
            under; ``None``: no limit.
    """

    epoch: int
    iteration: int
    step: int
    device: str
    allocated: int
    peak_allocated: int | None = None
    iteration_peak_allocated: int | None = None
    peak_phase: str | None = None
    peak_cached: int | None = None
    current_cached: int | None = None
    feature_maps: int | None = 0
    intermediate_gradients: int | None = 0
    weights: int = 0
    weights_by_name: Mapping[str, int] = field(default_factory=_empty)
    gradients: int | None = 0
    gradients_by_name: Mapping[str, int] = field(default_factory=_empty)
    optimizer_state: int | None = 0
    buffers: int = 0
    forward_passes: int | None = 0
    backward_passes: int | None = 0
    optimizer_steps: int | None = 0
    iteration_time_s: float | None = None
    phases: Mapping[str, PhaseStats] = field(default_factory=_empty)
    peak_location: str | None = None
    layers: LayerFeatureMaps | None = None
    device_used: int | None = None
    process_used: int | None = None
    outside_pytorch: int | None = None
    device_total: int | None = None
    peak_breakdown: Mapping[str, int] | None = None
    peak_layers: Mapping[str, int] | None = None
    peak_transient: int | None = None
    peak_transient_in: str | None = None
    peak_other_before: int | None = None
    peak_step_temporaries: int | None = None
    model_name: str | None = None
    ddp_gradient_buckets: int | None = None
    fsdp_gathered_parameters: int | None = None
    rank: int | None = None
    reported: bool = True
    detail: str = "full"
    overhead_budget: float | None = None

    @property
    def model_state(self) -> int:
        """Weights, gradients, optimizer state (where known) and buffers together."""
        return self.weights + (self.gradients or 0) + (self.optimizer_state or 0) + self.buffers

    @property
    def peak_share(self) -> float | None:
        """This iteration's peak as a share (0 to 1) of the device's memory; ``None`` if unknown."""
        if self.iteration_peak_allocated is None or not self.device_total:
            return None
        return self.iteration_peak_allocated / self.device_total

    @property
    def fragmentation(self) -> int | None:
        """Bytes the allocator holds but no tensor uses: reserved minus allocated."""
        if self.current_cached is None:
            return None
        return self.current_cached - self.allocated


def records_like(template: IterationRecord, varying: tuple[str, ...]) -> Callable[..., IterationRecord]:
    """A maker of records equal to ``template`` but for the fields named in ``varying``: ``make(*values)``
    (the values in ``varying``'s order, or by name) is ``dataclasses.replace(template, ...)`` with them.

    For the records made at every ``record_stats()`` (an iteration at the ``"light"`` level),
    where most fields repeat from one to the next: the template's fields are copied at once and
    only ``varying`` set, without the constructor's matching of some forty names (about a
    quarter of its time). A name in ``varying`` that is not a field is a ``TypeError`` when the
    maker is made, as a misspelt field is at the constructor.

    Example::

        >>> import dataclasses
        >>> base = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0, weights=64)
        >>> make = records_like(base, ("iteration", "step", "allocated"))
        >>> make(2, 2, 100) == dataclasses.replace(base, iteration=2, step=2, allocated=100)
        True
        >>> records_like(base, ("alocated",))
        Traceback (most recent call last):
        ...
        TypeError: records_like: IterationRecord has no field 'alocated'
    """
    names = {f.name for f in fields(IterationRecord)}
    for name in varying:
        if name not in names:
            raise TypeError(f"records_like: IterationRecord has no field {name!r}")
    if len(set(varying)) != len(varying):
        raise TypeError(f"records_like: a field named twice in {varying!r}")
    # Only field names (checked above) reach the code made here.
    sets = "".join(f"    fields[{name!r}] = {name}\n" for name in varying)
    source = (
        f"def make({', '.join(varying)}):\n    fields = _copy()\n{sets}"
        "    record = _new(_cls)\n    _set(record, '__dict__', fields)\n    return record\n"
    )
    namespace: dict[str, Any] = {
        "_copy": dict(vars(template)).copy,
        "_new": object.__new__,
        "_set": object.__setattr__,
        "_cls": IterationRecord,
    }
    exec(source, namespace)
    make = namespace["make"]
    make.__qualname__ = make.__name__ = "make_record_like"
    make.__module__ = __name__
    return make


#: The record's figures in bytes (``None`` where the device does not know one).
BYTE_FIGURES = (
    "allocated",
    "peak_allocated",
    "iteration_peak_allocated",
    "peak_cached",
    "current_cached",
    "feature_maps",
    "intermediate_gradients",
    *MODEL_STATE,
    "outside_pytorch",
)


def diff_records(first: IterationRecord, last: IterationRecord) -> dict[str, int]:
    """Bytes each figure changed by from ``first`` to ``last`` (figures unknown in either left out).

    Example::

        >>> a = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=100)
        >>> b = IterationRecord(epoch=1, iteration=9, step=9, device="cpu", allocated=900)
        >>> diff_records(a, b)["allocated"]
        800
    """
    changes = {}
    for name in BYTE_FIGURES:
        a, b = getattr(first, name), getattr(last, name)
        if a is not None and b is not None:
            changes[name] = b - a
    return changes


#: The figures of :func:`flat_metrics` that are not amounts of bytes: positions, counts,
#: seconds, text, and the peak's share of the device (0 to 1).
PLAIN_METRICS = frozenset(
    {
        "epoch",
        "iteration",
        "step",
        "device",
        "peak_phase",
        "peak_location",
        "forward_passes",
        "backward_passes",
        "optimizer_steps",
        "iteration_time_s",
        "rank",
        "peak_share",
    }
)

#: The phases whose end and peak :func:`flat_metrics` carries (``<phase>_end_allocated``,
#: ``<phase>_peak_allocated``).
_FLAT_PHASES = ("forward", "backward", "optimizer")


def flat_metrics(record: IterationRecord) -> dict[str, Any]:
    """The record as one flat mapping, ``name -> value``: the view the CSV row, TensorBoard's
    scalars and the frameworks' loggers are all made from, each taking the figures it shows
    and converting the amounts to its unit.

    Amounts (every name not in :data:`PLAIN_METRICS`) are in bytes; a figure not known is
    ``None``. The names are the record's fields, then ``fragmentation`` and ``peak_share``,
    ``<phase>_end_allocated`` and ``<phase>_peak_allocated`` for forward, backward and the
    optimizer, ``layers_total_feature_maps``, ``layers_input`` and ``layers_unattributed``
    (per-layer mode) and ``peak_<category>`` for each of :data:`PEAK_CATEGORIES`: the CSV
    file's column names (its first columns, of the original tool, excepted).

    Example::

        >>> rec = IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=3_000,
        ...                       current_cached=4_096, peak_breakdown={"weights": 1_000})
        >>> flat = flat_metrics(rec)
        >>> flat["allocated"], flat["fragmentation"], flat["peak_weights"], flat["peak_inputs"]
        (3000, 1096, 1000, None)
    """
    phases = record.phases
    layers = record.layers
    breakdown = record.peak_breakdown
    flat: dict[str, Any] = {
        "epoch": record.epoch,
        "iteration": record.iteration,
        "peak_cached": record.peak_cached,
        "current_cached": record.current_cached,
        "feature_maps": record.feature_maps,
        "weights": record.weights,
        "gradients": record.gradients,
        "intermediate_gradients": record.intermediate_gradients,
        "allocated": record.allocated,
        "peak_allocated": record.peak_allocated,
        "iteration_peak_allocated": record.iteration_peak_allocated,
        "optimizer_state": record.optimizer_state,
        "buffers": record.buffers,
    }
    for phase in _FLAT_PHASES:
        stats = phases.get(phase)
        flat[f"{phase}_end_allocated"] = stats.allocated_at_end if stats else None
        flat[f"{phase}_peak_allocated"] = stats.peak_allocated if stats else None
    flat.update(
        peak_phase=record.peak_phase,
        forward_passes=record.forward_passes,
        backward_passes=record.backward_passes,
        optimizer_steps=record.optimizer_steps,
        iteration_time_s=record.iteration_time_s,
        step=record.step,
        device=record.device,
        peak_location=record.peak_location,
        device_used=record.device_used,
        process_used=record.process_used,
        outside_pytorch=record.outside_pytorch,
        fragmentation=record.fragmentation,
        layers_total_feature_maps=layers.total if layers else None,
        layers_input=layers.inputs if layers else None,
        layers_unattributed=layers.unattributed if layers else None,
        ddp_gradient_buckets=record.ddp_gradient_buckets,
        fsdp_gathered_parameters=record.fsdp_gathered_parameters,
        rank=record.rank,
        device_total=record.device_total,
        peak_share=record.peak_share,
    )
    for category in PEAK_CATEGORIES:
        flat[f"peak_{category}"] = breakdown.get(category) if breakdown is not None else None
    return flat
