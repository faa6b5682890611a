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
  done here as it documents it: one flat gradient bucket per group of parameters (in
  reverse order, by dtype, the first bucket capped at 1 MiB, the others at
  ``bucket_cap_mb``), made when the model is wrapped and kept; as a gradient is ready
  it is copied into its bucket; with ``gradient_as_bucket_view=True`` the gradient then
  *is* its view of the bucket (autograd's own gradient is dropped).

The fake process group lives only while the step runs; a process group already up in
the process is left alone (the estimate then refuses ``fsdp2``: it cannot make a
second default group).

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate import estimate_memory
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> one = estimate_memory(model, torch.zeros(8, 256), device="cpu", fit=False)
    >>> two = estimate_memory(model, torch.zeros(8, 256), device="cpu", fit=False, parallel="fsdp2", world_size=2)
    >>> two.weights * 2 == one.weights, two.gradients * 2 == one.gradients
    (True, True)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

__all__ = ["DDP", "FSDP2", "ParallelPlan", "RankSetup", "parse_parallel", "PARALLEL_ROLES", "fake_process_group"]

#: Roles the parallel set-up gives storages, and how the report names them: bytes alive
#: at the peak of each are in ``MemoryEstimate.parallel_parts`` (and in "other" of the breakdown).
PARALLEL_ROLES: Mapping[str, str] = {
    "ddp_buckets": "DDP gradient buckets",
    "regrown": "FSDP gathered parameters",
}

#: DDP's first bucket's cap (``dist._DEFAULT_FIRST_BUCKET_BYTES``) when ``bucket_cap_mb`` is left at its default.
FIRST_BUCKET_BYTES = 1024 * 1024
_MB = 1024 * 1024


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel``'s settings that change memory.

    Attributes:
        bucket_cap_mb: the buckets' cap in MiB (DDP's default 25).
        gradient_as_bucket_view: gradients are views of the buckets (no second copy).
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
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

    def __init__(self, plan: ParallelPlan, world_size: int, rank: int, run_device: torch.device) -> None:
        self.plan = plan
        self.world_size = world_size
        self.rank = rank
        self.run_device = run_device
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

    def __call__(self, model: nn.Module) -> tuple[nn.Module, dict[str, list[torch.Tensor]]]:
        if isinstance(self.plan, FSDP2):
            return _shard(model, self.plan, self.mesh), {}
        return _ddp_buckets(model, self.plan)


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


def bucket_groups(params: list[torch.Tensor], plan: DDP) -> list[list[torch.Tensor]]:
    """DDP's buckets: the parameters in reverse order, by dtype, each bucket filled up to its cap
    (the first at 1 MiB where ``bucket_cap_mb`` is the default 25, as ``DistributedDataParallel`` does)."""
    cap = int(plan.bucket_cap_mb * _MB)
    first_cap = FIRST_BUCKET_BYTES if plan.bucket_cap_mb == 25.0 else cap
    open_buckets: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    done: list[list[torch.Tensor]] = []
    for p in reversed(params):
        members, size = open_buckets.get(p.dtype, ([], 0))
        members.append(p)
        size += p.numel() * p.element_size()
        limit = first_cap if not done else cap
        if size >= limit:
            done.append(members)
            members, size = [], 0
        open_buckets[p.dtype] = (members, size)
    done += [members for members, _ in open_buckets.values() if members]
    return done


def _ddp_buckets(model: nn.Module, plan: DDP) -> tuple[nn.Module, dict[str, list[torch.Tensor]]]:
    seen: set[int] = set()
    params = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    buckets = []
    for members in bucket_groups(params, plan):
        flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
        buckets.append(flat)
        offset = 0
        for p in members:
            view = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(_ReadyGradient(view, plan.gradient_as_bucket_view))
    return model, {"ddp_buckets": buckets}


class _ReadyGradient:
    """DDP's reducer when a gradient is ready: copied into its bucket; with
    ``gradient_as_bucket_view`` the gradient becomes the bucket's view (autograd's is dropped)."""

    def __init__(self, view: torch.Tensor, as_view: bool) -> None:
        self.view = view
        self.as_view = as_view

    def __call__(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        self.view.copy_(param.grad)
        if self.as_view:
            param.grad = self.view


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
