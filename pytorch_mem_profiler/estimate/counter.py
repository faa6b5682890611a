"""Live storages of one device, counted as the CPU counter counts them, with each storage's life kept.

:class:`StorageLifeCounter` counts as the profiler's
:class:`~pytorch_mem_profiler.measure.devices.CpuCounter` does (the same rules, from
:func:`~pytorch_mem_profiler.measure.storage_counting.return_kinds`: every storage an
operator returns counts once, by its bytes, until its last reference dies; views and
in-place results are no new memory, but a sparse tensor written in place may hold new index and
value tensors), for the storages of any device, fake tensors
included, remembering when each storage was born and died. It has a dispatch mode
of its own, entered and left around the one step it watches. Roles are learned
after the fact (a storage that ends up as a ``.grad`` is a gradient from its birth
on), so what was alive at the peak is put down to categories when the step is over.

Example::

    >>> import torch
    >>> counter = StorageLifeCounter(torch.device("cpu"))
    >>> counter.start()
    >>> a = torch.zeros(256)                  # 1024 bytes
    >>> b = torch.zeros(128)                  # 512 bytes
    >>> del a
    >>> counter.stop()
    >>> counter.read().allocated, counter.peak
    (512, 1536)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from ..measure.accounting import same_device, storage_holder, storage_parts
from ..measure.devices import MemoryCounter, Reading
from ..measure.engine_sums import ENGINE_SUM, ENGINE_SUM_IN_PLACE, EngineAccumulation
from ..measure.storage_counting import (
    NEW,
    RESIZED,
    layout_rewrites,
    made_inside,
    return_kinds,
    unwatch_storage_resizes,
    watch_storage_resizes,
)
from .allocator import runs_cublas
from .backward_formulas import InPlaceFormulas

__all__ = ["Life", "StorageLifeCounter", "TargetKernels", "born_as", "COLLECTIVE_ROLE"]

#: The role of every tensor a collective (a ``c10d`` operator) is handed: a communication buffer.
COLLECTIVE_ROLE = "comm_buffers"

_BIRTH = threading.local()


@contextlib.contextmanager
def born_as(role: str) -> Iterator[None]:
    """Storages the counter meets first inside the block have ``role`` from their birth.

    For buffers an emulation makes and drops before any role could be given after the fact
    (DDP's flat broadcast of its buffers).

    Example::

        >>> import torch
        >>> counter = StorageLifeCounter(torch.device("cpu"))
        >>> counter.start()
        >>> with born_as("comm_buffers"):
        ...     flat = torch.zeros(4)
        >>> counter.stop()
        >>> counter.lives[-1].roles
        {'comm_buffers'}
    """
    before = getattr(_BIRTH, "role", None)
    _BIRTH.role = role
    try:
        yield
    finally:
        _BIRTH.role = before


@dataclass
class Life:
    """One storage: its bytes as counted, when it was born and died (counter ticks), its roles."""

    nbytes: int
    born: int
    phase: str
    died: int | None = None
    #: roles learned later: "weights", "gradients", "optimizer_state", "inputs", "activations";
    #: "scratch" for a kernel's own buffer inside one operator (see ``StorageLifeCounter.transient``);
    #: "regrown" for a storage made again by ``storage.resize_`` (FSDP2's gathered parameters);
    #: "comm_buffers" for a collective's tensors (:data:`COLLECTIVE_ROLE`); the parallel set-up's
    #: roles (:data:`~.parallel.PARALLEL_ROLES`)
    roles: set[str] = field(default_factory=set)
    #: the module whose forward saved it for backward (the innermost one running)
    saved_by: str | None = None
    #: the operator that made it (``None``: made before counting began, adopted)
    op: Any = None
    #: bytes a kernel's block may ask beyond ``nbytes``, by a rule's bound (the allocator replay's
    #: upper figure, ``MemoryEstimate.reserved_bound``); 0 for every tensor
    headroom: int = 0
    #: a library's workspace that it does without when the allocator refuses it (cuDNN's, which
    #: then runs another plan): the allocator replay under a limit skips it (``ConvScratch.fallback``)
    fallback: bool = False

    def alive_at(self, tick: int) -> bool:
        return self.born <= tick and (self.died is None or self.died > tick)


#: whether an operator runs cuBLAS on CUDA (:func:`~.allocator.runs_cublas`), by operator
_RUNS_CUBLAS: dict[Any, bool] = {}


class _LifeMode(TorchDispatchMode):
    """Hands every tensor an operator returns to the counter, as its kind of return says."""

    def __init__(self, counter: StorageLifeCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kernels = self.counter.kernels
        sums = kernels.accumulation
        if func is ENGINE_SUM and sums is not None and sums.in_place(args, kwargs or {}):
            func = ENGINE_SUM_IN_PLACE  # the engine's sum of gradient pieces, in place as on the device
        formulas = kernels.formulas
        if formulas is not None:  # a backward formula's scatter into its zeros, in place as on the device
            func = formulas.in_place(func, args, kwargs or {}, self.counter.tick)
        # a sparse tensor written in place gets new index and value tensors inside the kernel
        rewrites = layout_rewrites(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if self.counter.paused_depth:
            return out
        if rewrites is not None:
            written, before, held = rewrites
            for tensor, old in zip(written, held):
                for part in storage_parts(tensor):
                    if part is not tensor and made_inside(part, before):
                        self.counter._track(part, op=func)
                old.clear()  # its old parts die after its new ones are born, as in the kernel
        if getattr(func, "namespace", None) == "c10d":
            self.counter._collective(args)
        blas = _RUNS_CUBLAS.get(func)
        if blas is None:
            blas = _RUNS_CUBLAS[func] = getattr(func, "namespace", None) == "aten" and runs_cublas(getattr(func, "_opname", ""))
        if kernels.outputs is not None:
            # what the target's kernel returns where the fake kernel returns something else
            out = kernels.outputs(func, args, kwargs or {}, out)
        kinds = return_kinds(func)
        if kinds is None:
            if blas:
                self.counter.blas_first.setdefault(self.counter.phase, self.counter.tick)
            return out
        first = args[0] if args else None
        finish = None
        if kernels.scratch is not None and isinstance(first, torch.Tensor) and same_device(first, self.counter.device):
            # what the kernel takes for itself and gives back: before its outputs where it takes them
            # first (:class:`~.scratch.KernelSteps`), else on top of its outputs, gone at its return
            finish = self.counter.begin_transient(kernels.scratch(func, args, kwargs or {}), op=func)
        items = [out] if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else []
        order = kernels.output_order(func, len(items)) if kernels.output_order is not None else range(len(items))
        for i in order:
            item = items[i]
            if isinstance(item, torch.Tensor):
                kind = kinds[i] if i < len(kinds) else kinds[-1]
                if kind == NEW or kind == RESIZED:
                    for part in storage_parts(item):
                        self.counter._track(part, alias=kind == RESIZED, op=func)
        if blas:
            # after this operator's outputs: where a fresh process makes the thread's workspace (the
            # kernel asks for it when it calls cuBLAS, its output already allocated; H200 traces of
            # an MLP's addmm and mm and of Qwen2's first matmuls, forward and backward)
            self.counter.blas_first.setdefault(self.counter.phase, self.counter.tick)
        if finish is not None:
            finish()
        if formulas is not None:
            formulas.made(func, out, self.counter.tick)
        return out


@dataclass(frozen=True)
class TargetKernels:
    """How the target's kernels allocate where the fake kernels differ, asked by the counter at each
    operator (see :class:`StorageLifeCounter`'s arguments of the same names; ``None``: as the fake kernel)."""

    scratch: Callable[[Any, tuple, dict], Sequence[int]] | None = None
    outputs: Callable[[Any, tuple, dict, Any], Any] | None = None
    accumulation: EngineAccumulation | None = None
    output_order: Callable[[Any, int], Sequence[int]] | None = None
    formulas: InPlaceFormulas | None = None


class StorageLifeCounter(MemoryCounter):
    """Counts live storages of ``device`` (fake tensors too) and keeps each one's :class:`Life`.

    Args:
        device: the device whose storages count (``cuda:0`` for fake CUDA tensors).
        size_of: the bytes a storage of ``nbytes`` takes (the CUDA caching
            allocator's 512-byte rounding, say); default: ``nbytes``.
        scratch: ``(func, args, kwargs) -> blocks``: the bytes of the blocks an
            operator's kernel takes and gives back before it returns (see
            :class:`~.scratch.KernelScratch`), counted as transients; default: none.
        outputs: ``(func, args, kwargs, out) -> out``: an operator's outputs as the
            target's kernel makes them, where the fake kernel differs (see
            :class:`~.cpu_kernels.CpuKernels`); what it returns is counted, and is
            what the operator returns; default: the fake kernel's.
        accumulation: where autograd's engine sums gradient pieces in place on the target
            (:class:`~pytorch_mem_profiler.measure.engine_sums.EngineAccumulation`, calibrated after :meth:`start`);
            default: every sum a new tensor, as under a dispatch mode.
        output_order: ``(func, outputs) -> indices``: the outputs the target's kernel makes on the
            device, in the order it makes them (see :mod:`~.output_order`; one left out is made in
            host memory and not counted); default: all of them, in the order returned.
        formulas: backward formulas that scatter into their zeros in place on the target
            (:class:`~.backward_formulas.InPlaceFormulas`); default: as the fake mode runs them.
    """

    shares_peaks = False  # it counts by itself

    def __init__(
        self,
        device: torch.device,
        size_of: Callable[[int], int] | None = None,
        scratch: Callable[[Any, tuple, dict], Sequence[int]] | None = None,
        outputs: Callable[[Any, tuple, dict, Any], Any] | None = None,
        accumulation: EngineAccumulation | None = None,
        output_order: Callable[[Any, int], Sequence[int]] | None = None,
        formulas: InPlaceFormulas | None = None,
    ) -> None:
        super().__init__(device)  # sets ``device``
        #: how the target's kernels allocate where the fake ones differ (the arguments above)
        self.kernels = TargetKernels(scratch, outputs, accumulation, output_order, formulas)
        self._mode: _LifeMode | None = None
        self._size_of = size_of or (lambda n: n)
        self._live: dict[int, Life] = {}
        self._storage_refs: dict[int, weakref.ref] = {}
        self.lives: list[Life] = []
        self.tick = 0
        self.now = 0
        self.peak = 0
        self.peak_tick = 0
        self._interval_peak = 0
        #: the phase new storages are born in, and the largest total reached in each
        self.phase = "other"
        self.phase_peaks: dict[str, int] = {}
        #: the tick of each phase's peak (the allocator replay counts whole blocks there)
        self.phase_peak_ticks: dict[str, int] = {}
        #: the phases an operator that runs cuBLAS on CUDA ran in (each such thread takes a workspace),
        #: each with the tick just after the first such operator's outputs in it (where a fresh
        #: process makes the thread's workspace)
        self.blas_first: dict[str, int] = {}
        #: while above 0 operators are not counted (see :meth:`paused`)
        self.paused_depth = 0
        #: the training step running (1, 2, ...; 0 before the first), set by whoever runs the steps
        self.step = 0
        #: ``(tick, step, phase)`` at each :meth:`enter_phase`: lives born after ``tick`` belong to it
        self.marks: list[tuple[int, int, str]] = []

    def start(self) -> None:
        if self._mode is None:
            self._mode = _LifeMode(self)
            self._mode.__enter__()
            watch_storage_resizes(self._storage_resized)

    def stop(self) -> None:
        super().stop()
        mode, self._mode = self._mode, None
        if mode is not None:
            unwatch_storage_resizes(self._storage_resized)
            mode.__exit__(None, None, None)  # the step is over: nothing was entered after it

    def _storage_resized(self, storage: torch.UntypedStorage, _before: int) -> None:
        """``storage.resize_`` (FSDP2 frees and remakes gathered parameters so): the storage's
        life ends at its old size and, unless now empty, a new one begins at its new size."""
        key = id(storage)
        life = self._live.get(key)
        if life is None:
            return
        nbytes = self._size_of(storage.nbytes())
        if nbytes == life.nbytes:
            return
        self.tick += 1
        life.died = self.tick
        self._change(-life.nbytes)
        reborn = Life(nbytes, self.tick, self.phase, roles={*life.roles, "regrown"}, saved_by=life.saved_by, op=life.op)
        self._live[key] = reborn
        self.lives.append(reborn)
        self._change(nbytes)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Operators inside are not counted: work that is not the step's (tracing a compiled
        module's graphs), or values the step would not allocate (what a fused kernel computes
        in registers). Storages counted before keep dying as they die."""
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1

    # -- what the dispatch mode hands over ---------------------------------------
    def _track(self, tensor: torch.Tensor, alias: bool = False, op: Any = None) -> None:
        if not same_device(tensor, self.device):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = id(storage)
        nbytes = self._size_of(storage.nbytes())
        life = self._live.get(key)
        if life is None and alias:
            return  # a view or in-place result of a storage made before counting began
        if life is not None:
            if life.nbytes != nbytes:  # resized in place (``out=`` kernels)
                self._change(nbytes - life.nbytes)
                life.nbytes = nbytes
            return
        self.tick += 1
        life = Life(nbytes, self.tick, self.phase, op=op)
        role = getattr(_BIRTH, "role", None)
        if role is not None:
            life.roles.add(role)
        self._live[key] = life
        self.lives.append(life)
        self._storage_refs[key] = weakref.ref(storage, _Death(self, key))
        self._change(nbytes)

    def _collective(self, args: Sequence[Any]) -> None:
        """A collective's tensors (FSDP2's all-gather output, its reduce-scatter input and
        output) are communication buffers, whatever else they become."""
        for arg in args:
            for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(tensor, torch.Tensor):
                    life = self.life_of(tensor)
                    if life is not None:
                        life.roles.add(COLLECTIVE_ROLE)

    def transient(self, blocks: Sequence[int], op: Any = None) -> None:
        """Blocks taken and given back within one operator, on top of what is alive now.

        Each is a :class:`Life` with the role ``"scratch"``, born one tick and dead
        the next, all alive together: the peaks see them, and so does the
        allocator's replay (their allocations and frees are events like any other).
        ``blocks`` with ``held`` and ``passes`` (:class:`~.scratch.Passes`) are a
        kernel that runs in passes: the held blocks are alive throughout, each
        pass's blocks taken and given back in turn. ``op``: the operator whose kernel takes them.
        """
        if getattr(blocks, "steps", None) is not None:  # in a set order, here all on top of the outputs
            taken: list[Life] = []
            self._run_steps(blocks.steps, taken, op)
            return
        passes = getattr(blocks, "passes", None)
        if passes is not None:  # blocks held throughout, and passes each taken and given back in turn
            held = self._take(blocks.held, op)
            room = getattr(blocks, "headroom", ())
            gives_way = getattr(blocks, "fallback", ())
            for i, one in enumerate(passes):
                taken = self._take(one, op)
                if i < len(room) and room[i] and taken:
                    taken[0].headroom = room[i]
                if i < len(gives_way) and gives_way[i]:
                    for life in taken:
                        life.fallback = True
                self._give_back(taken)
            self._give_back(held)
            return
        self._give_back(self._take(blocks, op))

    def begin_transient(self, blocks: Sequence[int], op: Any = None) -> Callable[[], None]:
        """Takes the part of an operator's blocks that comes before its outputs; returns what takes the rest.

        ``blocks`` with ``steps`` (:class:`~.scratch.KernelSteps`) run their steps up to
        the outputs now and the rest when the returned function is called (a block
        taken before may be given back after); other blocks are all taken then, on
        top of the outputs, as :meth:`transient` takes them.
        """
        if getattr(blocks, "steps", None) is None:
            return lambda: self.transient(blocks, op=op)
        taken: list[Life] = []
        self._run_steps(blocks.before, taken, op)
        return lambda: self._run_steps(blocks.after, taken, op)

    def _run_steps(self, steps: Sequence[tuple], taken: list[Life], op: Any) -> None:
        for step in steps:
            if step[0] == "take":
                taken.extend(self._take((step[1],), op) or [None])  # numbered even when empty
            elif step[0] == "give" and taken[step[1]] is not None:
                self._give_back([taken[step[1]]])

    def _take(self, blocks: Sequence[int], op: Any = None) -> list[Life]:
        taken = []
        for nbytes in blocks:
            if nbytes <= 0:
                continue
            self.tick += 1
            life = Life(nbytes, self.tick, self.phase, roles={"scratch"}, op=op)
            self.lives.append(life)
            taken.append(life)
            self._change(nbytes)
        return taken

    def _give_back(self, taken: list[Life]) -> None:
        for life in taken:
            self.tick += 1
            life.died = self.tick
            self._change(-life.nbytes)

    def _die(self, key: int) -> None:
        self._storage_refs.pop(key, None)
        life = self._live.pop(key, None)
        if life is not None:
            self.tick += 1
            life.died = self.tick
            self._change(-life.nbytes)

    def _change(self, delta: int) -> None:
        now = self.now = self.now + delta
        if now > self._interval_peak:
            self._interval_peak = now
        if now > self.peak:
            self.peak = now
            self.peak_tick = self.tick
        if now > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = now
            self.phase_peak_ticks[self.phase] = self.tick

    # -- roles -----------------------------------------------------------------
    def life_of(self, tensor: torch.Tensor) -> Life | None:
        """The life of the storage under ``tensor``, if counted and alive."""
        tensor = storage_holder(tensor)  # a DTensor: its local shard
        try:
            return self._live.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def adopt(self, tensors: Iterable[torch.Tensor], role: str | None = None) -> None:  # type: ignore[override]
        """Count tensors made before counting began, giving them ``role``."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            for part in storage_parts(tensor):
                self._track(part)
            if role is not None:
                self.give_role(tensor, role)

    def adopt_replacing(self, replaced: Sequence[int], tensors: Iterable[torch.Tensor], role: str | None = None) -> None:
        """Count blocks of ``replaced`` bytes made before counting began, then ``tensors`` made from
        them, then the blocks freed: how ``model.to("cuda")`` leaves a recurrent layer cuDNN runs (each
        weight copied on its own, then one buffer of them all, the copies given back)."""
        taken = self._take([self._size_of(n) for n in replaced])
        for life in taken:
            life.roles = {role} if role is not None else set()
        self.adopt(tensors, role=role)
        self._give_back(taken)

    def lives_of(self, tensor: torch.Tensor) -> list[Life]:
        """The lives of the storages holding ``tensor`` (a sparse one's indices and values), counted and alive."""
        found = []
        for part in storage_parts(tensor):
            life = self.life_of(part)
            if life is not None:
                found.append(life)
        return found

    def give_role(self, tensor: torch.Tensor, role: str) -> None:
        for life in self.lives_of(tensor):
            life.roles.add(role)

    def enter_phase(self, phase: str) -> None:
        """Storages born from now on are born in ``phase``; its peak starts from what is alive."""
        self.phase = phase
        self.marks.append((self.tick, self.step, phase))
        if self.now > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = self.now
            self.phase_peak_ticks[phase] = self.tick

    # -- the MemoryCounter interface ---------------------------------------------
    def _read_device(self) -> Reading:
        return Reading(self.now, self._interval_peak, self.now, self._interval_peak)

    def reset_peak(self) -> None:
        self._interval_peak = self.now

    def alive_at(self, tick: int) -> list[Life]:
        """The storages alive at ``tick``."""
        return [life for life in self.lives if life.alive_at(tick)]


class _Death:
    """Weak-reference callback: the storage died. Holds the counter weakly."""

    __slots__ = ("counter", "key")

    def __init__(self, counter: StorageLifeCounter, key: int) -> None:
        self.counter = weakref.ref(counter)
        self.key = key

    def __call__(self, _ref: weakref.ref) -> None:
        counter = self.counter()
        if counter is not None:
            counter._die(self.key)
