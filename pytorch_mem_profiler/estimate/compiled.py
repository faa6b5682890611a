"""``torch.compile``'d modules in the fake step, run as Inductor runs them: partitioned, fused, planned.

A compiled module (``torch.compile(model)``'s ``OptimizedModule``, or a module after
``module.compile()``) does not keep what its eager forward keeps for backward: AOTAutograd
traces forward and backward as one graph and Inductor's partitioner
(``min_cut_rematerialization_partition``) chooses what the forward saves, recomputing cheap
values in backward; Inductor then fuses pointwise operations into kernels whose intermediates
are never allocated, frees each buffer after its last use, reuses freed buffers and orders its
kernels for a lower peak. On the zoo's compiled MLP the uncompiled estimate was 5.6% over the
H100's peak.

:class:`CompiledModules` replaces each compiled module of the fake model by a
:class:`CompiledModule` that does the same on fake tensors: the first call traces the joint
graph with AOTAutograd under the estimate's fake mode, with Inductor's decompositions and
partitioner (nothing is counted while it traces), and each forward and backward graph runs
with :class:`GraphRun`, which counts only what Inductor would allocate, when it would
(:mod:`.inductor_plan`).

What is not estimated as compiled runs the module's eager forward, and the estimate's notes
say so, with an error bound (:meth:`CompiledModules.bounds`): a backend other than Inductor
(``backend="eager"`` runs the captured graphs as they are: estimated exactly as uncompiled, no
bound); CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``) on CUDA; graph breaks
(:mod:`.graph_breaks`: each graph would be partitioned apart); a trace that fails under the fake
mode. ``dynamic=True`` is estimated at the step's shapes (Inductor's symbolic graph allocates the
same buffers).

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate import estimate_memory
    >>> model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)))
    >>> est = estimate_memory(model, torch.zeros(32, 64), device="cpu", fit=False)
    >>> # est.notes[0]: "torch.compile'd model: estimated as compiled (Inductor's partition, fusion and
    >>> # memory planning)"; on torch 2.4, "... estimated uncompiled: ..." and why
    >>> from pytorch_mem_profiler.torch_versions import INDUCTOR_PLAN_MODELLED
    >>> ("estimated as compiled" in est.notes[0]) == INDUCTOR_PLAN_MODELLED
    True
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..torch_versions import INDUCTOR_PLAN_MODELLED
from .fake import walk_modules
from .graph_breaks import graph_breaks, remembered_breaks
from .inductor_plan import layout_optimized, channels_last_inputs, plan_graph, storage_key
from .output_trees import from_tree, to_tree

__all__ = ["CompileOptions", "compile_options", "is_compiled", "GraphRun", "CompiledModule", "CompiledModules"]


class GraphRun:
    """Runs one partitioned graph on fake tensors, counting only what :func:`plan_graph` says is
    allocated. Boxed (``_boxed_call``): it takes the argument list and empties it, so that each
    input dies after its last use, as in Inductor's generated code.

    Args:
        graph_module: the forward or backward graph AOTAutograd hands its compiler.
        counter: the step's :class:`~.counter.StorageLifeCounter` (paused for what is not allocated).
        kept: storages Inductor does not count as freed when an input on them dies (see :func:`plan_graph`).
        device_type: the device Inductor compiles for (default: the tensors').
    """

    _boxed_call = True

    def __init__(
        self, graph_module: fx.GraphModule, counter: Any, *, kept: frozenset[Any] = frozenset(), device_type: str | None = None
    ) -> None:
        # an instance attribute too: torch 2.4's runtime wrappers copy the compiled function's
        # __dict__ (functools.wraps) and box the call only where they find it there
        self._boxed_call = True
        self.graph_module = graph_module
        self.counter = counter
        self.plan = plan_graph(graph_module.graph, kept=kept, device_type=device_type)
        by_name = {node.name: node for node in graph_module.graph.nodes}
        self.nodes = [by_name[name] for name in self.plan.order]
        released: dict[int, list[str]] = {}
        for name, at in self.plan.free_at.items():
            released.setdefault(at, []).append(name)
        self.released = released
        #: the names of buffers some later buffer reuses: kept until then
        self.reused = {name: at for at, name in self.plan.reuse.items()}

    def __call__(self, args: list[Any]) -> Any:
        inputs = _steal(args)
        del args
        env: dict[str, Any] = {}
        held: dict[str, Any] = {}
        plan = self.plan
        taken = 0
        result = None
        for i, node in enumerate(self.nodes):
            if node.op == "placeholder":
                env[node.name] = inputs[taken] if taken < len(inputs) else None
                if taken < len(inputs):
                    inputs[taken] = None  # the graph holds it now, until its last use
                taken += 1
                continue
            if node.op == "output":
                result = _map_nodes(node.args[0], env)
                break
            reused = plan.reuse.get(i)
            if reused is not None:
                held.pop(reused, None)  # the dead buffer's place is taken: it goes now
            env[node.name] = self._run(node, env, held, i)
            self._release(i, env, held)
        env.clear()
        held.clear()
        return result

    def _release(self, i: int, env: dict[str, Any], held: dict[str, Any]) -> None:
        """Let go of the values whose last use was at ``i``; a buffer a later one reuses is held."""
        for name in self.released.get(i, ()):
            if name not in env:
                continue
            dead = env.pop(name)
            if self.reused.get(name, -1) > i:
                held[name] = dead
            del dead

    def _run(self, node: fx.Node, env: dict[str, Any], held: dict[str, Any], i: int) -> Any:
        if node.op == "get_attr":
            return getattr(self.graph_module, str(node.target))
        kind = self.plan.kinds[node.name]
        args = _map_nodes(node.args, env)
        kwargs = _map_nodes(node.kwargs, env)
        in_place = i in self.plan.in_place
        if kind == "kernel" or (kind == "scatter" and not in_place):
            return node.target(*args, **kwargs)  # ATen's kernel, with the scratch it takes on CUDA
        with self.counter.paused():
            value = node.target(*args, **kwargs)
        if kind not in ("realized", "scatter", "reduction"):
            return value
        # Inductor's own kernel: its output, and none of the scratch ATen's kernel would take
        if in_place:
            # written over an input that dies here: what dies here goes before the output is born
            del args, kwargs
            self._release(i, env, held)
        self.counter.adopt(pytree.tree_leaves(value))
        return value


def _steal(args: Any) -> list[Any]:
    stolen = list(args)
    if isinstance(args, list):
        args.clear()
    return stolen


def _map_nodes(value: Any, env: dict[str, Any]) -> Any:
    return fx.node.map_arg(value, lambda n: env[n.name])


# -- the compile options -----------------------------------------------------------------
@dataclass(frozen=True)
class CompileOptions:
    """What ``torch.compile`` was asked for, as far as the compiled module tells.

    Attributes:
        backend: ``"inductor"``, ``"aot_eager"``, ``"eager"``, another backend's name, or ``"unknown"``.
        cudagraphs: CUDA graphs are on (``mode="reduce-overhead"``/``"max-autotune"``, or the option).
        fullgraph: ``fullgraph=True`` (no graph breaks by construction).
        dynamic: ``dynamic=`` (``None``: torch's default).
    """

    backend: str = "unknown"
    cudagraphs: bool = False
    fullgraph: bool = False
    dynamic: bool | None = None


def is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper, or a module whose ``compile()`` was called."""
    return _is_optimized_module(module) or getattr(module, "_compiled_call_impl", None) is not None


def _is_optimized_module(module: nn.Module) -> bool:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a torch without dynamo has no compiled modules
        return False
    return isinstance(module, OptimizedModule)


def _dynamo_context(module: nn.Module) -> Any:
    if _is_optimized_module(module):
        return getattr(module, "dynamo_ctx", None)
    compiled = getattr(module, "_compiled_call_impl", None)
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "callback"):
            return value
    return None


def compile_options(module: nn.Module) -> CompileOptions:
    """The options ``module`` was compiled with, read from dynamo's context (``"unknown"`` where it hides them).

    Example::

        >>> import torch
        >>> compile_options(torch.compile(torch.nn.Linear(2, 2), mode="reduce-overhead"))
        CompileOptions(backend='inductor', cudagraphs=True, fullgraph=False, dynamic=None)
    """
    ctx = _dynamo_context(module)
    if ctx is None:
        return CompileOptions()
    chain, seen = [], set()
    link = getattr(ctx, "callback", None)
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.append(link)
        link = (  # the wrappers around the backend; torch 2.4 links the last ones by _torchdynamo_orig_callable
            getattr(link, "_torchdynamo_orig_backend", None)
            or getattr(link, "_inner_convert", None)
            or getattr(link, "_torchdynamo_orig_callable", None)
        )
    backend = chain[-1] if chain else None
    name = getattr(backend, "compiler_name", None)
    if name is None and backend is not None:
        name = getattr(backend, "__name__", None)
    config = getattr(backend, "config", None) or {}
    cudagraphs = bool(config.get("triton.cudagraphs", False)) if isinstance(config, Mapping) else False
    fullgraph = bool(getattr(ctx, "fullgraph", False)) or any(getattr(link, "_one_graph", False) is True for link in chain)
    dynamic = getattr(ctx, "_dynamic", None)
    return CompileOptions(str(name) if name else "unknown", cudagraphs, fullgraph, dynamic if isinstance(dynamic, bool) else None)


# -- the compiled module in the fake step --------------------------------------------------
@dataclass
class Outcome:
    """How one compiled module was estimated: as compiled, or uncompiled and why."""

    name: str
    options: CompileOptions
    compiled: bool = False
    reason: str | None = None
    #: no error bound: the uncompiled run is what the backend runs (``backend="eager"``)
    exact: bool = False


class CompiledModule(nn.Module):
    """Stands in the fake model for a compiled module: runs ``_orig_mod`` as Inductor would (see the module).

    Keeps the wrapped module as ``_orig_mod``, as ``torch.compile``'s wrapper does, so that
    module names (``_orig_mod.blocks.0``) and parameters are the compiled model's.
    """

    def __init__(
        self, orig_mod: nn.Module, counter: Any, outcome: Outcome, check_breaks: Callable[..., str | None], target: torch.device
    ) -> None:
        super().__init__()
        self._orig_mod = orig_mod
        self._counter = counter
        self._target = target
        self._outcome = outcome
        self._check_breaks = check_breaks
        self._cache: dict[Any, Callable[..., Any]] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outcome = self._outcome
        if outcome.reason is not None or not torch.is_grad_enabled():
            return self._orig_mod(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        key = _signature(flat, spec)
        runner = self._cache.get(key)
        if runner is None:
            runner = self._compile(flat, spec)
            if runner is None:
                return self._orig_mod(*args, **kwargs)
            self._cache[key] = runner
        return runner(flat)

    def _compile(self, flat: list[Any], spec: Any) -> Callable[..., Any] | None:
        outcome = self._outcome
        with self._counter.paused():
            try:
                if not outcome.options.fullgraph:
                    args, kwargs = pytree.tree_unflatten(flat, spec)
                    broken = self._check_breaks(self._orig_mod, *args, **kwargs)
                    if broken:
                        outcome.reason = broken
                        return None
                runner = _trace(self._orig_mod, flat, spec, self._counter, self._target)
                with _as_inductor_compiles(flat):
                    _warm_up(runner, flat, self._orig_mod)
            except Exception as err:  # noqa: BLE001 - any failure: the eager forward stands in, and says so
                outcome.reason = f"the trace failed under the fake mode ({type(err).__name__}: {_first_line(err)})"
                return None
        outcome.compiled = True
        return runner


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _signature(flat: list[Any], spec: Any) -> Any:
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device), value.requires_grad)
        try:
            hash(value)
        except TypeError:
            return ("object", id(value))
        return ("value", value)

    autocast = tuple(
        (device, torch.is_autocast_enabled(device)) for device in ("cpu", "cuda") if _autocast_known(device)
    )
    return (str(spec), tuple(one(v) for v in flat), autocast)


