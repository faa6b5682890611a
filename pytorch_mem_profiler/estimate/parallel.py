"""One rank of data-parallel training, on fake tensors: DDP and FSDP2 at any world size.

``estimate_memory(..., parallel="ddp" | "fsdp2", world_size=N)`` runs the step of one
rank of ``N``, in one process, with no GPU and no communication:

- **FSDP2**: the real ``fully_shard`` (torch's own code) runs on the fake model over a
  *fake process group* (``torch.testing._internal.distributed.fake_pg``: collectives
  that move nothing), on each repeated block and then the root, as users wrap models
  (or the modules a function chooses), with ``reshard_after_forward`` and a mixed
  precision policy as asked. What FSDP2 makes is counted as it is made: the rank's
  padded shards, the all-gather buffers and unsharded parameters (freed and remade with
  ``storage.resize_``, which the counter follows), the unsharded gradients before their
  reduce-scatter, the sharded gradients, the optimizer state of the shards.
- **DDP**: its reducer is C++ that refuses fake tensors, so what it does to memory is
  done here as it does it (:class:`_EmulatedReducer`): at wrapping, one flat gradient
  bucket per dtype holding every trainable parameter (DDP buckets the first iteration as
  one); as a gradient is ready it is copied into its bucket, and with
  ``gradient_as_bucket_view=True`` the gradient then *is* its view of the bucket
  (autograd's own gradient is dropped). Before the second forward the buckets are
  rebuilt once, in the order the first backward made the gradients ready: the old ones
  freed, then new ones filled up to 1 MiB for the first and ``bucket_cap_mb`` for the
  others (each dtype apart), as ``_compute_bucket_assignment_by_size`` assigns them.
  With ``broadcast_buffers=True`` (DDP's default) and buffers in the model (BatchNorm's
  running statistics), every forward starts with rank 0's buffers broadcast: a flat
  copy of each bucket of buffers of one dtype (of 250 MiB at most; a bucket of one
  tensor is sent as it is), two buckets in flight at a time.
- **Communication buffers** (FSDP2's all-gather outputs and reduce-scatter inputs, the
  tensors of every collective; DDP's flat buffer broadcasts) are named at the peak.

The fake process group lives only while the step runs; a process group already up in
the process is left alone (the estimate then refuses ``fsdp2``: it cannot make a
second default group). On the CPU the device mesh's rank map (a tensor of ``world_size``
integers, always on the CPU) counts as the real run counts it. FSDP2 on fake CPU tensors
(an estimate on a machine without a GPU) needs torch 2.6 or later: torch 2.4 and 2.5 make
CUDA streams for it on any device, and the estimate refuses it there by name.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate import estimate_memory
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> one = estimate_memory(model, torch.zeros(8, 256), device="cpu", fit=False)
    >>> two = estimate_memory(model, torch.zeros(8, 256), device="cpu", fit=False, parallel="ddp", world_size=2)
    >>> two.weights == one.weights, two.parallel_parts["ddp_buckets"] == one.gradients  # a flat copy of each gradient
    (True, True)
    >>> from pytorch_mem_profiler.torch_versions import FSDP2_ON_CPU
    >>> if FSDP2_ON_CPU:  # torch 2.6 or later: each rank keeps half the weights and gradients
    ...     two = estimate_memory(model, torch.zeros(8, 256), device="cpu", fit=False, parallel="fsdp2", world_size=2)
    ...     assert two.weights * 2 == one.weights and two.gradients * 2 == one.gradients
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..torch_versions import FSDP2_ON_CPU
from .counter import COLLECTIVE_ROLE, born_as

__all__ = [
    "DDP",
    "FSDP2",
    "ParallelPlan",
    "RankSetup",
    "parse_parallel",
    "PARALLEL_ROLES",
    "fake_process_group",
    "bucket_assignment",
]

#: Roles the parallel set-up gives storages, and how the report names them: bytes alive
#: at the peak of each are in ``MemoryEstimate.parallel_parts`` (and in "other" of the breakdown).
#: A storage with one of the first three roles is "other" whatever else it is (a DDP bucket that
#: holds the gradients as views); a communication buffer that became a gradient (FSDP2's
#: reduce-scatter output) is a gradient.
PARALLEL_ROLES: Mapping[str, str] = {
    "ddp_buckets": "DDP gradient buckets",
    "regrown": "FSDP gathered parameters",
    "device_mesh": "device mesh",
    "comm_buffers": "communication buffers",
}

#: DDP's first bucket's cap (``dist._DEFAULT_FIRST_BUCKET_BYTES``) when ``bucket_cap_mb`` is left at its default.
FIRST_BUCKET_BYTES = 1024 * 1024
_MB = 1024 * 1024
#: DDP's ``broadcast_bucket_size``: the buckets its buffers are broadcast in (250 MiB).
BROADCAST_BUCKET_BYTES = 250 * _MB
#: ``BroadcastWork``s in flight at once in ``_broadcast_coalesced``.
BROADCASTS_IN_FLIGHT = 2


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel``'s settings that change memory.

    Attributes:
        bucket_cap_mb: the buckets' cap in MiB (DDP's default 25).
        gradient_as_bucket_view: gradients are views of the buckets (no second copy).
        broadcast_buffers: rank 0's buffers are broadcast before every forward (DDP's
            default ``True``): a flat copy of them in flight, where the model has buffers.
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    name = "ddp"


@dataclass(frozen=True)
class FSDP2:
    """``fully_shard``'s settings that change memory.

    Attributes:
        units: the modules sharded before the root: ``True`` for the model's repeated
            blocks (the rule gradient checkpointing uses), or ``(name, module) -> bool``.
        reshard_after_forward: free a unit's gathered parameters after its forward (FSDP2's
            default ``True``; ``False`` keeps them until backward).
        mixed_precision: ``None``, or the dtype (``torch.bfloat16``, ``"bf16"``) of the
            parameters gathered for compute, gradients reduced in float32
            (``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)``).
    """

    units: bool | Callable[[str, nn.Module], bool] = True
    reshard_after_forward: bool = True
    mixed_precision: Any = None
    name = "fsdp2"


ParallelPlan = DDP | FSDP2

_NAMES = {"ddp": DDP, "fsdp2": FSDP2, "fsdp": FSDP2}


def parse_parallel(value: Any) -> ParallelPlan | None:
    """``parallel=`` as a plan: ``None``, ``"ddp"``, ``"fsdp2"``, or a :class:`DDP` / :class:`FSDP2`.

    Example::

        >>> parse_parallel("fsdp2"), parse_parallel(None)
        (FSDP2(units=True, reshard_after_forward=True, mixed_precision=None), None)
    """
    if value is None:
        return None
    if isinstance(value, (DDP, FSDP2)):
        if isinstance(value, FSDP2) and value.mixed_precision is not None:
            _dtype(value.mixed_precision)  # a bad dtype fails here, not inside the step
        return value
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]()
    raise ValueError(f"parallel must be None, 'ddp', 'fsdp2', DDP(...) or FSDP2(...); got {value!r}")


def _dtype(value: Any) -> torch.dtype:
    from .api import parse_autocast  # the same names: "bf16", "fp16", a dtype

    try:
        dtype = parse_autocast(value)
    except ValueError:
        dtype = None
    if dtype is None:
        raise ValueError(f"FSDP2(mixed_precision=...) must be a half-precision dtype or its name, got {value!r}")
    return dtype


# -- the fake process group --------------------------------------------------------
@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of a fake default process group of ``world_size``, for the block.

    Raises:
        ValueError: a default process group is already up (it is left as it is).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("parallel='fsdp2' needs torch.distributed, which this build of torch lacks")
    if dist.is_initialized():
        raise ValueError(
            "parallel='fsdp2' runs FSDP2 over a fake process group of its own, and a process group is "
            "already initialised in this process: estimate before init_process_group(), or in another process"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class RankSetup:
    """One rank's set-up for the fake step: the context it runs in and what it does to the model.

    :meth:`context` puts up the fake process group and FSDP2's device mesh (outside the
    fake mode: the mesh reads its ranks' numbers); :meth:`__call__` wraps the fake model
    (``model -> (model to train, tensors to count from the start, by role)``).
    """

    def __init__(
        self, plan: ParallelPlan, world_size: int, rank: int, run_device: torch.device, target: torch.device | None = None
    ) -> None:
        if isinstance(plan, FSDP2) and run_device.type == "cpu" and not FSDP2_ON_CPU:
            from .step import EstimateUnsupported  # here: step imports this module

            raise EstimateUnsupported(
                f"parallel='fsdp2' runs torch's fully_shard on fake CPU tensors here (no GPU), which needs torch "
                f"2.6 or later: torch {torch.__version__}'s FSDP2 makes CUDA streams on any device. Estimate with "
                "torch 2.6 or later, on a machine with a GPU, or with parallel='ddp'"
            )
        self.plan = plan
        self.world_size = world_size
        self.rank = rank
        self.run_device = run_device
        self.target = target or run_device
        self.mesh: Any = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if not isinstance(self.plan, FSDP2):
            yield  # DDP is emulated: no process group
            return
        from torch.distributed.device_mesh import init_device_mesh

        with fake_process_group(self.world_size, self.rank):
            self.mesh = init_device_mesh(self.run_device.type, (self.world_size,))
            try:
                yield
            finally:
                self.mesh = None

    def __call__(self, model: nn.Module) -> tuple[nn.Module, dict[str, Callable[[], list[torch.Tensor]]]]:
        """The model to train and, by role, what holds the tensors of that role now: the step
        counts them from the start and gives their roles again at its end (DDP's buckets are
        rebuilt while it runs; FSDP2 pads a rank's uneven shards into new storages at its first forward)."""
        if isinstance(self.plan, FSDP2):
            # The mesh's rank map is a real tensor on the CPU whatever the mesh's device: it is
            # the target's memory only where the target is the CPU.
            mesh = _mesh_tensors(self.mesh) if self.target.type == "cpu" else []
            sharded = _shard(model, self.plan, self.mesh)
            return sharded, {"device_mesh": lambda: mesh, "weights": functools.partial(_sharded_storages, sharded)}
        reducer = _EmulatedReducer(model, self.plan)
        return model, {"ddp_buckets": lambda: list(reducer.buckets)}


def _sharded_storages(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's padded shards (``FSDPParam._sharded_param_data``): a rank whose shard is shorter
    than the others' keeps it in a padded storage of its own. Empty where torch's internals differ."""
    found = []
    for module in model.modules():
        try:
            group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        except Exception:  # noqa: BLE001 - not sharded, or another torch's internals: nothing named
            continue
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            data = getattr(fsdp_param, "_sharded_param_data", None)
            if isinstance(data, torch.Tensor):
                found.append(data)
    return found


def _mesh_tensors(mesh: Any) -> list[torch.Tensor]:
    """The CPU tensors a device mesh holds (its rank map: ``_rank_map``, or ``mesh`` in older torch)."""
    return [v for v in vars(mesh).values() if isinstance(v, torch.Tensor) and v.device.type == "cpu"]


# -- setting the model up --------------------------------------------------------------
def fully_shard_function() -> Callable[..., Any]:
    """torch's ``fully_shard``: ``torch.distributed.fsdp`` (2.6+) or ``_composable.fsdp`` (2.4, 2.5)."""
    try:
        from torch.distributed.fsdp import fully_shard  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    return fully_shard


def _mixed_precision_policy(dtype: torch.dtype) -> Any:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy  # type: ignore[no-redef]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fsdp_units(model: nn.Module, units: bool | Callable[[str, nn.Module], bool]) -> list[str]:
    """The names of the modules sharded before the root (outermost first as ``named_modules`` meets them)."""
    from .step import repeated_blocks

    if units is True:
        return repeated_blocks(model)
    if units is False:
        return []
    return [name for name, module in model.named_modules() if name and units(name, module)]


def _shard(model: nn.Module, plan: FSDP2, mesh: Any) -> nn.Module:
    fully_shard = fully_shard_function()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward}
    if plan.mixed_precision is not None:
        kwargs["mp_policy"] = _mixed_precision_policy(_dtype(plan.mixed_precision))
    modules = dict(model.named_modules())
    # innermost first: fully_shard of a unit that holds another unit takes only what is left
    for name in sorted(fsdp_units(model, plan.units), key=lambda n: -n.count(".")):
        fully_shard(modules[name], **kwargs)
    # the root's parameters are gathered through the step: FSDP2 keeps the root unresharded after forward
    fully_shard(model, **kwargs)
    return model


def bucket_assignment(tensors: Sequence[torch.Tensor], limits: Sequence[int]) -> list[list[int]]:
    """DDP's ``_compute_bucket_assignment_by_size``: the indices of ``tensors`` in each bucket.

    Tensors of one dtype and device fill a bucket, in order, until its bytes reach its
    limit: each dtype's first bucket takes ``limits[0]``, its next ``limits[1]``, and so
    on (the last repeats). Buckets closed so, then the ones left open, ordered by the
    smallest index they hold.

    Example::

        >>> mib = [torch.empty(1024, 256) for _ in range(4)]  # 1 MiB each
        >>> bucket_assignment(mib, [FIRST_BUCKET_BYTES, 25 * _MB]), bucket_assignment(mib, [sys.maxsize])
        ([[0], [1, 2, 3]], [[0, 1, 2, 3]])
    """
    closed: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, str], tuple[list[int], int]] = {}
    limit_at: dict[tuple[torch.dtype, str], int] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, str(t.device))
        members, size = open_buckets.get(key, ([], 0))
        members.append(i)
        size += t.numel() * t.element_size()
        at = limit_at.setdefault(key, 0)
        if size >= limits[at]:
            closed.append(members)
            members, size = [], 0
            limit_at[key] = min(at + 1, len(limits) - 1)
        open_buckets[key] = (members, size)
    closed += sorted((members for members, _ in open_buckets.values() if members), key=min)
    return closed


