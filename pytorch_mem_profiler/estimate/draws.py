"""Tiny tensors a step makes from nothing get real values in the fake mode, as a real step draws them.

A fake tensor has a shape and no values, so a step that reads a value refuses to
run fake (``.item()``, a Python ``if`` on a tensor). Some of the values a step
reads do not depend on its inputs or weights at all: LayerDrop (BART, mBART,
Whisper, wav2vec2, fairseq's ``LayerDropModuleList``) draws a number per layer
and compares it in Python (``if torch.rand([]) < self.layerdrop:``), a
stochastic-depth block may skip itself on ``torch.rand(1).item() < p``, a model
may pick a branch with ``torch.randint(0, 3, ()).item()``. A real step takes one
of the branches; so does the estimate.

While the step runs (not while the estimate makes its stand-ins for the inputs,
weights and buffers, which must stay without values), :class:`Draws` gives a
real value (FakeTensor's ``constant``) to a tensor of at most
:data:`SMALL_VALUE_NUMEL` elements that

- a random factory draws (``torch.rand([])``, ``torch.randint(0, 3, ())``,
  ``torch.randperm(12)``, ``torch.rand_like(x)``: a ``*_like`` or ``new_*``
  factory reads only its tensor argument's shape, dtype and device),
- a random operator makes from, or writes into, tensors that have values
  (``torch.bernoulli(p)`` of such a ``p``), or writes into a tensor a factory
  made that no operator has touched since (``torch.empty(n).uniform_()``,
  ``x.new_empty(()).bernoulli_(0.5)``: it gets its factory's value first),
- a factory that is not random makes with one element (``torch.zeros(())``, as
  torch's own ``torch.tensor(x)`` does), or that fills every element with one number
  (``torch.ones``, ``zeros``, ``full``, their ``new_*`` and ``*_like`` forms), of any
  dtype, up to :data:`HOST_VALUE_NUMEL` elements: a decoder given no attention mask
  makes one of ones, which transformers reads to skip it, as the real step does.
  Other larger ones (position ids from ``arange``) stay without values unless a random
  operator writes into them: values cost the fake mode its cache and real
  computation on every operator that reads them.

The fake mode computes on tensors with values as torch's own constant
propagation does, and keeps a result's value up to :data:`HOST_VALUE_NUMEL`
elements of any dtype (torch keeps one element): a slice of a drawn vector keeps
its values, and so does a mask of ones made additive in floating point
(``(1.0 - mask) * finfo.min``), which Longformer and LED read back to find their
global tokens. A Python number read from one of them is the real one.
Everything computed from an input, a weight, or anything else without a value
stays without one: reading it is refused as before, naming the operator and
the line.

A value on the GPU would be a real allocation there, which an estimate never makes. A fake
tensor of another device than the CPU (a fake CUDA tensor) keeps its value on the CPU beside it:
operators on such values run their fake kernel for the result's device, shape and strides, and
the CPU for its value (:meth:`Draws._device_values`). So a mask of ones a model makes on its
device (``torch.ones(batch, length, device=input_ids.device)``: OPT, BART and Pegasus given no
mask) is read by transformers, and a LayerDrop draw on the device is taken, in a fake CUDA step
as in a real one.

Random operators draw from a generator of the estimate's own, seeded with
:data:`SEED` at each fake step: every step an estimate runs (one per batch size
it fits) makes the same draws, the same as another estimate of the same model,
and the process's random-number state is left as it was (a ``generator=``
argument is not used). Each read of a drawn value is remembered with its line
(:attr:`Draws.reads`).

A run takes many steps, each with its own draws, and it needs the memory of the
largest: with LayerDrop at ``p > 0`` that is a step that skips no layer, which a
run of any length meets (at ``p = 0.1`` over 12 layers, 28% of its steps). So a
uniform draw (``torch.rand``, ``rand_like``, ``uniform_``) can be given a value
at an end of its range (:attr:`Draws.extreme`): ``"top"`` just below its upper
end, ``"bottom"`` its lower end. A branch taken on ``draw < p`` (BART's and
wav2vec2's LayerDrop, torchaudio's, fairseq's ``draws[i] > p``) then runs every
layer at the top, and one taken on ``draw < keep_probability`` at the bottom;
``estimate_memory`` runs the step at both ends where it read a drawn value and
keeps the larger (``random_draws="largest"``, the default), or takes the seeded
draws as they come (``random_draws="seeded"``). Other draws (``randint``,
``randperm``, ``bernoulli``, ``normal``) keep their seeded values: which of their
outcomes needs the most memory is no end of a range.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> mode = fake_mode()
    >>> with mode:
    ...     x = torch.empty(4, 8)                                  # a stand-in for an input: no values
    ...     with mode.draws.on():
    ...         skipped = bool(torch.rand([]) < 0.5)              # LayerDrop's draw, read in Python
    ...         try:
    ...             bool(x.sum() > 0)                              # the input's value: there is none
    ...         except Exception as err:
    ...             refused = type(err).__name__
    >>> refused, list(mode.draws.reads.values())
    ('DataDependentOutputException', [1])
    >>> mode.draws.extreme = "top"                                    # a uniform draw just below 1
    >>> with mode, mode.draws.on():
    ...     bool(torch.rand([]) < 0.999)
    False
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["SMALL_VALUE_NUMEL", "HOST_VALUE_NUMEL", "SEED", "Draws", "at_an_end", "user_line", "values_set_aside"]

#: Tensors of at most this many elements that a step makes from nothing get real values.
SMALL_VALUE_NUMEL = 256
#: Integer and boolean tensors with values the user gave (host data, the inputs' masks and
#: positions) keep them up to this many elements, and so do those computed from values alone.
HOST_VALUE_NUMEL = 1 << 20
#: The seed of the estimate's own generator, at the start of each fake step.
SEED = 0
#: The uniform draws :attr:`Draws.extreme` puts at an end of their range: (low, high) read from the
#: call's arguments by position and name; ``None``: [0, 1)
_UNIFORM: dict[str, tuple[tuple[int, str, float], tuple[int, str, float]] | None] = {
    "rand": None,
    "rand_like": None,
    "uniform_": ((1, "from", 0.0), (2, "to", 1.0)),
    "uniform": ((1, "from", 0.0), (2, "to", 1.0)),
}

_CPU = torch.device("cpu")
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def user_line(frames: list[traceback.FrameSummary]) -> str:
    """``file:line: code`` of the innermost frame outside torch and this package (``""``: none).

    That is the line in the user's or a library's code (``modeling_bart.py``, say) whose call
    read a value: what a user needs to change or to report. Where every frame is torch's or this
    package's (an optimizer's step), the innermost one in ``torch.optim`` or ``torch.nn``.
    """
    torch_dir = Path(torch.__file__).resolve().parent
    ours = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parent
    # folders end in a separator: torchvision's and torchaudio's files are not torch's
    skip = tuple(os.path.join(str(d), "") for d in (torch_dir, ours))
    public = tuple(os.path.join(str(d), "") for d in (torch_dir / "optim", torch_dir / "nn"))
    for wanted in (lambda f: not f.startswith(skip), lambda f: f.startswith(public)):
        for frame in reversed(frames):
            if frame.filename and wanted(str(Path(frame.filename).resolve())):
                code = f": {frame.line.strip()}" if frame.line else ""
                return f"{frame.filename}:{frame.lineno}{code}"
    return ""


def _tag(func: Any, name: str) -> bool:
    tag = getattr(torch.Tag, name, None)
    return tag is not None and tag in getattr(func, "tags", ())


def _op_name(func: Any) -> str:
    """An operator's name without its namespace (``empty_like``), ``""`` for other callables."""
    return getattr(getattr(func, "_schema", None), "name", "").split("::")[-1]