def _autocast_known(device: str) -> bool:
    try:
        torch.is_autocast_enabled(device)
    except (TypeError, RuntimeError):
        return False
    return True


def _trace(module: nn.Module, flat: list[Any], spec: Any, counter: Any, target: torch.device) -> Callable[[list[Any]], Any]:
    """AOTAutograd over ``module`` at these inputs, with Inductor's decompositions and partitioner;
    returns ``flat inputs -> outputs`` running the partitioned graphs with :class:`GraphRun`.
    ``target``: the device estimated for (Inductor's layout choice for convolutions is the CPU's or CUDA's)."""
    from torch._functorch.aot_autograd import aot_function

    decompositions, partition = _inductor_pieces()
    tensor_at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    constants = list(flat)
    # each parameter once (tied weights under their first name: functional_call ties the others to it)
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    names = list(named)

    def call(state: list[torch.Tensor], tensors: list[torch.Tensor]) -> Any:
        values = list(constants)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        # objects pytree does not know (a language model's key-value cache) taken apart: their tensors are outputs
        with _traced_as_dynamo_traces():
            return to_tree(torch.func.functional_call(module, dict(zip(names, state)), args, kwargs))

    primals: set[Any] = set()

    def forward(gm: fx.GraphModule, _inputs: Any) -> GraphRun:
        primals.update(storage_key(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")
        if layout_optimized(gm, target):
            channels_last_inputs(gm)
        return GraphRun(gm, counter, device_type=target.type)

    def backward(gm: fx.GraphModule, _inputs: Any) -> GraphRun:
        return GraphRun(gm, counter, kept=frozenset(primals - {None}), device_type=target.type)

    compiled = aot_function(
        call,
        fw_compiler=forward,
        bw_compiler=backward,
        partition_fn=partition,
        decompositions=decompositions,
        num_params_buffers=len(names),
    )
    # the state is read at each call: a parameter replaced since (an optimizer does not) is the one used
    return lambda values: from_tree(compiled([named[n] for n in names], [values[i] for i in tensor_at]))


@contextlib.contextmanager
def _traced_as_dynamo_traces() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true while the module's code is traced, as it is while dynamo traces it:
    libraries take their compiled paths there (Hugging Face models build their attention masks without
    reading a tensor's value when ``is_torchdynamo_compiling()``), and the graph is the one dynamo captures."""
    compiler = torch.compiler
    if not hasattr(compiler, "_is_compiling_flag"):
        yield
        return
    before = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = before


@functools.lru_cache(maxsize=None)
def _inductor_pieces() -> tuple[Any, Any]:
    """Inductor's decomposition table and partitioner: its own ``partition_fn`` (its joint-graph passes,
    then ``min_cut_rematerialization_partition``) where the torch has one at module level."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    try:
        from torch._inductor.compile_fx import partition_fn as inductor_partition
    except ImportError:
        inductor_partition = None
    if inductor_partition is None:
        inductor_partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return select_decomp_table(), inductor_partition


@contextlib.contextmanager
def _as_inductor_compiles(flat: list[Any]) -> Iterator[None]:
    """What Inductor's ``compile_fx`` sets around AOTAutograd: its virtualized fake mode (its joint-graph
    passes make tensors in it) and a tracing context, here with the estimate's fake mode."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.virtualized import V

    mode = detect_fake_mode([v for v in flat if isinstance(v, torch.Tensor)])
    if mode is None:
        yield
        return
    with V.set_fake_mode(mode), tracing(TracingContext(mode)):
        yield


def _warm_up(runner: Callable[[list[Any]], Any], flat: list[Any], module: nn.Module) -> None:
    """One forward and backward while nothing is counted: AOTAutograd compiles the backward at its first
    call, and what that makes must not be counted as the step's. Leaves no gradient behind."""
    out = runner(list(flat))
    grads_from = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [p for p in module.parameters() if p.requires_grad]
    wrt += [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads_from and wrt:
        torch.autograd.grad(grads_from, wrt, [torch.ones_like(t) for t in grads_from], allow_unused=True)


class CompiledModules:
    """The fake model's compiled modules, each replaced by a :class:`CompiledModule`; what became of each.

    Args:
        counter: the step's counter.
        target: the device estimated for (CUDA graphs fall back on CUDA only).
        check_breaks: ``(module, *args, **kwargs) -> reason or None``: graph breaks found
            (default :func:`graph_breaks`).
        key: what the step's model was made from (the user's module, or the function building
            it): graph breaks found for it are remembered for the estimate's other batch sizes.
    """

    def __init__(
        self,
        counter: Any,
        target: torch.device,
        check_breaks: Callable[..., str | None] | None = None,
        *,
        key: Any = None,
    ) -> None:
        self.counter = counter
        self.target = target
        check = check_breaks or graph_breaks
        self.check_breaks = remembered_breaks(check, key) if key is not None else check
        self.outcomes: list[Outcome] = []

    def install(self, model: nn.Module, source: nn.Module | None = None) -> nn.Module:
        """``model`` (the step's own copy) with its compiled modules, the root too, replaced.

        ``source``: the module ``model`` was copied from. A copy loses what ``module.compile()``
        set (torch leaves it out of a module's state): the source's modules, by name, say which
        were compiled and how.
        """
        # the user's model read without calling its methods (see :func:`.fake.walk_modules`)
        compiled = {name: compile_options(m) for name, m in walk_modules(source) if is_compiled(m)} if source is not None else {}
        for name, module in list(model.named_modules()):
            if name not in compiled and is_compiled(module):
                compiled[name] = compile_options(module)
        if "" in compiled:
            return self._wrap("", model, compiled[""])
        for name, module in list(model.named_modules()):
            if name in compiled and not any(name.startswith(outer + ".") for outer in compiled if outer and outer != name):
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, self._wrap(name, module, compiled[name]))
        return model

    def _wrap(self, name: str, module: nn.Module, options: CompileOptions) -> nn.Module:
        inner = getattr(module, "_orig_mod", module) if _is_optimized_module(module) else module
        if getattr(inner, "_compiled_call_impl", None) is not None:
            inner._compiled_call_impl = None  # the step's copy: its compiled call would be the user's module's
        outcome = Outcome(name, options)
        self.outcomes.append(outcome)
        if options.backend == "eager":
            outcome.reason, outcome.exact = "backend='eager' runs the captured graphs uncompiled", True
        elif options.backend != "inductor":
            outcome.reason = f"backend={options.backend!r} is not estimated as compiled (Inductor is)"
        elif not INDUCTOR_PLAN_MODELLED:
            outcome.reason = f"torch {torch.__version__}'s Inductor plans memory otherwise than the releases the estimate models (2.5 and later)"
        elif options.cudagraphs and self.target.type == "cuda":
            outcome.reason = "CUDA graphs (mode='reduce-overhead' or 'max-autotune') keep memory pools of their own"
        return CompiledModule(inner, self.counter, outcome, self.check_breaks, self.target)

    def notes(self) -> tuple[str, ...]:
        """One line per compiled module: how it was estimated."""
        out = []
        for o in self.outcomes:
            where = f"torch.compile'd {o.name or 'model'}"
            if o.compiled and o.reason is None:
                dynamic = "; dynamic=True: traced at the step's shapes" if o.options.dynamic else ""
                # Compiling is not the compiled step: on a GPU, Inductor times candidate kernels on the
                # device the first time it compiles a shape (an H200 reserved 803 MB more for the zoo's
                # compiled MLP at 141 in the process that compiled; none more once its cache held the code)
                compiling = (
                    "; not counted: what Inductor takes while it compiles a new shape (it times candidate kernels on "
                    "the GPU: a first run at an uncached shape needs more room)"
                    if self.target.type == "cuda"
                    else ""
                )
                out.append(f"{where}: estimated as compiled (Inductor's partition, fusion and memory planning){dynamic}{compiling}")
            elif o.reason is not None:
                out.append(f"{where}: estimated uncompiled: {o.reason}")
        return tuple(out)

    def bounds(self, peak_layers: Mapping[str, int], breakdown: Mapping[str, int]) -> dict[str, int]:
        """The error bound of each module estimated uncompiled (not ``exact``): what compiling it could
        have saved at the peak at most, the activations it kept then (the whole model compiled: the
        activations and their gradients then, as Inductor also writes gradients in place)."""
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.reason is None or o.exact:
                continue
            if not o.name:
                inside = breakdown.get("activations", 0) + breakdown.get("activation_gradients", 0)
            else:
                prefix = f"{o.name}._orig_mod"
                inside = sum(n for module, n in peak_layers.items() if module in (o.name, prefix) or module.startswith(prefix + "."))
            if inside:
                out[f"torch.compile ({o.name or 'model'}, estimated uncompiled)"] = inside
        return out
