"""The estimate of a training step's memory, its fit over batch sizes, and the largest batch that fits.

A :class:`MemoryEstimate` holds bytes only; its ``str()`` is the report, amounts
through :func:`~pytorch_mem_profiler.units.format_amount`. Each phase's peak is
fitted as ``fixed + per_sample * batch`` from two batch sizes (weights, gradients
and optimizer state are in ``fixed``; activations and the batch in
``per_sample``); the step's peak at a batch size is the largest phase line there.

Example::

    >>> fit = BatchFit({"forward": (1000.0, 100.0), "optimizer": (3000.0, 0.0)}, (1, 2), 3, 0.0)
    >>> fit.peak_at(10), fit.peak_at(40), fit.largest_batch(5000)
    (3000, 5000, 40)
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..stats import ACTIVATIONS, INPUT, PEAK_CATEGORIES, PEAK_CATEGORY_LABELS, PHASE_LABELS, LayerFeatureMaps
from ..units import UNITS, format_amount
from .allocator import LAYOUT_ALLOWANCE, PROCESSES, StepEvents

__all__ = [
    "BatchFit",
    "BatchSearch",
    "MemoryEstimate",
    "LINEARITY_TOLERANCE",
    "largest_fitting",
    "largest_verified",
    "REPEATED_BLOCKS",
    "CHOSEN_BY_FUNCTION",
    "checkpointing_text",
    "acted_on",
    "unchanged_reason",
    "error_bound_of",
]

#: The largest relative error of the linear fit at the third batch size that
#: :meth:`MemoryEstimate.max_batch_size` accepts without a warning.
LINEARITY_TOLERANCE = 0.01

_WIDTH = 46

#: The parallel parts' names in the report (as :data:`~.parallel.PARALLEL_ROLES`, without importing torch here).
_PARALLEL_LABELS = {
    "ddp_buckets": "DDP gradient buckets",
    "regrown": "FSDP gathered parameters",
    "device_mesh": "device mesh",
    "comm_buffers": "communication buffers",
}


def _line(label: str, value: str, width: int = _WIDTH) -> str:
    return f"{label}{'.' * max(2, width - len(label) - len(value))}{value}"


@dataclass(frozen=True)
class BatchFit:
    """Each phase's peak as ``fixed + per_sample * batch_size``, in bytes.

    Attributes:
        phases: ``(fixed, per_sample)`` by phase.
        batch_sizes: the two batch sizes fitted.
        checked_at: the third batch size the fit was checked at (``None``: not checked).
        error: the fit's relative error at ``checked_at`` (0.01 is 1%).
        peak_phases: the phase holding the step's peak at each batch size estimated
            (the two fitted and the check); more than one phase means the peak moves
            to another moment as the batch grows (see :attr:`peak_moves`).
    """

    phases: Mapping[str, tuple[float, float]]
    batch_sizes: tuple[int, int]
    checked_at: int | None
    error: float | None
    peak_phases: Mapping[int, str] = field(default_factory=dict)

    @property
    def peak_moves(self) -> str | None:
        """Where the peak moves between the batch sizes estimated (``None``: it stays in one phase).

        Example::

            >>> BatchFit({}, (1, 2), 3, 0.0, {1: "optimizer", 2: "optimizer", 3: "backward"}).peak_moves
            'optimizer at batch 1, 2; backward at batch 3'
        """
        if len(set(self.peak_phases.values())) < 2:
            return None
        runs: list[tuple[str, list[int]]] = []
        for batch in sorted(self.peak_phases):
            phase = self.peak_phases[batch]
            if runs and runs[-1][0] == phase:
                runs[-1][1].append(batch)
            else:
                runs.append((phase, [batch]))
        return "; ".join(f"{phase} at batch {', '.join(map(str, batches))}" for phase, batches in runs)

    def peak_at(self, batch_size: int) -> int:
        """The step's peak predicted at ``batch_size``: the largest phase line there."""
        return int(round(max(fixed + slope * batch_size for fixed, slope in self.phases.values())))

    @property
    def per_sample(self) -> float:
        """Bytes one more sample adds to the largest phase's slope."""
        return max(slope for _, slope in self.phases.values())

    def largest_batch(self, budget: float) -> int:
        """The largest batch size whose predicted peak is at most ``budget`` bytes (0: none)."""
        best = math.inf
        for fixed, slope in self.phases.values():
            if slope <= 0:
                if fixed > budget:
                    return 0
                continue
            best = min(best, math.floor((budget - fixed) / slope))
        if best == math.inf:
            raise ValueError("no phase grows with the batch size: every batch size needs the same memory")
        return max(0, int(best))


def _remembered(fits: Callable[[int], bool]) -> Callable[[int], bool]:
    """``fits``, each batch size asked once (a fake step each)."""
    cache: dict[int, bool] = {}

    def ok(batch: int) -> bool:
        if batch not in cache:
            cache[batch] = fits(batch)
        return cache[batch]

    return ok