class _EmulatedReducer:
    """DDP's reducer as it treats memory, on the fake model (its C++ refuses fake tensors).

    ``buckets`` is the list of flat gradient buckets alive now, changed in place when they
    are rebuilt (the step holds the same list, to give the new ones their role).
    """

    def __init__(self, model: nn.Module, plan: DDP) -> None:
        self.plan = plan
        seen: set[int] = set()
        self.params: list[torch.Tensor] = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.buckets: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}
        #: parameter indices in the order the first backward made their gradients ready;
        #: ``None`` once the buckets are rebuilt (DDP rebuilds them once)
        self.ready: list[int] | None = []
        self._seen_ready: set[int] = set()
        # The first iteration's buckets: every parameter of a dtype in one
        # (``compute_bucket_size_limits``: no bucketing before the gradients' order is known).
        if self.params:
            self._make_buckets(list(range(len(self.params))), [sys.maxsize])
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, i))
        model.register_forward_pre_hook(self._pre_forward)

    def _make_buckets(self, order: list[int], limits: list[int]) -> None:
        params = [self.params[i] for i in order]
        for members in bucket_assignment(params, limits):
            flat = torch.empty(sum(params[m].numel() for m in members), dtype=params[members[0]].dtype, device=params[members[0]].device)
            self.buckets.append(flat)
            offset = 0
            for m in members:
                p = params[m]
                self.views[order[m]] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()

    def _gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """A gradient is ready: copied into its bucket; with ``gradient_as_bucket_view`` the
        gradient becomes the bucket's view (autograd's is dropped)."""
        if self.ready is not None and index not in self._seen_ready:
            self._seen_ready.add(index)
            self.ready.append(index)
        if param.grad is None:
            return
        view = self.views[index]
        view.copy_(param.grad)
        if self.plan.gradient_as_bucket_view:
            param.grad = view

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.ready and torch.is_grad_enabled():
            order, self.ready = self.ready, None
            order += [i for i in range(len(self.params)) if i not in self._seen_ready]  # parameters without a gradient
            # ``initialize_buckets``: the old buckets go (their views with them) before the new are made
            self.buckets.clear()
            self.views.clear()
            first = FIRST_BUCKET_BYTES if self.plan.bucket_cap_mb == 25.0 else int(self.plan.bucket_cap_mb * _MB)
            self._make_buckets(order, [first, int(self.plan.bucket_cap_mb * _MB)])
        # DDP reads the module's buffers again before each broadcast (they may have been replaced)
        buffers = [b for b in module.buffers() if b is not None] if self.plan.broadcast_buffers else []
        if buffers:
            _broadcast_buffers(buffers)


