"""A zoo model's training step built for real, and the independent counts it is checked against.

The step is the one ``estimate_memory`` runs: the forward under autocast (when the
entry has it), the loss outside it, backward, the optimizer step,
``zero_grad(set_to_none=True)``, the output and loss dropped. A uniform draw the forward
makes of at most ``SMALL_VALUE_NUMEL`` elements (LayerDrop's ``torch.rand([])``) is put at the
top of its range (:class:`UniformDrawsAt`), as ``estimate_memory``'s default puts it where
that step is the larger: the step a run meets that skips no layer, measured (LayerDrop's
``draw < p``; a model skipping on ``draw < keep_probability`` would need the bottom). The counts are made
apart from the profiler: ``untyped_storage().nbytes()`` of unique storages (a sparse
tensor's index and value storages), and what a ``saved_tensors_hooks`` pack hook saw.

Example::

    >>> import torch
    >>> from benchmarks.zoo import ZOO
    >>> run = Training(ZOO["neumf"], "small", torch.device("cpu"))
    >>> run.step()
    >>> storage_bytes(run.model.parameters()) == sum(p.numel() * 4 for p in run.model.parameters())
    True
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pytorch_mem_profiler.estimate.draws import SMALL_VALUE_NUMEL, at_an_end

from .registry import ZooModel


class UniformDrawsAt:
    """Small uniform draws (``torch.rand``, ``torch.rand_like``, ``Tensor.uniform_``: up to
    ``SMALL_VALUE_NUMEL`` elements, the values a step reads in Python) at an end of their range,
    ``"top"`` or ``"bottom"``, as ``estimate_memory`` gives them
    (:func:`~pytorch_mem_profiler.estimate.draws.at_an_end`). The three functions are wrapped for the
    block's length, not intercepted by a dispatch mode: a mode changes which kernels run (cuDNN's
    recurrent layers then copy their weights), and the measured step must be the user's."""

    _WRAPPED = ((torch, "rand", torch.ops.aten.rand.default), (torch, "rand_like", torch.ops.aten.rand_like.default),
                (torch.Tensor, "uniform_", torch.ops.aten.uniform_.default))  # fmt: skip

    def __init__(self, end: str = "top") -> None:
        self.end = end
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def _wrap(self, original: Any, op: Any) -> Any:
        end = self.end

        def drawn(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel() <= SMALL_VALUE_NUMEL:
                with torch.no_grad():
                    at_an_end(op, args, kwargs, out, end)
            return out

        return drawn

    def __enter__(self) -> UniformDrawsAt:
        for owner, name, op in self._WRAPPED:
            original = getattr(owner, name)
            self._saved.append((owner, name, original, name in vars(owner)))
            setattr(owner, name, self._wrap(original, op))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._saved:
            owner, name, original, own = self._saved.pop()
            if own:
                setattr(owner, name, original)
            else:  # inherited (Tensor.uniform_ from TensorBase): the shadow taken away
                delattr(owner, name)


def draws_as_estimated(entry: ZooModel) -> contextlib.AbstractContextManager:
    """Around a real forward of ``entry``: its small uniform draws at the top of their range
    (:class:`UniformDrawsAt`); a compiled model's draws are inside its graph, none there."""
    return UniformDrawsAt("top") if not entry.needs_compile else contextlib.nullcontext()


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj``'s tensors (in tuples, lists and dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_of(o)]
    return []


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if t.layout == torch.sparse_coo:
        return [t._indices().untyped_storage(), t._values().untyped_storage()]
    return [t.untyped_storage()]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors' unique storages (a sparse COO tensor: its indices' and values')."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        for s in _storages(t):
            seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class SavedStorages:
    """The user's own pack hook: unique storages autograd saves inside :meth:`hooks` and that are
    alive when the forward returns (a storage saved in a branch the forward drops is not kept for
    backward), the model's parameters and buffers left out (the forward's inputs kept: the
    profiler counts them under ``"(input)"``)."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {(str(t.device), t.untyped_storage().data_ptr()) for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict[tuple[str, int], tuple[weakref.ref, int]] = {}
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for s in _storages(t):
            key = (str(s.device), s.data_ptr())
            known = self.seen.get(key)
            if key not in self.skip and s.data_ptr() != 0 and (known is None or known[0]() is None):
                self.seen[key] = (weakref.ref(s), s.nbytes())  # new, or a dead one's address taken again
        # A saved output comes with the node that saves it: kept as it is, the two would hold each
        # other through C++ and a branch backward never reaches would stay allocated. Without hooks
        # autograd keeps it without its node; so does this hook.
        return t.detach() if t.grad_fn is not None else t

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.seen = {}
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield
        # the forward returned: what its saved storages still hold
        self.total = sum(nbytes for ref, nbytes in self.seen.values() if ref() is not None)


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


class Training:
    """``entry``'s model and optimizer at ``size`` on ``device``; :meth:`make_batch` then :meth:`step`.

    The batch is made by :meth:`make_batch` (call it where the run should count it, as
    ``estimate_memory`` counts the inputs it makes), or by the first :meth:`step`.
    """

    def __init__(self, entry: ZooModel, size: str, device: torch.device, batch_size: int | None = None, *, seed: int = 0) -> None:
        self.entry, self.size, self.device = entry, size, device
        self.batch_size = batch_size or entry.batch[size]
        torch.manual_seed(seed)
        self.model = entry.builder(size)().to(device)
        self.optimizer = entry.optimizer(self.model.parameters())
        self.inputs: Any = None
        self.targets: Any = None
        #: per step: unique ``.grad`` storages when backward ended, optimizer state after the step
        self.gradients: list[int] = []
        self.optimizer_state: list[int] = []

    def make_batch(self) -> None:
        self.inputs = to_device(self.entry.inputs(self.size)(self.batch_size), self.device)
        targets = to_device(self.entry.targets(self.size)(self.batch_size), self.device)
        self.targets = targets if isinstance(targets, tuple) else (targets,)

    def batch_bytes(self) -> int:
        return storage_bytes([*tensors_of(self.inputs), *tensors_of(self.targets)])

    def step(self, saved: SavedStorages | None = None) -> float:
        """One training step; ``saved`` (a pack hook) watches the forward. Returns the loss."""
        if self.inputs is None:
            self.make_batch()
        dtype = self.entry.autocast
        hooks = saved.hooks() if saved is not None else contextlib.nullcontext()
        autocast = torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
        with hooks, draws_as_estimated(self.entry), autocast:
            output = call(self.model, self.inputs)
        loss = self.entry.loss(output, *self.targets)
        loss.backward()
        self.gradients.append(storage_bytes(p.grad for p in self.model.parameters()))
        self.optimizer.step()
        # on the device profiled: AdamW's step counts stay on the CPU when the model is on a GPU
        state = [t for t in optimizer_state_tensors(self.optimizer) if t.device.type == self.device.type]
        self.optimizer_state.append(storage_bytes(state))
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        del output, loss
        return value