def _reads_metadata_only(func: Any) -> bool:
    """``*_like`` and ``new_*`` factories: their tensor argument gives a shape, dtype and device."""
    name = _op_name(func)
    return name.endswith("_like") or name.startswith("new_")


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    """The arguments, lists among them opened one level (as operators' schemas nest them)."""
    out: list[Any] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            out.extend(v)
        else:
            out.append(v)
    return out


_RETURNS_TENSORS: dict[int, bool] = {}


def _makes_tensors(func: Any) -> bool:
    """Whether every return of ``func`` is a tensor (or a list of them); decided once per operator."""
    found = _RETURNS_TENSORS.get(id(func))
    if found is None:
        returns = getattr(getattr(func, "_schema", None), "returns", ())
        found = bool(returns) and all("Tensor" in str(r.type) for r in returns)
        _RETURNS_TENSORS[id(func)] = found
    return found


def _small(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel() <= SMALL_VALUE_NUMEL


def _input_sized(t: Any) -> bool:
    """An integer or boolean tensor small enough to keep the value the user gave it (a mask, positions)."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout is torch.strided
        and not (t.is_floating_point() or t.is_complex())
        and t.numel() <= HOST_VALUE_NUMEL
    )


#: factories that fill every element with one number (a mask of ones, a zero start): their
#: values cost one fill, whatever their dtype
_FILLS = frozenset(
    {"ones", "zeros", "full", "new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like", "scalar_tensor"}
)


def _fill(func: Any) -> bool:
    return _op_name(func) in _FILLS


#: Factories whose values follow from their arguments alone, as a fill's do: ranges of indices and
#: positions (``torch.arange(batch)`` indexing a mask, position ids), grids, identities.
_RANGES = frozenset({"arange", "linspace", "logspace", "eye", "tril_indices", "triu_indices"})


def range_sized(t: Any) -> bool:
    """A range small enough to get its value: integer ones up to :data:`HOST_VALUE_NUMEL` elements
    (indices, positions), floating-point ones up to :data:`SMALL_VALUE_NUMEL` (a sinusoidal table
    made from a range each step would otherwise be computed for real in every estimate)."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return False
    return t.numel() <= (SMALL_VALUE_NUMEL if t.is_floating_point() or t.is_complex() else HOST_VALUE_NUMEL)


def value_sized(t: Any) -> bool:
    """An operator's result computed from values alone that is small enough to keep its value: up to
    :data:`HOST_VALUE_NUMEL` elements of any dtype. Masks are integer or boolean when the user gives
    them, and floating-point once a model turns them into additive ones (``(1.0 - mask) *
    finfo.min``, a row of a batch of sequences); Longformer and LED read theirs back
    (``is_index_global_attn.flatten().any().item()``), as a real step does."""
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel() <= HOST_VALUE_NUMEL


def _fill_sized(t: Any) -> bool:
    """A tensor a fill factory made that is small enough to carry its value (of any dtype)."""
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel() <= HOST_VALUE_NUMEL


def _uninitialized(func: Any) -> bool:
    """``empty``-like factories: their values are whatever memory held, never the user's."""
    return "empty" in _op_name(func)


class Draws:
    """One fake mode's real values for tiny tensors made from nothing, and the reads of drawn ones.

    Attributes:
        reads: ``file:line: code`` of each line that read a value drawn at random, and how often.
    """

    def __init__(self, seed: int = SEED, extreme: str | None = None) -> None:
        self.seed = seed
        #: ``"top"``/``"bottom"``: uniform draws take that end of their range (see the module);
        #: ``None``: the seeded values
        self.extreme = extreme
        self.active = False
        #: while the step's inputs are made (see :meth:`inputs`)
        self.making_inputs = False
        #: while the optimizer is built (see :meth:`settings`): the user's floating-point scalars too
        self._settings = False
        self._host: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.reads: dict[str, int] = {}
        self._state: torch.Tensor | None = None
        self._drawn: dict[int, weakref.ref] = {}
        #: tensors a factory made, not random, of more than one element, that no operator has
        #: touched since: (the tensor, the factory, its arguments made real for the CPU)
        self._fresh: dict[int, tuple[weakref.ref, Any, tuple, dict]] = {}
        #: while the optimizer's step runs: a number read from a tensor without a value gets a
        #: stand-in (see :meth:`stand_ins_in_step`); the lines that read one, and how often
        self.standing_in = False
        self.stand_ins: dict[str, int] = {}
        #: whether a fake tensor of another device than the CPU holds a value (kept on the CPU):
        #: operators on it then come here whether or not a step runs (see :meth:`_device_values`)
        self.kept_elsewhere = False

    @contextlib.contextmanager
    def on(self) -> Iterator[Draws]:
        """Give values for the length of a step; the generator starts from :attr:`seed`."""
        with no_dispatch():
            self._state = torch.Generator().manual_seed(self.seed).get_state()
        self.active = True
        try:
            with _tolist_by_items():
                yield self
        finally:
            self.active = False

    @contextlib.contextmanager
    def inputs(self) -> Iterator[Draws]:
        """While the step's inputs are made: what the user fixed keeps its values.

        Integer and boolean tensors (up to :data:`HOST_VALUE_NUMEL` elements) that a factory
        which is not random makes (``torch.ones(b, s, dtype=torch.long)``: an attention mask with
        no padding; ``torch.arange``), host tensors the inputs' function reads (position ids kept
        in a closure), and what is computed from them alone keep their values, so a library that
        reads them (transformers skips a mask of ones) decides as the real step does; so do tensors
        a fill factory makes, of any dtype (``torch.ones(b, s)``: a floating-point mask). Random
        ones (``torch.randint`` token ids) stand for data the estimate does not have, and other
        floating-point ones for data the step computes on: both stay without values.
        """
        self.making_inputs = True
        try:
            yield self
        finally:
            self.making_inputs = False
            self._host.clear()

    @contextlib.contextmanager
    def settings(self) -> Iterator[Draws]:
        """While the optimizer is built: the user's own small host tensors among its settings
        (``lr=torch.tensor(1e-3)``, tensor ``betas``) come in with their values, of any dtype, as the
        inputs' integer ones do (:meth:`inputs`): the constructor checks them in Python
        (``if not 0.0 <= lr``), as the real one does."""
        self._settings = True
        try:
            with self.inputs():
                yield self
        finally:
            self._settings = False

    @contextlib.contextmanager
    def stand_ins_in_step(self) -> Iterator[Draws]:
        """While an optimizer's step runs: a Python number read from a tensor without a value
        (Adafactor's ``param.norm(2).item()`` scaling its update) is 1 (``True``), and the line is noted.

        Such a number scales an update in place; what the step allocates does not follow it. A read
        outside the optimizer's step is still refused, naming the line.
        """
        self.standing_in = True
        try:
            yield self
        finally:
            self.standing_in = False

    def _stand_in(self, tensor: Any) -> Any:
        """A stand-in number for ``aten._local_scalar_dense`` of ``tensor``, which has no value."""
        line = user_line(traceback.extract_stack()) or str(_LOCAL_SCALAR)
        self.stand_ins[line] = self.stand_ins.get(line, 0) + 1
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool:
            return True
        if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex()):
            return 1.0
        return 1

    def host_value(self, mode: Any, real: torch.Tensor) -> torch.Tensor:
        """A real CPU tensor the user gave, as a fake one with its value (a copy: the step never
        writes into the user's tensor); the same fake for the same tensor. Others as they are."""
        sized = _input_sized(real) or (self._settings and real.numel() <= SMALL_VALUE_NUMEL)
        if type(real) not in _PLAIN or mode.is_our_fake(real) or real.device.type != "cpu" or not sized:
            return real
        known = self._host.get(id(real))
        if known is not None and known[0]() is real:
            return known[1]
        with no_dispatch():
            copy = real.detach().clone()
        fake = mode.fake_tensor_converter.from_real_tensor(mode, copy, make_constant=True)
        self._host[id(real)] = (weakref.ref(real), fake)
        return fake

    # -- what the fake mode asks ----------------------------------------------------
    def dispatch(self, mode: Any, func: Any, args: tuple, kwargs: dict, fallback: Callable[..., Any]) -> Any:
        """``func`` under ``mode``: with real values where the rules give them, else ``fallback``'s
        fake result; values read from drawn tensors are noted."""
        flat = _flat(args, kwargs)
        if _device_valued(flat, kwargs) and isinstance(func, torch._ops.OpOverload) and _makes_tensors(func):
            if not _tag(func, "nondeterministic_seeded"):  # random ones: drawn below, as on the CPU
                return self._device_values(mode, func, args, kwargs, flat, fallback)
        if not (self.active or self.making_inputs):
            return fallback(func, args, kwargs)
        if self.making_inputs and not self.active:
            return self._input_values(mode, func, args, kwargs, fallback)
        fakes = []
        for v in flat:
            if isinstance(v, torch.Tensor):
                if mode.is_our_fake(v):
                    fakes.append(v)
                elif type(v) not in _PLAIN:
                    return fallback(func, args, kwargs)  # a wrapper subclass (DTensor): its own dispatch unwraps it
        out: Any = NotImplemented
        if isinstance(func, torch._ops.OpOverload) and _makes_tensors(func):
            random = _tag(func, "nondeterministic_seeded")
            if not fakes or _reads_metadata_only(func):
                out = self._made(mode, func, args, kwargs, fallback, random)
            elif random:
                out = self._redrawn(mode, func, args, kwargs, fallback, fakes)
        self._used(fakes)
        if out is NotImplemented:
            if self.standing_in and func is _LOCAL_SCALAR and fakes and all(getattr(t, "constant", None) is None for t in fakes):
                return self._stand_in(args[0] if args else None)
            out = fallback(func, args, kwargs)
            if self._drawn and any(self.is_drawn(t) for t in fakes):
                if _tag(func, "data_dependent_output"):  # .item(), a Python `if` on a tensor
                    line = user_line(traceback.extract_stack()) or str(func)
                    self.reads[line] = self.reads.get(line, 0) + 1
                else:
                    self._mark(out, mode)
        return out

    def _device_values(self, mode: Any, func: Any, args: tuple, kwargs: dict, flat: list[Any], fallback: Callable[..., Any]) -> Any:
        """An operator on a tensor of another device than the CPU that holds its value (or that
        makes one there from values): the fake result from torch's fake kernel, and its value
        computed on the CPU from the arguments' values and kept beside it.

        A fake tensor's value is a real tensor that torch's own constant propagation computes
        with and returns as a fake tensor of the value's device; a value on a GPU would be a real
        allocation there, which an estimate never makes. So a fake CUDA tensor keeps its value on
        the CPU, and operators on such values are run here: the fake kernel gives the result its
        device, shape and strides, the CPU its value. Where some argument has no value, or the
        result is too large to carry one, the result has none, and a value written into in place
        is dropped from every tensor sharing it (as torch's constant propagation does).
        """
        if func in _INDEXING:
            args, kwargs = self._masks_as_positions(mode, func, args, kwargs, fallback)
            flat = _flat(args, kwargs)
        everything = all(getattr(t, "constant", None) is not None for t in flat if isinstance(t, torch.Tensor) and mode.is_our_fake(t))
        written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        # an operator whose result's shape is its arguments' values (``nonzero``, ``unique``,
        # ``masked_select``): the fake kernel, with the values set aside, cannot say it (ViLT finds the
        # patches its pixel mask keeps with ``x_mask.nonzero()``): the CPU's result gives the shape
        by_values = everything and not written and _tag(func, "dynamic_output_shape")
        real = self._real_result(mode, func, args, kwargs) if by_values else None
        # set aside: torch's constant propagation would return the result on the values' device
        with values_set_aside(flat) as valued:
            if real is not None:
                device = next(t.device for t in flat if isinstance(t, torch.Tensor) and mode.is_our_fake(t) and t.device.type != "cpu")
                out = tree_map(lambda r: _empty_as(r, device, fallback), real)
            else:
                out = fallback(func, args, kwargs)
        if everything and not by_values:
            real = self._real_result(mode, func, args, kwargs)
        if written and real is None:
            for name, t in _named_arguments(func, args, kwargs):
                if name in written and isinstance(t, torch.Tensor) and getattr(t, "constant", None) is not None:
                    mode.fake_tensor_converter.invalidate_constant_aliases(t.constant)
        self._used(t for t in flat if isinstance(t, torch.Tensor))
        if written or real is None:
            return out  # written in place: the values were written on the CPU as well
        real_flat, _ = tree_flatten(real)
        out_flat, _ = tree_flatten(out)
        if len(real_flat) == len(out_flat):
            for r, o in zip(real_flat, out_flat):
                if (
                    isinstance(o, torch.Tensor) and mode.is_our_fake(o) and o.constant is None and isinstance(r, torch.Tensor)
                    and r.shape == o.shape and r.dtype == o.dtype and mode.may_turn_const(r)
                ):  # fmt: skip
                    self._keep_value(mode, o, r)
        if self._drawn and any(self.is_drawn(t) for t, _ in valued):
            self._mark(out, mode)  # computed from a draw: reading it is noted, as on the CPU
        return out

    def _real_result(self, mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` run on the CPU on its arguments' values; ``None`` where the CPU cannot compute it
        (the result then has no value)."""
        try:
            real_args, real_kwargs = tree_map(lambda v: _value_on_cpu(v, mode), (args, kwargs))
            return self._run(func, real_args, _on_cpu(real_kwargs), False)
        except Exception:  # noqa: BLE001 - a value the CPU cannot compute: the result has none
            return None

    def _masks_as_positions(self, mode: Any, func: Any, args: tuple, kwargs: dict, fallback: Callable[..., Any]) -> tuple[tuple, dict]:
        """Indexing by a boolean mask whose value is kept (SpecAugment's time mask from numpy, sent
        to the GPU: ``hidden[mask] = embedding``): the mask as the positions it selects, one
        integer index per masked dimension with its value, as the kernel itself expands it
        (``nonzero``), so that the fake kernel, which cannot read a mask without its value (it
        is set aside for the call, see :meth:`_device_values`), is given the shapes the real
        step has."""
        position = next(i for i, a in enumerate(func._schema.arguments) if a.name == "indices")
        indices = args[position] if position < len(args) else kwargs.get("indices")
        if not isinstance(indices, (list, tuple)) or not any(_valued_mask(i) for i in indices):
            return args, kwargs
        expanded: list[Any] = []
        for index in indices:
            if not _valued_mask(index):
                expanded.append(index)
                continue
            with no_dispatch():
                columns = [c.contiguous() for c in index.constant.cpu().nonzero(as_tuple=True)]
            for column in columns:
                made = fallback(torch.ops.aten.empty_strided.default, (tuple(column.shape), (1,)),
                                {"dtype": column.dtype, "device": index.device})  # fmt: skip
                self._keep_value(mode, made, column)
                expanded.append(made)
        if position < len(args):
            return (*args[:position], expanded, *args[position + 1 :]), kwargs
        return args, {**kwargs, "indices": expanded}

    def _used(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` an operator read: no longer untouched since their factory (see ``_fresh``)."""
        for t in tensors:
            self._fresh.pop(id(t), None)

    def placed(self, mode: Any, fake: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        """``fake`` (an input made on the estimated device) holding ``value``, the user's value of
        the tensor it stands for, where that value is a real CPU tensor of its shape and dtype that
        :meth:`inputs` would have kept (an attention mask of ones made on the CPU and sent to the
        GPU); else ``fake`` as it is. A value for another device than the CPU is kept beside the
        fake tensor, as :meth:`_device_values` keeps what operators compute from it."""
        if (
            value is None or not isinstance(value, torch.Tensor) or type(value) not in _PLAIN or mode.is_our_fake(value)
            or value.device.type != "cpu" or value.shape != fake.shape or value.dtype != fake.dtype
            or not (_fill_sized(value) if value.is_floating_point() else _input_sized(value))
        ):  # fmt: skip
            return fake
        self._keep_value(mode, fake, value)
        return fake

    def _keep_value(self, mode: Any, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``real`` (on the CPU) kept as ``fake``'s value, whatever ``fake``'s device."""
        fake.constant = _dense_like(real, fake)
        mode.fake_tensor_converter.add_constant_storage_mapping(fake)
        self.kept_elsewhere = self.kept_elsewhere or fake.device.type != "cpu"

    def is_drawn(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s value came from a random draw (and it still holds it)."""
        ref = self._drawn.get(id(t))
        return ref is not None and ref() is t and getattr(t, "constant", None) is not None

    # -- the rules --------------------------------------------------------------------
    def _input_values(self, mode: Any, func: Any, args: tuple, kwargs: dict, fallback: Callable[..., Any]) -> Any:
        """While inputs are made: deterministic integer and boolean factories give their values;
        host tensors read come in with theirs (:meth:`inputs`)."""
        if func in getattr(mode, "lift_fns", ()):  # torch.tensor(data): the fake mode's own (see may_turn_const)
            return fallback(func, args, kwargs)
        # an optimizer's state made when it is built (Adagrad's sums) is the step's, without values
        if not self._settings and isinstance(func, torch._ops.OpOverload) and _makes_tensors(func):
            makes_from_nothing = not any(isinstance(v, torch.Tensor) for v in _flat(args, kwargs))
            if (makes_from_nothing or _reads_metadata_only(func)) and not _tag(func, "nondeterministic_seeded") and not _uninitialized(func):
                fake = fallback(func, args, kwargs)
                results = fake if isinstance(fake, (list, tuple)) else [fake]
                sized = _fill_sized if _fill(func) else _input_sized
                if not results or not all(sized(t) for t in results if isinstance(t, torch.Tensor)):
                    return fake
                real_args, real_kwargs = _real_arguments(mode, func, args, kwargs)
                return self._as_values(mode, self._run(func, real_args, real_kwargs, False), fake, False)
        args, kwargs = tree_map(lambda v: self.host_value(mode, v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        return fallback(func, args, kwargs)

    def _made(self, mode: Any, func: Any, args: tuple, kwargs: dict, fallback: Callable[..., Any], random: bool) -> Any:
        """A factory: the fake result first (its shapes), then, if it is small, its real value (a
        random one); a factory's result that is not random gets its value when a fill or a range
        makes it (:data:`_FILLS`, :data:`_RANGES`), when it has one element (as torch's own
        ``torch.tensor(x)``) or, else, when a random operator first writes into it."""
        fake = fallback(func, args, kwargs)
        results = fake if isinstance(fake, (list, tuple)) else [fake]
        if not random and results and (
            (_fill(func) and all(_fill_sized(t) for t in results))
            or (_op_name(func) in _RANGES and all(range_sized(t) for t in results))
        ):
            # a mask of ones the model makes itself (a decoder given no attention mask): a library
            # reads it (transformers skips a mask of ones) as the real step does; and a range it
            # indexes by (Speech2Text's and wav2vec2's mask of the subsampled frames is written at
            # torch.arange(batch)): without its value the mask it makes has none either
            real_args, real_kwargs = _real_arguments(mode, func, args, kwargs)
            return self._as_values(mode, self._run(func, real_args, real_kwargs, False), fake, False)
        if not results or not all(_small(t) for t in results if isinstance(t, torch.Tensor)):
            return fake
        # the factory's arguments with real stand-ins for its tensors: kept, they keep no fake alive
        real_args, real_kwargs = _real_arguments(mode, func, args, kwargs)
        if not random and not all(t.numel() <= 1 for t in results if isinstance(t, torch.Tensor)):
            if isinstance(fake, torch.Tensor):
                self._fresh[id(fake)] = (weakref.ref(fake), func, real_args, real_kwargs)
            return fake
        real = self._run(func, real_args, real_kwargs, random)
        return self._as_values(mode, real, fake, random)

    def _redrawn(self, mode: Any, func: Any, args: tuple, kwargs: dict, fallback: Callable[..., Any], fakes: list[torch.Tensor]) -> Any:
        """A random operator on tensors with values: drawn for real, in place or into a new tensor.

        The tensor written in place may also be one a factory made that no operator has touched
        since (``torch.empty(n).uniform_()``): it gets its factory's value first.
        """
        written = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        target = args[written[0]] if written and written[0] < len(args) else None
        if written and isinstance(target, torch.Tensor) and mode.is_our_fake(target) and target.constant is None:
            fresh = self._fresh.get(id(target))
            if fresh is None or fresh[0]() is not target:
                return NotImplemented
            _, factory, f_args, f_kwargs = fresh
            placed = _dense_like(self._run(factory, f_args, f_kwargs, False), target)
            if placed.shape != target.shape or placed.stride() != target.stride():
                return NotImplemented
            self._keep_value(mode, target, placed)
        if not all(t.constant is not None for t in fakes):
            return NotImplemented
        if written:
            if not isinstance(target, torch.Tensor) or not mode.is_our_fake(target) or not _small(target):
                return NotImplemented
            real_args, real_kwargs = tree_map(lambda v: _value_on_cpu(v, mode), (args, kwargs))
            self._run(func, real_args, _on_cpu(real_kwargs), True)
            with no_dispatch():
                target.constant.copy_(real_args[written[0]])  # the value aliases of it share
            self._drawn[id(target)] = weakref.ref(target)
            return target
        fake = fallback(func, args, kwargs)
        results = fake if isinstance(fake, (list, tuple)) else [fake]
        if not results or not all(_small(t) for t in results if isinstance(t, torch.Tensor)):
            return fake
        real_args, real_kwargs = tree_map(lambda v: _value_on_cpu(v, mode), (args, kwargs))
        real = self._run(func, real_args, _on_cpu(real_kwargs), True)
        return self._as_values(mode, real, fake, True)

    def _run(self, func: Any, args: tuple, kwargs: dict, random: bool) -> Any:
        """``func`` for real on the CPU, drawing from the estimate's generator if ``random`` (a
        uniform draw then at :attr:`extreme`'s end of its range, where one is set)."""
        with no_dispatch():
            if not random:
                return func(*args, **kwargs)
            saved = torch.random.get_rng_state()
            assert self._state is not None
            torch.random.set_rng_state(self._state)
            try:
                out = func(*args, **kwargs)
            finally:
                self._state = torch.random.get_rng_state()
                torch.random.set_rng_state(saved)
            if self.extreme is not None:
                at_an_end(func, args, kwargs, out, self.extreme)
            return out

    def _as_values(self, mode: Any, real: Any, fake: Any, drawn: bool) -> Any:
        """``real``'s tensors as fake tensors with those values, on ``fake``'s devices (``fake`` where
        a value cannot live on its device here, or the shapes differ)."""
        real_flat, _ = tree_flatten(real)
        fake_flat, spec = tree_flatten(fake)
        if len(real_flat) != len(fake_flat):
            return fake
        made = []
        for r, f in zip(real_flat, fake_flat):
            if not isinstance(f, torch.Tensor):
                made.append(f)
                continue
            if not isinstance(r, torch.Tensor) or r.shape != f.shape or r.dtype != f.dtype:
                return fake
            if f.device.type == "cpu":
                value = mode.fake_tensor_converter.from_real_tensor(mode, _dense_like(r, f), make_constant=True)
            else:  # kept on the CPU beside the fake tensor: see _device_values
                self._keep_value(mode, f, r)
                value = f
            if drawn:
                self._drawn[id(value)] = weakref.ref(value)
            made.append(value)
        return tree_unflatten(made, spec)

    def _mark(self, out: Any, mode: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and mode.is_our_fake(t) and t.constant is not None:
                self._drawn[id(t)] = weakref.ref(t)


def at_an_end(func: Any, args: tuple, kwargs: dict, out: Any, extreme: str) -> None:
    """A uniform draw's values (``out``, written in place) at ``extreme``'s end of its range: its low
    end at the bottom, one step of its dtype's precision below its high end at the top; any other
    call's output is left as it is. A real step given the same ends takes the estimate's branches.

    Example::

        >>> out = torch.rand(3)
        >>> at_an_end(torch.ops.aten.rand.default, ([3],), {}, out, "top")
        >>> bool((out < 1).all()) and bool((out > 0.9999).all())
        True
    """
    name = _op_name(func)
    if name not in _UNIFORM or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return
    ends = _UNIFORM[name]
    if ends is None:
        low, high = 0.0, 1.0
    else:
        (i, key, default), (j, key2, default2) = ends
        low = float(args[i]) if len(args) > i else float(kwargs.get(key, default))
        high = float(args[j]) if len(args) > j else float(kwargs.get(key2, default2))
    if extreme == "bottom":
        out.fill_(low)
        return
    # a step of the dtype's precision below the top, more where the top is far from zero
    step = (high - low) * torch.finfo(out.dtype).eps
    value = high
    while value >= high and step < high - low:
        value = torch.tensor(high - step, dtype=torch.float64).to(out.dtype).item()
        step *= 2
    out.fill_(max(value, low) if value < high else low)


def _empty_as(real: Any, device: torch.device, fallback: Callable[..., Any]) -> Any:
    """A fake tensor on ``device`` with ``real``'s shape and dtype (``real`` itself if not a tensor)."""
    if not isinstance(real, torch.Tensor):
        return real
    return fallback(torch.ops.aten.empty.memory_format, (tuple(real.shape),), {"dtype": real.dtype, "device": device})


@contextlib.contextmanager
def values_set_aside(values: Iterable[Any]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The fake tensors among ``values`` without their values (FakeTensor's ``constant``) for the
    block, which gets the ``(tensor, value)`` pairs set aside; the values are put back after it."""
    held = [(t, t.constant) for t in values if isinstance(t, torch.Tensor) and getattr(t, "constant", None) is not None]
    for t, _ in held:
        t.constant = None
    try:
        yield held
    finally:
        for t, value in held:
            t.constant = value


@contextlib.contextmanager
def _tolist_by_items() -> Iterator[None]:
    """``tolist()`` of a fake tensor read element by element (``item()``), as torch 2.5 and later
    read it: torch 2.4 makes a symbol per element, which needs a shape environment and ignores a
    drawn value (``torch.randperm(3)[:2].tolist()``). Nothing changes on other releases."""
    from torch._subclasses.fake_tensor import FakeTensor

    from ..torch_versions import fake_tolist_reads_values

    if fake_tolist_reads_values():
        yield
        return
    original = FakeTensor.__dict__["tolist"]

    def tolist(self: torch.Tensor) -> Any:
        if self.dim() == 0:
            return self.item()
        return [element.tolist() for element in self]

    FakeTensor.tolist = tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        FakeTensor.tolist = original  # type: ignore[method-assign]


def _on_cpu(kwargs: dict) -> dict:
    """Keyword arguments of a factory made for the CPU, without the caller's generator."""
    out = dict(kwargs)
    if "device" in out:
        out["device"] = _CPU
    if "generator" in out:
        out["generator"] = None
    if out.get("pin_memory"):
        out["pin_memory"] = False
    return out


def _real_arguments(mode: Any, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A factory's arguments to run it for real on the CPU: real stand-ins for its fake tensors
    (:func:`_stand_in`), its keywords made for the CPU (:func:`_on_cpu`)."""
    real_args, real_kwargs = tree_map(lambda v: _stand_in(func, v) if isinstance(v, torch.Tensor) and mode.is_our_fake(v) else v, (args, kwargs))
    return real_args, _on_cpu(real_kwargs)


def _stand_in(func: Any, t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor standing in for a factory's tensor argument: ``new_*`` read its dtype
    only (an empty one), ``*_like`` its shape too (as small as their result)."""
    with no_dispatch():
        if _op_name(func).startswith("new_"):
            return torch.empty((0,), dtype=t.dtype, device=_CPU)
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=_CPU)


def _dense_like(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``real`` with ``fake``'s strides (a ``*_like`` result follows its argument's layout)."""
    if real.stride() == fake.stride():
        return real
    with no_dispatch():
        return torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=real.dtype, device=real.device).copy_(real)


def _value_on_cpu(v: Any, mode: Any) -> Any:
    if isinstance(v, torch.Tensor) and mode.is_our_fake(v):
        with no_dispatch():
            return v.constant if v.constant.device.type == "cpu" else v.constant.cpu()
    return v


#: Operators that index by a list of tensors, where a boolean one is a mask over as many dimensions.
_INDEXING = frozenset(
    {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}
)


def _valued_mask(t: Any) -> bool:
    """A boolean (or ``uint8``) index of another device than the CPU that holds its value."""
    return (
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) and t.device.type != "cpu"
        and getattr(t, "constant", None) is not None
    )  # fmt: skip


def _device_valued(flat: list[Any], kwargs: dict) -> bool:
    """Whether an operator's arguments hold a value for another device than the CPU: a fake tensor
    of another device with its value (kept on the CPU), or a value sent to another device."""
    valued = False
    for v in flat:
        if isinstance(v, torch.Tensor) and getattr(v, "constant", None) is not None:
            if v.device.type != "cpu":
                return True
            valued = True
    if not valued:
        return False
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != "cpu"


def _named_arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each argument of an operator's call, by its schema."""
    for a, v in zip(func._schema.arguments, args):
        yield a.name, v
    yield from kwargs.items()