@torch.no_grad()
def _broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """``_broadcast_coalesced`` of DDP's buffers: per bucket, a flat copy (a bucket of one
    tensor goes as it is), :data:`BROADCASTS_IN_FLIGHT` at a time, each freed as it finishes."""
    in_flight: deque[torch.Tensor | None] = deque()
    with born_as(COLLECTIVE_ROLE):
        for members in bucket_assignment(buffers, [BROADCAST_BUCKET_BYTES]):
            if len(in_flight) >= BROADCASTS_IN_FLIGHT:
                in_flight.popleft()
            tensors = [buffers[m] for m in members]
            in_flight.append(torch.cat([t.contiguous().view(-1) for t in tensors]) if len(tensors) > 1 else None)
        in_flight.clear()


def what_ifs(spec: str) -> dict[str, dict[str, Any]]:
    """``compare=`` for strategies and world sizes: ``"ddp:2,fsdp2:2,fsdp2:8"``, named ``"ddp x2"``...

    Example::

        >>> what_ifs("ddp:2,fsdp2:8")
        {'ddp x2': {'parallel': 'ddp', 'world_size': 2}, 'fsdp2 x8': {'parallel': 'fsdp2', 'world_size': 8}}
    """
    out: dict[str, dict[str, Any]] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, size = item.partition(":")
        if name.lower() not in _NAMES or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"what-if {item!r}: expected STRATEGY:WORLD_SIZE with STRATEGY ddp or fsdp2, e.g. fsdp2:8")
        out[f"{name.lower()} x{int(size)}"] = {"parallel": name.lower(), "world_size": int(size)}
    return out