def _bisect(ok: Callable[[int], bool], lo: int, hi: int, tolerance: float) -> int:
    """Narrow ``lo`` (fits) and ``hi`` (does not) until within ``tolerance`` of the batch (or 1)."""
    while hi - lo > max(1, int(lo * tolerance)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_fitting(fits: Callable[[int], bool], guess: int, upper: int, *, tolerance: float = 0.01) -> int:
    """The largest batch size up to ``upper`` for which ``fits(batch)`` (0: none).

    A bisection started at ``guess``, ending when the bracket is within
    ``tolerance`` of the batch (or 1): the answer fits, and a batch that much
    larger did not. ``fits`` is taken to be true up to some batch and false after.

    Example::

        >>> largest_fitting(lambda b: 100 + 7 * b <= 1000, 50, 200)
        128
    """
    ok = _remembered(fits)
    if ok(upper):
        return upper
    lo, hi = 0, upper  # lo fits (0 always does), hi does not
    guess = max(1, min(guess, upper - 1))
    if guess < hi:
        if ok(guess):
            lo = guess
        else:
            hi = guess
    return _bisect(ok, lo, hi, tolerance)


def largest_verified(fits: Callable[[int], bool], guess: int, *, tolerance: float = 0.01, most: int = 1 << 40) -> int:
    """The largest batch size for which ``fits(batch)`` (0: none), searched from ``guess``.

    The guess (a line's answer) is checked: from one that fits the search steps up,
    from one that does not it steps down, each step twice the last, until the
    answer is bracketed; then a bisection until the bracket is within ``tolerance``
    of the batch (or 1). ``fits`` is taken to be true up to some batch and false after.

    Example::

        >>> largest_verified(lambda b: 100 + 7 * b <= 1000, 50), largest_verified(lambda b: 100 + 7 * b <= 1000, 500)
        (128, 128)
    """
    ok = _remembered(fits)
    guess = max(1, min(int(guess), most))
    step = max(1, guess // 20)
    if ok(guess):
        lo, hi = guess, None
        while hi is None:
            if lo >= most:
                return most
            nxt = min(lo + step, most)
            if ok(nxt):
                lo, step = nxt, 2 * step
            else:
                hi = nxt
    else:
        lo, hi = None, guess
        while lo is None:
            nxt = hi - step
            if nxt < 1:
                lo = 0
            elif ok(nxt):
                lo = nxt
            else:
                hi, step = nxt, 2 * step
    return _bisect(ok, lo, hi, tolerance)


def check_device_memory(device_memory: object) -> None:
    """Raise ``ValueError`` naming ``device_memory`` unless it is a positive number of bytes (an ``int``).

    Example::

        >>> check_device_memory(2**30)
        >>> check_device_memory(0.5)
        Traceback (most recent call last):
        ValueError: device_memory must be a positive number of bytes, got 0.5
    """
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory <= 0:
        raise ValueError(f"device_memory must be a positive number of bytes, got {device_memory!r}")


def check_process(process: object) -> None:
    """Raise ``ValueError`` naming ``process`` unless it is one of
    :data:`~pytorch_mem_profiler.estimate.allocator.PROCESSES`.

    Example::

        >>> check_process("fresh")
        >>> check_process("cold")
        Traceback (most recent call last):
        ValueError: process must be one of 'warmed', 'fresh', 'either', got 'cold'
    """
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {', '.join(map(repr, PROCESSES))}, got {process!r}")


def error_bound_of(bounds: Mapping[str, int], transient: frozenset[str] | set[str] = frozenset()) -> int:
    """The bytes a peak may be off by, from each operation's bound (``bounds``).

    The bounds in ``transient`` are of a kernel's own buffers inside one operator
    (cuDNN's convolution and recurrent workspaces): two operators never hold theirs
    together, so the peak may be off by the largest of them, not their sum. The others
    (a kept workspace, what a compiled module keeps) are alive together, and add up.

    Example::

        >>> error_bound_of({"conv": 300, "conv backward": 500, "kept": 40}, {"conv", "conv backward"})
        540
    """
    largest = max((n for op, n in bounds.items() if op in transient), default=0)
    return largest + sum(n for op, n in bounds.items() if op not in transient)


def search_bound_of(bounds: Mapping[str, int], transient: frozenset[str] | set[str] = frozenset(),
                    fallback: frozenset[str] | set[str] = frozenset()) -> int:  # fmt: skip
    """The bytes of :func:`error_bound_of` a batch search leaves free: all but the bounds in
    ``fallback``, of workspaces that give way under a memory limit (cuDNN's convolutions).

    Example::

        >>> search_bound_of({"conv": 300, "rnn": 200, "kept": 40}, {"conv", "rnn"}, {"conv"})
        240
    """
    return error_bound_of({op: n for op, n in bounds.items() if op not in fallback}, transient)


@dataclass(frozen=True)
class BatchSearch:
    """How :meth:`MemoryEstimate.batch_search` found the largest batch; bytes.

    Attributes:
        batch_size: the answer, ``largest * (1 - margin)`` rounded down.
        largest: the largest batch that was verified to fit (fake steps at that batch).
        line: the batch the fit's lines alone predicted (before any margin).
        tried: each batch size run as a fake step, and whether it fit.
        peak_phase: the phase holding the peak at ``largest`` (``None``: not known).
        peak_moves: where the peak moves between the batch sizes estimated, as
            :attr:`BatchFit.peak_moves` says, with ``largest`` included.
        bound: the bytes left free at ``largest`` for the estimate's stated error there
            (:attr:`MemoryEstimate.search_bound` at that batch; 0: none left free).
        layout: the bytes left free besides for where the device's blocks may lie otherwise
            than the allocator replay's (:data:`~pytorch_mem_profiler.estimate.allocator.LAYOUT_ALLOWANCE`
            of the memory after ``outside``; 0 where no replay decides, off CUDA).
        process: where the replay had cuBLAS's workspaces made (``"warmed"``, ``"fresh"``,
            ``"either"``: :data:`~pytorch_mem_profiler.estimate.allocator.PROCESSES`).
    """

    batch_size: int
    largest: int
    line: int
    tried: tuple[tuple[int, bool], ...]
    peak_phase: str | None
    peak_moves: str | None
    bound: int = 0
    layout: int = 0
    process: str = "fresh"


@dataclass(frozen=True)
class MemoryEstimate:
    """What one training step would take on a device, estimated without running it; bytes.

    Attributes:
        device: the device estimated for (``"cuda"``, ``"cpu"``).
        batch_size: the batch size of the figures (``None``: unknown).
        peak: the most bytes allocated to tensors at once, as the device's
            allocator counts them (blocks of 512 bytes on CUDA: what
            ``torch.cuda.max_memory_allocated()`` reports, less ``workspace``).
        peak_phase: the phase of the peak (``forward``, ``backward``, ``optimizer``, ``other``).
        phases: the peak of each phase.
        peak_breakdown: bytes alive at the peak by category (keys
            :data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES`, summing to ``peak``;
            buffers count as weights).
        peak_layers: activations alive at the peak by the module that saved them.
        layers: what one forward saved for backward, by module (as the records' per-layer figures).
        weights: parameters; buffers: registered buffers; gradients: the weight
            gradients after backward; optimizer_state: after the optimizer's step;
            inputs: the batch.
        reserved: the most bytes the CUDA caching allocator would hold in segments
            (a replay of the step's allocations and frees through its rules, see
            :func:`~pytorch_mem_profiler.estimate.allocator.simulate_reserved`, plus
            the workspaces' own segments); ``None`` off CUDA. This, not the peak
            allocated, is what a device's memory (and
            ``torch.cuda.set_per_process_memory_fraction``) must hold.
        reserved_bound: bytes the reserved may be above :attr:`reserved` (0: none stated): the same
            replay with each kernel block whose size a library chooses per call at its rule's bound
            (cuDNN's backward filter passes, which add as many split-K partial weight gradients to the
            transforms as its heuristics pick: one a little past the block the data pass left takes a
            segment of its own, see :mod:`~pytorch_mem_profiler.estimate.conv_workspace`).
        workspace: bytes libraries take from the allocator besides tensors (cuBLAS's workspace on CUDA).
        kernel_scratch: bytes in ``peak`` (counted in ``peak_breakdown["other"]``) that a CUDA
            kernel takes for itself inside the operator running at the peak, by the rules of
            :mod:`~pytorch_mem_profiler.estimate.scratch`; 0 when the peak is not at such an operator.
        whole_blocks: bytes in ``peak`` (counted in ``peak_breakdown["other"]``) that the CUDA
            caching allocator hands out beyond the requests at the peak: a block is split only where
            more than 1 MiB would remain (512 bytes in the small pool), and
            ``torch.cuda.memory_allocated()`` counts whole blocks
            (:func:`~pytorch_mem_profiler.estimate.allocator.replay_whole_blocks`); 0 off CUDA.
        outside: the allowance for memory outside PyTorch (the CUDA context), see
            :data:`~pytorch_mem_profiler.estimate.allocator.CUDA_CONTEXT_ALLOWANCE`.
        fit: the peak per phase as a line in the batch size (``None``: not fitted).
        emulated: the step ran on fake CPU tensors standing in for a device this machine lacks.
        alternatives: estimates of the same step with other settings (``compare=``), by name.
        error_bounds: operations whose memory follows a rule that measurements do not pin down (cuDNN's
            recurrent layers' workspace, chosen by its heuristics, see
            :mod:`~pytorch_mem_profiler.estimate.rnn`): the bytes the peak may be off by because of
            each, by operation; empty where every figure is known. :attr:`error_bound` is their
            total, counting the kernels' own buffers (``transient_bounds``) once.
        transient_bounds: the operations of ``error_bounds`` whose bound is a kernel's own buffer
            inside one operator, never alive together with another operator's.
        fallback_bounds: the operations of ``error_bounds`` whose bound is of workspaces that give
            way under a memory limit: cuDNN's convolutions, which run another plan when the
            allocator refuses a plan's workspace (see :meth:`batch_search`).
        search_bound_at: :attr:`search_bound` at another batch size, ``batch_size -> bytes`` (a fake
            step; ``None``: no batch dimension); :meth:`batch_search` leaves it free.
        step_events: the allocations and frees the allocator replay took, with where each phase
            of each step begins and what made each storage (``None``: off CUDA); see
            :class:`~pytorch_mem_profiler.estimate.allocator.StepEvents`.
        peak_at: the step at another batch size, ``batch_size -> (peak, peak phase)`` (fake steps;
            ``None``: no batch dimension); :meth:`max_batch_size` verifies its answer with it off CUDA.
        reserved_at: the replay at another batch size: ``(batch_size, limit, process=...) -> reserved``
            bytes, ``None`` if the allocator would run out under ``limit`` (``None``: off
            CUDA, or no batch dimension); ``process`` places cuBLAS's workspaces
            (:data:`~pytorch_mem_profiler.estimate.allocator.PROCESSES`; ``"warmed"`` when not
            given, as :attr:`reserved` has them); :meth:`max_batch_size` calls it with ``process``.
        autocast: the autocast dtype of the forward (``"bf16"``, ``"fp16"``; ``None``: off).
        checkpointing: how modules were chosen for gradient checkpointing (:data:`REPEATED_BLOCKS`
            or :data:`CHOSEN_BY_FUNCTION`; ``None``: off).
        checkpointed: the modules checkpointing wrapped, sorted (``None``: off; empty: it chose none).
        optimizer: the optimizer, as made (``"Adam"``, ``"SGD(lr=0.1, momentum=0.9)"``, ``"none
            (nothing to train)"``; ``None``: unknown).
        training_loop: the loop's settings where they are not the default one step of
            ``zero_grad(set_to_none=True)`` without clipping: ``"2 micro-batches a step,
            gradients clipped to norm 1.0, zero_grad(set_to_none=False)"`` (``None``: the default).
        parameter_dtypes: the dtypes of the model's floating-point parameters (``"float32"``).
        random_reads: the lines of the step that read a value drawn at random (``torch.rand([])``
            compared in Python: LayerDrop, stochastic depth), with how often, over the two steps:
            the figures are of the step those draws give (see ``random_draws``); empty when the
            step read none.
        random_draws: where the step read drawn values, how they were drawn: ``"top"`` or
            ``"bottom"`` (uniform draws at that end of their range, the larger of the two steps:
            ``estimate_memory(random_draws="largest")``), or ``"seeded"`` (the estimate's own seeded
            draws; see :mod:`~pytorch_mem_profiler.estimate.draws`).
        step_notes: how parts of the step were estimated where that is not plain, one line each (a
            ``torch.compile``'d module estimated as Inductor runs it, or uncompiled and why: see
            :mod:`~pytorch_mem_profiler.estimate.compiled`).
    """

    device: str
    batch_size: int | None
    peak: int
    peak_phase: str
    phases: Mapping[str, int]
    peak_breakdown: Mapping[str, int]
    peak_layers: Mapping[str, int]
    layers: LayerFeatureMaps
    weights: int
    buffers: int
    gradients: int
    optimizer_state: int
    inputs: int
    reserved: int | None = None
    workspace: int = 0
    kernel_scratch: int = 0
    whole_blocks: int = 0
    reserved_bound: int = 0
    outside: int = 0
    fit: BatchFit | None = None
    emulated: bool = False
    alternatives: Mapping[str, MemoryEstimate] = field(default_factory=dict)
    error_bounds: Mapping[str, int] = field(default_factory=dict)
    peak_at: Callable[[int], tuple[int, str]] | None = field(default=None, repr=False, compare=False)
    reserved_at: Callable[[int, int | None], int | None] | None = field(default=None, repr=False, compare=False)
    #: ``"ddp"``/``"fsdp2"`` when the figures are one rank's of ``world_size`` (``rank``), else ``None``
    parallel: str | None = None
    world_size: int = 1
    rank: int = 0
    #: bytes at the peak of DDP's gradient buckets, FSDP2's gathered parameters, the device mesh,
    #: communication buffers (in ``peak_breakdown["other"]``)
    parallel_parts: Mapping[str, int] = field(default_factory=dict)
    #: the peak (tensors) of each training step estimated: the first (before any optimizer state;
    #: DDP's first-iteration buckets) and the next, steady one; ``peak`` is the larger
    step_peaks: tuple[int, ...] = ()
    autocast: str | None = None
    checkpointing: str | None = None
    checkpointed: tuple[str, ...] | None = None
    optimizer: str | None = None
    training_loop: str | None = None
    parameter_dtypes: tuple[str, ...] = ()
    random_reads: Mapping[str, int] = field(default_factory=dict)
    random_draws: str = "seeded"
    step_notes: tuple[str, ...] = ()
    transient_bounds: frozenset[str] = frozenset()
    fallback_bounds: frozenset[str] = frozenset()
    search_bound_at: Callable[[int], int] | None = field(default=None, repr=False, compare=False)
    step_events: StepEvents | None = field(default=None, repr=False, compare=False)

    @property
    def notes(self) -> tuple[str, ...]:
        """What the figures rest on besides the step itself, one sentence each (the report's notes).

        Example::

            >>> est = MemoryEstimate("cpu", 8, 0, "forward", {}, {}, {}, LayerFeatureMaps({}, {}, 0, 0, 0), 0, 0, 0, 0, 0,
            ...                      random_reads={"modeling_bart.py:537: if dropout_probability < self.layerdrop:": 8})
            >>> print(est.notes[0])  # doctest: +ELLIPSIS
            The step read 8 values drawn at random (modeling_bart.py:537: ...): the figures are of the step ...
        """
        out = list(self.step_notes)
        if self.random_reads:
            lines = "; ".join(self.random_reads)
            n = sum(self.random_reads.values())
            if self.random_draws in ("top", "bottom"):
                how = (
                    f"the figures are of the larger of two steps, one with every uniform draw (torch.rand, "
                    f"uniform_) at the top of its range and one at the bottom: this one at the {self.random_draws}, "
                    f"where a LayerDrop step skips no layer; other draws (randint, randperm, bernoulli) are seeded, "
                    f"the same at every batch size"
                )
            else:
                how = (
                    "the figures are of the step those draws give (the estimate's own seeded draws, the same at "
                    "every batch size, random_draws='seeded'); a run's largest step may take other branches: with "
                    "LayerDrop at p > 0 it skips no layer (random_draws='largest' estimates that one)"
                )
            out.append(f"The step read {n} value{'s' if n != 1 else ''} drawn at random ({lines}): {how}")
        return tuple(out)

    @property
    def peak_allocated(self) -> int:
        """The peak as ``torch.cuda.max_memory_allocated()`` would report it: tensors and workspaces."""
        return self.peak + self.workspace

    @property
    def error_bound(self) -> int:
        """Bytes the peak may be off by (0: no operation follows an unmeasured rule), see :attr:`error_bounds`:
        the largest of the kernels' own buffers' bounds (one operator at a time) plus the others'."""
        return error_bound_of(self.error_bounds, self.transient_bounds)

    @property
    def search_bound(self) -> int:
        """Bytes of :attr:`error_bound` that :meth:`batch_search` leaves free: all but the bounds of
        workspaces that give way under a limit (:attr:`fallback_bounds`).

        Example::

            >>> est = MemoryEstimate("cuda", 8, 0, "forward", {}, {}, {}, LayerFeatureMaps({}, {}, 0, 0, 0), 0, 0, 0, 0, 0,
            ...                      error_bounds={"conv": 300, "rnn": 200, "kept": 40},
            ...                      transient_bounds=frozenset({"conv", "rnn"}), fallback_bounds=frozenset({"conv"}))
            >>> est.error_bound, est.search_bound
            (340, 240)
        """
        return search_bound_of(self.error_bounds, self.transient_bounds, self.fallback_bounds)

    @property
    def activations(self) -> int:
        """Bytes one forward saved for backward (the inputs not included)."""
        return self.layers.total

    @property
    def needed(self) -> int:
        """Bytes the device must give PyTorch: the allocator's segments where known (CUDA), else the peak allocated."""
        return self.peak_allocated if self.reserved is None else max(self.reserved, self.peak_allocated)

    @property
    def required(self) -> int:
        """Bytes the device needs for the step: :attr:`needed` plus the allowance outside PyTorch."""
        return self.needed + self.outside

    def fits(self, device_memory: int, *, outside: int | None = None) -> bool:
        """Whether the step fits in ``device_memory`` bytes (``outside``: another allowance)."""
        extra = self.outside if outside is None else outside
        return self.needed + extra <= device_memory

    def max_batch_size(
        self, device_memory: int, margin: float = 0.1, *, outside: int | None = None, process: str = "fresh"
    ) -> int:
        """The largest batch size that fits in ``device_memory`` bytes, less ``margin`` of it.

        :meth:`batch_search`'s answer (``.batch_size``); see there.

        Raises:
            ValueError: a bad argument, or no fit (an estimate made without a batch dimension).
        """
        return self.batch_search(device_memory, margin, outside=outside, process=process).batch_size

    def batch_search(
        self, device_memory: int, margin: float = 0.1, *, outside: int | None = None, process: str = "fresh"
    ) -> BatchSearch:
        """The largest batch size that fits in ``device_memory`` bytes, less ``margin`` of it, and how it was found.

        The fit's lines (each phase's peak over two batch sizes) give a first
        answer, which is then verified with fake steps (:func:`largest_verified`:
        stepping up or down from it, then a bisection to within 1%), because a
        step's peak is the highest of several moments, each growing with the batch
        at its own rate, and at a large batch another moment may hold it than at
        the batches fitted. Off CUDA a batch fits when the step's peak plus the
        allowance outside PyTorch is within ``device_memory``. On CUDA the limit is
        on what the caching allocator reserves, which is more than it allocates
        (blocks rounded into 2 MiB and 20 MiB segments, freed blocks that a larger
        request cannot use): a batch fits when the allocator replay
        (:attr:`reserved_at`) runs it without running out, its segments plus the
        allowance within ``device_memory`` (it gives back its wholly free segments
        before it gives up, as the real one does), and still runs it with
        :data:`~pytorch_mem_profiler.estimate.allocator.LAYOUT_ALLOWANCE` (0.5%) of the
        memory less (``BatchSearch.layout``): the estimate's requests are the real ones in a
        slightly different order, and a batch that fits the replay by a sliver may not fit the
        device. cuDNN's convolution workspaces give way under the limit: PyTorch catches the
        allocator's out-of-memory error for a plan's workspace and runs the next plan cuDNN's
        heuristics list, down to ones that take little or none (an H200 ran UNet at batches 21
        and 23 under 4.75 GiB with 41 and 95 workspaces refused, ``memory_stats()["num_ooms"]``),
        so the replay does without a workspace it cannot place
        (:attr:`~pytorch_mem_profiler.estimate.allocator.StepEvents.fallback`). Where the estimate
        states an error bound (:attr:`error_bound`: operations whose memory follows a rule
        measurements do not pin down), a batch fits only with that many bytes left over, the
        bound as the fake step at that batch states it (:attr:`search_bound_at`): a batch that
        fits only if those operations take what the rule says, not what it allows, is not the
        answer (``BatchSearch.bound``); the bound of cuDNN's convolution workspaces is not left
        free (:attr:`search_bound`), since a workspace larger than the rule's that does not fit
        is refused and done without. The answer is the batch found
        times ``1 - margin``, rounded down (Lightning's ``BatchSizeFinder(margin=...)``
        rule). ``outside``: another allowance than :attr:`outside` (0 when the limit
        is the allocator's own, as under ``torch.cuda.set_per_process_memory_fraction``).
        ``process``: where the replay has cuBLAS's workspaces (on CUDA).
        ``"fresh"`` (the default, a user's training run): made at each thread's first cuBLAS
        operator, just after its output, as in a new process's first step, where they lie amid
        the step's blocks (two steps of Qwen2 at 17 reserve 1.08 GB more so on an H200).
        ``"warmed"``: made before the step, as in a process that ran a step already (a
        warm-up, a validation loop, an earlier run; what the profiler and :attr:`reserved`
        measure). ``"either"``: a batch fits both.
        For an estimate of one rank (:attr:`parallel`) the batch is per rank and every fake
        step is that rank's (rank 0 holds the largest shards: its answer is every rank's).

        Raises:
            ValueError: a bad argument, or no fit (an estimate made without a batch dimension).
        """
        check_device_memory(device_memory)
        check_process(process)
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be at least 0 and less than 1, got {margin!r}")
        if self.fit is None:
            raise ValueError(
                "this estimate has no fit over batch sizes: give example inputs whose first dimension is "
                "the batch (or a function batch_size -> inputs) and keep fit=True"
            )
        fit = self.fit
        if fit.error is not None and fit.error > LINEARITY_TOLERANCE:
            warnings.warn(
                f"the step's memory is not linear in the batch size: the fit over batch sizes "
                f"{fit.batch_sizes} is off by {100 * fit.error:.1f}% at {fit.checked_at}; the answer is "
                f"verified with fake steps",
                stacklevel=3,
            )
        extra = self.outside if outside is None else outside
        budget = device_memory - extra
        stated = self.search_bound
        bounds: dict[int, int] = {}
        tried: list[tuple[int, bool]] = []
        phases: dict[int, str] = dict(fit.peak_phases)
        fits = self._fits_within(budget, bounds, tried, phases, process)
        line = fit.largest_batch(budget - self.workspace - stated)
        largest = line
        if self.reserved_at is not None:
            guess = max(1, line)
            if self.reserved and self.peak_allocated:
                # segments hold about the same share more than the blocks at any batch: a first guess
                guess = max(1, min(line, fit.largest_batch((budget - stated) * self.peak_allocated / self.reserved - self.workspace)))
            largest = largest_verified(fits, guess)
        elif self.peak_at is not None:
            largest = largest_verified(fits, max(1, line))
        peak_phase = phases.get(largest)
        if largest in phases or not tried:
            moves = BatchFit({}, fit.batch_sizes, None, None, phases).peak_moves
        else:
            moves = fit.peak_moves
        return BatchSearch(
            batch_size=int(math.floor(largest * (1 - margin))),
            largest=largest,
            line=line,
            tried=tuple(tried),
            peak_phase=peak_phase,
            peak_moves=moves,
            bound=bounds.get(largest, stated) if largest else 0,
            layout=self._layout(budget) if largest else 0,
            process=process,
        )

    def batch_fits(self, batch: int, device_memory: int, *, outside: int | None = None, process: str = "fresh") -> bool:
        """Whether a step at ``batch`` fits in ``device_memory`` bytes, by the rule :meth:`batch_search`
        applies to each batch it tries (one fake step; no margin; on CUDA the layout allowance left over).

        Near a limit the caching allocator's answer need not be monotonic in the batch: a larger
        batch lays its blocks out otherwise and may fit where a smaller one ran out (the replay
        follows the allocator, so it says so too). :meth:`batch_search` answers the largest batch
        below the first that does not fit; ask this for any other.

        Raises:
            ValueError: a bad argument, or an estimate that cannot step another batch (``fit=False``).
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        check_device_memory(device_memory)
        check_process(process)
        if self.reserved_at is None and self.peak_at is None:
            raise ValueError("this estimate cannot step another batch: make it with fit=True and a batch dimension")
        budget = device_memory - (self.outside if outside is None else outside)
        return self._fits_within(budget, {}, [], {}, process)(batch)

    def _fits_within(
        self, budget: int, bounds: dict[int, int], tried: list[tuple[int, bool]], phases: dict[int, str], process: str
    ) -> Callable[[int], bool]:
        """``batch -> fits`` within ``budget`` bytes, noting each batch's stated bound, verdict and peak phase.

        The estimate's stated error is left free at each batch tried (the bound grows with the batch).
        On CUDA a batch fits when the allocator replay runs it under the limit, and under the limit
        less the layout allowance (:meth:`_layout`); elsewhere when its peak, the workspace and the bound are within
        ``budget``."""
        stated = self.search_bound
        bound_at = self.search_bound_at if self.search_bound_at is not None else (lambda _batch: stated)
        measure, workspace = self.peak_at, self.workspace
        replay = functools.partial(self.reserved_at, process=process) if self.reserved_at is not None else None
        layout = self._layout(budget)

        def fits(batch: int) -> bool:
            bounds[batch] = bound_at(batch)
            if replay is not None:
                # Under the limit itself too: with less room the allocator gives its free segments
                # back sooner, which can fit a batch that the limit itself does not.
                limit = budget - bounds[batch]
                ok = replay(batch, limit) is not None and (not layout or replay(batch, limit - layout) is not None)
            else:
                assert measure is not None
                peak, phases[batch] = measure(batch)
                ok = peak + workspace + bounds[batch] <= budget
            tried.append((batch, ok))
            return ok

        return fits

    def _layout(self, budget: int) -> int:
        """Bytes of ``budget`` a replayed batch leaves free for where the device's blocks may lie
        otherwise (:data:`~pytorch_mem_profiler.estimate.allocator.LAYOUT_ALLOWANCE`); 0 off CUDA,
        where the peak is the answer and no allocator layout enters it.

        Example::

            >>> est = MemoryEstimate("cuda", 8, 0, "forward", {}, {}, {}, LayerFeatureMaps({}, {}, 0, 0, 0), 0, 0, 0, 0, 0,
            ...                      reserved_at=lambda batch, limit, process: None)
            >>> est._layout(12 * 2**30)  # bytes of a 12 GiB limit: about 61 MiB
            64424510
        """
        return math.ceil(LAYOUT_ALLOWANCE * max(budget, 0)) if self.reserved_at is not None else 0

    # -- the report --------------------------------------------------------------
    def settings(self, unit: str = "MB") -> list[tuple[str, str]]:
        """Every setting the estimate was made with, as ``(name, value)`` lines of the report's header.

        Example::

            >>> est = MemoryEstimate("cuda", 8, 0, "forward", {}, {}, {}, LayerFeatureMaps({}, {}, 0, 0, 0), 0, 0, 0, 0, 0,
            ...                      emulated=True, outside=2**30, workspace=2**26, autocast="bf16",
            ...                      checkpointing=REPEATED_BLOCKS, checkpointed=(), optimizer="AdamW")
            >>> for name, value in est.settings("MiB"):
            ...     print(f"{name}: {value}")
            Device: cuda, fake tensors on the CPU standing in for it
            Batch size: 8
            Autocast: bf16 (the forward under torch.autocast)
            Gradient checkpointing: no module: the model has no repeated blocks to checkpoint (give checkpointing=fn to choose modules)
            Optimizer: AdamW
            Allowed outside PyTorch: 1024 MiB (the CUDA context; outside=)
            Workspace allowed: 64 MiB (cuBLAS; workspace=)
        """
        where = f"{self.device}, fake tensors" + (" on the CPU standing in for it" if self.emulated else " on it")
        lines = [("Device", where)]
        if self.parallel is not None:
            lines.append(("Parallel", f"{self.parallel.upper()}, rank {self.rank} of {self.world_size} (figures per rank)"))
        lines.append(("Batch size", "unknown (no batch dimension)" if self.batch_size is None else str(self.batch_size)))
        lines.append(("Autocast", f"{self.autocast} (the forward under torch.autocast)" if self.autocast else "off (the model's own dtypes)"))
        lines.append(("Gradient checkpointing", checkpointing_text(self)))
        lines.append(("Optimizer", self.optimizer if self.optimizer is not None else "unknown"))
        if self.training_loop is not None:
            lines.append(("Training loop", self.training_loop))
        outside_why = "the CUDA context" if self.device.startswith("cuda") else "none off CUDA"
        lines.append(("Allowed outside PyTorch", f"{format_amount(self.outside, unit)} ({outside_why}; outside=)"))
        workspace_why = "cuBLAS" if self.device.startswith("cuda") else "none off CUDA"
        lines.append(("Workspace allowed", f"{format_amount(self.workspace, unit)} ({workspace_why}; workspace=)"))
        return lines

    def format(self, unit: str = "MB", top: int = 5) -> str:
        """The report; ``str(estimate)`` is ``estimate.format()``. Its header names every setting
        (:meth:`settings`)."""
        fmt = lambda n: format_amount(n, unit)  # noqa: E731
        stars = "*" * _WIDTH
        out = [stars, "Estimated memory of one training step", stars]
        out += [f"{name}: {value}" for name, value in self.settings(unit)]
        out.append("")
        out += [
            _line("Weights", fmt(self.weights)),
            _line("Weight gradients", fmt(self.gradients)),
            _line("Optimizer state", fmt(self.optimizer_state)),
            _line("Buffers", fmt(self.buffers)),
            _line("Input batch", fmt(self.inputs)),
            _line("Feature maps (saved for backward)", fmt(self.activations)),
            "",
            _line("Peak allocated", fmt(self.peak_allocated) + (f" ± {fmt(self.error_bound)}" if self.error_bound else "")),
            *(
                _line(f"  ± {operation} ({'inside one operator' if operation in self.transient_bounds else 'kept alive'})", fmt(n))
                for operation, n in self.error_bounds.items()
            ),
            f"Peak during: {PHASE_LABELS.get(self.peak_phase, self.peak_phase)}; alive then:",
        ]
        for category in PEAK_CATEGORIES:
            n = self.peak_breakdown.get(category, 0)
            if n:
                out.append(_line(f"  {PEAK_CATEGORY_LABELS[category]}", fmt(n)))
        if self.kernel_scratch:
            out.append(_line("  (of other: kernel scratch)", fmt(self.kernel_scratch)))
        if self.whole_blocks:
            out.append(_line("  (of other: the allocator's blocks beyond the requests)", fmt(self.whole_blocks)))
        for role, n in self.parallel_parts.items():
            out.append(_line(f"  (of other: {_PARALLEL_LABELS.get(role, role)})", fmt(n)))
        if self.workspace:
            out.append(_line("  cuBLAS workspace", fmt(self.workspace)))
        out.append("Peak by phase:")
        for phase, n in self.phases.items():
            out.append(_line(f"  {PHASE_LABELS.get(phase, phase)}", fmt(n + self.workspace)))
        # a layer's weights cast by autocast are named apart from its feature maps, as in the profiler's report
        ranked = sorted(((m, kind, n) for (m, kind), n in self.layers.by_module.items() if m != INPUT), key=lambda mkn: -mkn[2])
        if ranked:
            out.append(f"Feature maps by layer (largest {min(top, len(ranked))} of {len(ranked)}):")
            for module, kind, n in ranked[:top]:
                copies = " [weight copies]" if kind != ACTIVATIONS else ""
                out.append(_line(f"  {module or '(model)'}{copies}", fmt(n)))
        if self.reserved is not None:
            upto = f" (up to {fmt(self.reserved + self.reserved_bound)})" if self.reserved_bound else ""
            out.append(_line("Allocator segments (reserved, at the peak)", fmt(self.reserved) + upto))
            if self.reserved_bound:
                out.append("  (the higher figure: cuDNN's weight-gradient passes each at its stated bound)")
        if self.outside:
            out.append(_line("Outside PyTorch (CUDA context)", fmt(self.outside)))
        out.append(_line("Needed on the device", fmt(self.required)))
        if self.fit is not None:
            a, b = self.fit.batch_sizes
            check = ""
            if self.fit.checked_at is not None and self.fit.error is not None:
                check = f", checked at {self.fit.checked_at}: off by {100 * self.fit.error:.2f}%"
            out.append(f"Per sample: {fmt(self.fit.per_sample)} (linear over batch {a} and {b}{check})")
            if self.fit.peak_moves:
                out.append(f"The peak moves with the batch: {self.fit.peak_moves}")
        for note in self.notes:
            out.append(f"Note: {note}")
        if self.alternatives:
            out += ["", self.format_comparison(unit)]
        out.append(f"({unit} = {UNITS[unit]:,} bytes)")
        return "\n".join(out)

    def format_comparison(self, unit: str = "MB") -> str:
        """The alternatives' peaks against this estimate's, as a Markdown table, with what each
        what-if acted on (:func:`acted_on`); where it changes nothing, why (:func:`unchanged_reason`)
        instead of ``+0.0%``."""
        base = self.peak_allocated
        lines = [
            f"| configuration | peak allocated ({unit}) | vs baseline | what it acted on |",
            "| --- | --- | --- | --- |",
            f"| baseline | {format_amount(base, unit, digits=4)} | (reference) | {_cell(_baseline_text(self))} |",
        ]
        for name, est in self.alternatives.items():
            reason = unchanged_reason(self, est)
            if reason is not None:
                change = f"no change: {reason}"
            else:
                change = f"{100 * (est.peak_allocated - base) / base:+.1f}%" if base else "n/a"
            # a setting that found nothing to act on is the reason already: not said twice
            said = reason.split("; ") if reason is not None else []
            acted = "; ".join(a for a in acted_on(self, est) if not any(part in a for part in said)) or "nothing"
            lines.append(f"| {_cell(name)} | {format_amount(est.peak_allocated, unit, digits=4)} | {_cell(change)} | {_cell(acted)} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


#: :attr:`MemoryEstimate.checkpointing` when ``checkpointing=True``: the model's repeated blocks.
REPEATED_BLOCKS = "the model's repeated blocks"
#: :attr:`MemoryEstimate.checkpointing` when ``checkpointing`` is a function ``(name, module) -> bool``.
CHOSEN_BY_FUNCTION = "the modules checkpointing=fn chose"

#: Why checkpointing chose no module, by how it chooses.
_NOTHING_TO_CHECKPOINT = {
    REPEATED_BLOCKS: "the model has no repeated blocks to checkpoint (give checkpointing=fn to choose modules)",
    CHOSEN_BY_FUNCTION: "checkpointing=fn chose no module (it returned False for every (name, module))",
}

#: Autocast's names for the dtypes' names of :attr:`MemoryEstimate.parameter_dtypes`.
_AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _names(names: tuple[str, ...], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def checkpointing_text(est: MemoryEstimate) -> str:
    """What gradient checkpointing wrapped in ``est``: ``"off"``, ``"3 modules (the model's
    repeated blocks): blocks.0, blocks.1, blocks.2"``, or why no module."""
    if est.checkpointing is None or est.checkpointed is None:
        return "off"
    if not est.checkpointed:
        return "no module: " + _NOTHING_TO_CHECKPOINT.get(est.checkpointing, "no module was chosen")
    n = len(est.checkpointed)
    return f"{n} module{'s' if n != 1 else ''} ({est.checkpointing}): {_names(est.checkpointed)}"


def _autocast_idle(est: MemoryEstimate) -> str | None:
    """Why ``est``'s autocast changes no precision, or ``None`` where it may."""
    if est.autocast is None:
        return None
    dtype = _AUTOCAST_DTYPES.get(est.autocast, est.autocast)
    if not est.parameter_dtypes:
        return f"autocast to {est.autocast}: the model has no floating-point parameters to compute in {dtype}"
    if set(est.parameter_dtypes) == {dtype}:
        return f"autocast to {est.autocast}: the model's parameters are already {dtype}"
    return None


def _baseline_text(est: MemoryEstimate) -> str:
    parts = [f"autocast {est.autocast}" if est.autocast else "no autocast"]
    parts.append("no checkpointing" if est.checkpointed is None else f"checkpointing: {checkpointing_text(est)}")
    return ", ".join(parts)


def acted_on(base: MemoryEstimate, est: MemoryEstimate) -> list[str]:
    """What the what-if ``est`` changed against ``base``, one phrase per setting that differs,
    computed from what each setting found (the modules checkpointed, the parameters' dtypes)."""
    out = []
    if est.checkpointed != base.checkpointed:
        if est.checkpointed is None:
            out.append("checkpointing off")
        elif not est.checkpointed:
            out.append("checkpointed nothing: " + _NOTHING_TO_CHECKPOINT.get(est.checkpointing or "", "no module chosen"))
        else:
            n = len(est.checkpointed)
            out.append(f"checkpointed {n} module{'s' if n != 1 else ''} ({est.checkpointing}): {_names(est.checkpointed)}")
    if est.autocast != base.autocast:
        idle = _autocast_idle(est)
        if idle is not None:
            out.append(idle)
        elif est.autocast is None:
            out.append("autocast off")
        else:
            dtypes = ", ".join(est.parameter_dtypes)
            out.append(f"the forward under autocast to {est.autocast} ({dtypes} parameters)")
    if est.batch_size != base.batch_size:
        out.append(f"batch size {base.batch_size} -> {est.batch_size}")
    if est.optimizer != base.optimizer:
        out.append(f"optimizer {base.optimizer} -> {est.optimizer}")
    return out


def unchanged_reason(base: MemoryEstimate, est: MemoryEstimate) -> str | None:
    """Why the what-if ``est`` does not change ``base``'s peak, or ``None`` where it does.

    The settings that found nothing to act on are the reason (checkpointing that chose no module,
    autocast to the dtype the parameters already have); where every setting acted and the peak is
    still the same, the reason is that the peak holds nothing they change.
    """
    if est.peak_allocated != base.peak_allocated:
        return None
    idle = []
    if est.checkpointed is not None and not est.checkpointed and est.checkpointed != base.checkpointed:
        idle.append(_NOTHING_TO_CHECKPOINT.get(est.checkpointing or "", "checkpointing chose no module"))
    if est.autocast != base.autocast and _autocast_idle(est) is not None:
        idle.append(_autocast_idle(est) or "")
    if idle:
        return "; ".join(idle)
    acted = acted_on(base, est)
    if not acted:
        return "its settings are the baseline's"
    phase = PHASE_LABELS.get(est.peak_phase, est.peak_phase)
    return f"what it acted on is not at the peak ({phase}), which holds the same bytes"
