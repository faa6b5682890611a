"""``torch.compile``'d modules in the fake step, run as Inductor runs them: partitioned, fused, planned.

A compiled module (``torch.compile(model)``'s ``OptimizedModule``, or a module after
``module.compile()``) does not keep what its eager forward keeps for backward: AOTAutograd
traces forward and backward as one graph and Inductor's partitioner
(``min_cut_rematerialization_partition``) chooses what the forward saves, recomputing cheap
values in backward; Inductor then fuses pointwise operations into kernels whose
intermediates are never allocated, frees each buffer after its last use, reuses a freed
buffer for a later one of the same size, and writes a kernel's output over an input that
dies there. On the zoo's compiled MLP the eager estimate was 5.6% over the H100's peak.

:class:`CompiledModules` replaces each compiled module of the fake model by a
:class:`CompiledModule` that does the same on fake tensors: the first call traces the
joint graph with AOTAutograd under the estimate's fake mode, with Inductor's
decompositions and partitioner (nothing is counted while it traces), and runs the
forward and backward graphs with :class:`GraphRun`, which counts only what Inductor would
allocate (:func:`plan_graph`):

- an operator Inductor runs as its own kernel (matrix products, convolutions, attention,
  anything it has no fused lowering for) makes a buffer, and the values it reads are
  made buffers first;
- pointwise operations (and copies, casts, indexing, random numbers) are fused: no buffer,
  unless the value is read by such a kernel or leaves the graph (an output, a tensor saved
  for backward); what a fused value reads stays alive until the value's last use;
- a reduction makes a buffer and reads its inputs fused;
- a buffer dies after its last use; one that a later buffer of its size reuses (Inductor's
  memory planning) is kept until then; a fused kernel's output takes the place of an input
  buffer of its size that dies there (Inductor's in-place update).

The rules are those of Inductor's lowering and scheduler in outline, not their every
heuristic (a pointwise value read by several kernels may be computed into a buffer by
Inductor; here it is not); ``docs/estimate.md`` has the measured differences.

What is not estimated as compiled falls back to the module's eager forward, and the
estimate's notes say so, with the activations the module kept at the peak as the error
bound (what compiling it could have saved): a backend other than Inductor,
``aot_eager`` and ``eager`` (``eager`` runs the captured graph as it is: estimated exactly
as uncompiled, no bound); CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``) on
CUDA; graph breaks (found with ``torch._dynamo.explain`` on a meta copy; one graph per break
would be partitioned apart); a trace that fails under the fake mode. ``dynamic=True`` is
estimated with the shapes of the step (Inductor's symbolic graph saves the same tensors).

Example::

    >>> import torch
    >>> from torch import fx
    >>> def f(x, w):
    ...     h = torch.ops.aten.mm.default(x, w)                 # a kernel of its own: a buffer
    ...     g = torch.ops.aten.mul.Tensor(h, 0.5)               # fused ...
    ...     return torch.ops.aten.relu.default(g), h            # ... into the output's kernel
    >>> plan = plan_graph(fx.symbolic_trace(f).graph)
    >>> sorted(name for name, kind in plan.kinds.items() if kind in MATERIALIZED)
    ['mm', 'relu']
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import operator
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..measure.storage_counting import NEW, return_kinds

__all__ = [
    "CompileOptions",
    "compile_options",
    "is_compiled",
    "plan_graph",
    "GraphPlan",
    "GraphRun",
    "CompiledModule",
    "CompiledModules",
    "MATERIALIZED",
]

#: Kinds of graph node whose value is a buffer of its own (see :func:`plan_graph`).
MATERIALIZED = frozenset({"kernel", "reduction", "realized", "scatter"})

#: Operators Inductor lowers into fused loops although torch does not tag them pointwise.
_FUSED = frozenset(
    {
        "_to_copy", "clone", "where", "full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones",
        "ones_like", "rand", "rand_like", "randn", "randn_like", "randint", "bernoulli", "index", "_unsafe_index",
        "gather", "embedding", "constant_pad_nd", "slice_scatter", "select_scatter", "diagonal_scatter",
        "masked_fill", "iota", "arange", "repeat", "convert_element_type", "inductor_random", "inductor_randint",
        "lift_fresh_copy", "alias_copy", "copy", "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
        "_low_memory_max_pool_offsets_to_indices",
        "avg_pool2d", "avg_pool2d_backward", "upsample_nearest2d", "upsample_bilinear2d",
        "index_select", "expand_copy", "permute_copy", "view_copy", "tril", "triu", "fill", "squeeze_copy",
        "unsqueeze_copy", "_unsafe_view", "empty_like", "native_dropout", "_softmax", "_log_softmax",
        "_softmax_backward_data", "_log_softmax_backward_data", "leaky_relu_backward", "threshold_backward",
        "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "hardswish_backward",
    }
)  # fmt: skip

#: Reductions: one buffer for the result, the input read fused.
_REDUCTIONS = frozenset(
    {
        "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod", "argmax", "argmin", "any",
        "all", "logsumexp", "norm", "linalg_vector_norm", "cumsum", "cumprod", "cat", "index_add",
        "_embedding_bag", "embedding_dense_backward",
    }
)  # fmt: skip

#: Scatters: on CUDA a kernel reading its index and source fused, writing one buffer; on the CPU
#: Inductor calls ATen's kernel (``config.cpp.fallback_scatter_reduce_sum``) on its inputs made
#: buffers, in place over the tensor scattered into.
_SCATTERS = frozenset({"scatter_add", "scatter", "scatter_reduce", "index_put", "_unsafe_index_put"})


def _op_name(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    name = getattr(schema, "name", "") or getattr(target, "__name__", "")
    return name.split("::")[-1]


def _node_kind(node: fx.Node, device_type: str | None = None) -> str:
    """``input``, ``output``, ``item`` (a multi-output node's element), ``view`` (no new storage),
    ``fused``, ``reduction``, or ``kernel``."""
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op == "output":
        return "output"
    if node.op != "call_function":
        return "kernel"
    target = node.target
    if target is operator.getitem:
        return "item"
    if not isinstance(target, torch._ops.OpOverload):
        return "kernel"  # a higher-order operator or a Python function: counted as it runs
    kinds = return_kinds(target)
    if not kinds or NEW not in kinds:
        return "view"  # views, in-place results, numbers
    name = _op_name(target)
    if name in _SCATTERS:
        if device_type is None:
            value = node.meta.get("val")
            device_type = value.device.type if isinstance(value, torch.Tensor) else None
        return "scatter" if device_type == "cpu" else "reduction"
    if name in _REDUCTIONS:
        return "reduction"
    if torch.Tag.pointwise in target.tags or name in _FUSED:
        return "fused"
    return "kernel"


@dataclass
class GraphPlan:
    """How :class:`GraphRun` runs a graph; node names as keys, positions in :attr:`order`.

    Attributes:
        order: the node names in the order they run (Inductor's order for peak memory where it reorders).
        kinds: each node's kind (``fused`` values that become buffers are ``realized``).
        free_at: the position after which each value is let go.
        reuse: a buffer's position -> the name of the dead buffer of its size it takes over
            (held from its death until then; Inductor's memory planning).
        in_place: a fused kernel's position -> the name of the input buffer of its size it writes over.
    """

    order: list[str]
    kinds: dict[str, str]
    free_at: dict[str, int]
    reuse: dict[int, str] = field(default_factory=dict)
    in_place: dict[int, str] = field(default_factory=dict)


def _reuse_key(node: fx.Node) -> tuple | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return (value.device, value.dtype, value.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _nbytes(node: fx.Node) -> int:
    total = 0
    for value in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            try:
                total += value.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                total += value.numel() * value.element_size()
    return total


def _classify(nodes: list[fx.Node], device_type: str | None = None) -> tuple[dict[fx.Node, str], set[fx.Node]]:
    """Each node's kind, fused values read by a kernel or leaving the graph made ``realized``; the graph's outputs."""
    kinds = {node: _node_kind(node, device_type) for node in nodes}

    def realize(node: fx.Node) -> None:
        while True:
            kind = kinds[node]
            if kind == "view" and node.args and isinstance(node.args[0], fx.Node):
                node = node.args[0]
                continue
            if kind == "item":
                producer = node.args[0]
                if isinstance(producer, fx.Node) and kinds[producer] == "fused":
                    kinds[node] = "realized"
            elif kind == "fused":
                kinds[node] = "realized"
            return

    for node in nodes:
        if kinds[node] in ("kernel", "scatter"):
            for arg in node.all_input_nodes:
                realize(arg)
    for node in nodes:
        if kinds[node] == "output":
            for arg in node.all_input_nodes:
                realize(arg)
    _realize_on_reuse(nodes, kinds, realize, device_type)
    returned = set()
    for node in nodes:
        if kinds[node] == "output":
            for arg in node.all_input_nodes:
                while kinds[arg] == "view" and arg.args and isinstance(arg.args[0], fx.Node):
                    arg = arg.args[0]
                returned.add(arg)
    return kinds, returned


#: Operations that Inductor's CPU kernels compute into a buffer rather than again in each reader.
_HEAVY_ON_CPU = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def _realize_thresholds(cpu: bool) -> tuple[int, int, int, int]:
    """Inductor's ``realize_reads_threshold``, opcount, accumulated-reads and users thresholds, from its config."""
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001 - no Inductor: its defaults
        config = None  # type: ignore[assignment]

    def read(name: str, default: int) -> int:
        value = getattr(config, name, None) if config is not None else None
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    opcount = read("realize_opcount_threshold", 0) or (
        read("realize_cpu_opcount_threshold", 30) if cpu else read("_realize_opcount_threshold_default", 30)
    )
    acc = read("realize_acc_reads_threshold", 0) or (
        read("realize_cpu_acc_reads_threshold", 8) if cpu else read("_realize_acc_reads_threshold_default", 8)
    )
    return read("realize_reads_threshold", 4), opcount, acc, read("realize_opusers_threshold", 5)


def _realize_on_reuse(
    nodes: list[fx.Node], kinds: dict[fx.Node, str], realize: Callable[[fx.Node], None], device_type: str | None
) -> None:
    """Inductor's store-or-recompute rules, in the graph's order: a fused value read by several
    nodes is computed into a buffer when it reads more than ``realize_reads_threshold`` buffers
    or its expression is large (on the CPU also when it holds an exponential or a logarithm); any
    fused value reading very many buffers, or a very large expression, is too."""
    values = [n.meta.get("val") for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    cpu = device_type == "cpu" if device_type is not None else bool(values) and values[0].device.type == "cpu"
    reads_limit, ops_limit, acc_limit, users_limit = _realize_thresholds(cpu)
    reads: dict[fx.Node, frozenset[fx.Node]] = {}
    ops: dict[fx.Node, int] = {}
    used: dict[fx.Node, frozenset[str]] = {}
    for node in nodes:
        kind = kinds[node]
        if kind not in ("fused", "view", "item"):
            reads[node], ops[node], used[node] = frozenset({node}), 1, frozenset()
            continue
        inputs = node.all_input_nodes
        reads[node] = frozenset().union(*(reads[m] for m in inputs))
        ops[node] = (1 if kind == "fused" else 0) + sum(ops[m] for m in inputs)
        used[node] = frozenset().union(*(used[m] for m in inputs)) | ({_op_name(node.target)} if kind == "fused" else set())
        if kind != "fused":
            continue
        users = len(node.users)
        fanout = users > 1 and (
            len(reads[node]) > reads_limit
            or ops[node] > ops_limit
            or (cpu and not used[node].isdisjoint(_HEAVY_ON_CPU))
            or (cpu and users > users_limit and ops[node] > max(0, ops_limit - 2))
        )
        too_much = (len(reads[node]) > acc_limit or ops[node] > ops_limit) and len(reads[node]) > 1
        if fanout or too_much or ops[node] > 100:
            realize(node)
            reads[node], ops[node], used[node] = frozenset({node}), 1, frozenset()


def _is_buffer(node: fx.Node, kinds: dict[fx.Node, str], sources: dict[fx.Node, frozenset[fx.Node]]) -> bool:
    """A value the graph allocates: a kernel's, a reduction's or a realized value (a kernel with several
    outputs is not one: each of its outputs is)."""
    return (
        kinds[node] != "input"
        and sources[node] == frozenset({node})
        and not isinstance(node.meta.get("val"), (tuple, list))
    )


def _sources(nodes: list[fx.Node], kinds: dict[fx.Node, str]) -> dict[fx.Node, frozenset[fx.Node]]:
    """The buffers (and inputs) each value reads: itself if it is one, else what its inputs read."""
    sources: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in nodes:
        kind = kinds[node]
        if kind in MATERIALIZED or kind == "input":
            sources[node] = frozenset({node})
        elif kind == "item" and kinds.get(node.args[0]) in MATERIALIZED:
            sources[node] = frozenset({node})  # one output of a kernel with several
        else:
            sources[node] = frozenset().union(*(sources[m] for m in node.all_input_nodes))
    return sources


def plan_graph(
    graph: fx.Graph, *, kept: frozenset[Any] = frozenset(), reorder: bool | None = None, device_type: str | None = None
) -> GraphPlan:
    """Which values of ``graph`` are buffers, the order the kernels run in, when each value is let
    go, and what Inductor's memory planning reuses (see the module).

    The reordering counts a graph input as freed after its last use (a backward graph's saved
    activations) unless Inductor would not: the forward's inputs (``primals_*``), the gradients
    flowing in (``tangents_*``), and inputs on a storage in ``kept`` (the forward's inputs'
    storages, by :func:`storage_key`: a parameter's transpose saved for backward).
    ``reorder``: Inductor's reordering for peak memory (default: as
    ``torch._inductor.config.reorder_for_peak_memory`` says, off where the torch has none).
    ``device_type``: the device Inductor compiles for, where it decides (default: the tensors').
    """
    nodes = list(graph.nodes)
    kinds, returned = _classify(nodes, device_type)
    sources = _sources(nodes, kinds)
    if reorder is None:
        reorder = _inductor_reorders()
    if reorder:
        try:
            nodes = _reorder_for_peak_memory(nodes, kinds, sources, returned, kept)
        except Exception:  # noqa: BLE001 - an order that cannot be made: the graph's own
            nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last_use = {node: max((position[u] for u in node.users), default=position[node]) for node in nodes}
    free_at = dict(last_use)
    for node in nodes:
        if kinds[node] in ("fused", "view", "item", "output"):
            for source in sources[node]:
                if source is not node:
                    free_at[source] = max(free_at[source], last_use[node])
    plan = GraphPlan([n.name for n in nodes], {n.name: kinds[n] for n in nodes}, {n.name: free_at[n] for n in nodes})
    # Inductor's memory planning: a dead buffer goes to a pool by (device, dtype, bytes); a later
    # allocation of that key takes it (held alive until then); a fused kernel writes over an input
    # buffer of its key that dies at it.
    internal = {n for n in nodes if _is_buffer(n, kinds, sources)} - returned
    dying: dict[int, list[fx.Node]] = {}
    for n in internal:
        dying.setdefault(free_at[n], []).append(n)
    pool: dict[tuple, list[fx.Node]] = {}
    for i, node in enumerate(nodes):
        key = _reuse_key(node) if _is_buffer(node, kinds, sources) else None
        taken: fx.Node | None = None
        if key is not None and kinds[node] in ("realized", "scatter"):
            read = node.all_input_nodes if kinds[node] == "realized" else node.all_input_nodes[:1]  # a scatter: into its first
            for donor in sorted({s for m in read for s in sources[m]}, key=position.__getitem__):
                if donor in internal and free_at[donor] == i and _reuse_key(donor) == key:
                    plan.in_place[i] = donor.name
                    taken = donor
                    break
        if key is not None and taken is None and pool.get(key):
            plan.reuse[i] = pool[key].pop().name
        for dead in sorted(dying.get(i, ()), key=position.__getitem__):
            dead_key = _reuse_key(dead)
            if dead is not taken and dead_key is not None:
                pool.setdefault(dead_key, []).append(dead)
    return plan


#: Graph inputs Inductor never counts as freed (``torch._inductor.utils.is_nonfreeable_buffers``).
_NOT_FREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


def storage_key(value: Any) -> Any:
    """What identifies ``value``'s storage (``None`` for a non-tensor)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(value.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError, ImportError):
        return None


def _freeable(node: fx.Node, kept: frozenset[Any]) -> bool:
    if node.op != "placeholder" or node.name.startswith(_NOT_FREEABLE):
        return False
    return storage_key(node.meta.get("val")) not in kept


def _inductor_reorders() -> bool:
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001 - no Inductor: no reordering
        return False
    return bool(getattr(config, "reorder_for_peak_memory", False))


# -- Inductor's reordering for peak memory, on kernels ---------------------------------------
@dataclass(eq=False)
class _Unit:
    """One kernel: the buffers it makes and reads, the kernels it waits for."""

    node: fx.Node
    index: int
    outputs: list[fx.Node] = field(default_factory=list)
    reads: set[fx.Node] = field(default_factory=set)
    preds: set[_Unit] = field(default_factory=set)
    succs: set[_Unit] = field(default_factory=set)
    size: int = 0


def _reorder_for_peak_memory(
    nodes: list[fx.Node],
    kinds: dict[fx.Node, str],
    sources: dict[fx.Node, frozenset[fx.Node]],
    returned: set[fx.Node],
    kept: frozenset[Any],
) -> list[fx.Node]:
    """The nodes in the order of Inductor's ``reorder_for_peak_memory``: of the graph's own order and
    three topological orders (least peak memory first, breadth-first, depth-first by size), the one
    whose estimated peak is lowest, with kernels as the units and fused values run just before the
    first kernel that reads them."""
    units: dict[fx.Node, _Unit] = {}
    for node in nodes:
        if kinds[node] in MATERIALIZED:
            units[node] = _Unit(node, len(units))
    owner: dict[fx.Node, _Unit | None] = {}
    size: dict[fx.Node, int] = {}
    frontier: dict[fx.Node, frozenset[_Unit]] = {}
    for node in nodes:
        unit = units.get(node)
        made_by = units.get(node.args[0]) if kinds[node] == "item" and node.args else None  # type: ignore[arg-type]
        if unit is not None:
            frontier[node] = frozenset({unit})
        elif made_by is not None:
            frontier[node] = frozenset({made_by})
        else:
            frontier[node] = frozenset().union(*(frontier[m] for m in node.all_input_nodes))
        if _is_buffer(node, kinds, sources) or (kinds[node] == "input" and node.op == "placeholder"):
            size[node] = _nbytes(node)
            owner[node] = unit or made_by
            if owner[node] is not None:
                owner[node].outputs.append(node)
    for unit in units.values():
        unit.size = sum(size[b] for b in unit.outputs)
        for m in unit.node.all_input_nodes:
            for b in sources[m]:
                if b in owner and (owner[b] is not None or _freeable(b, kept)):
                    unit.reads.add(b)
            unit.preds |= frontier[m]
        unit.preds.discard(unit)
        for pred in unit.preds:
            pred.succs.add(unit)
    if not units:
        return nodes
    readers: dict[fx.Node, list[_Unit]] = {}
    for unit in units.values():
        for b in unit.reads:
            readers.setdefault(b, []).append(unit)
    inputs = [b for b in readers if owner.get(b) is None]
    baseline = sorted(units.values(), key=lambda u: u.index)

    keys = {b: _reuse_key(b) for b in size}

    def peak_of(order: list[_Unit]) -> int:
        # as Inductor estimates an order: each kernel's outputs allocated at its step, each buffer
        # freed after its last reader; a fused kernel writing over an input that dies there allocates nothing
        step = {u: i for i, u in enumerate(order)}
        end = {b: max(step[r] for r in rs) for b, rs in readers.items()}
        delta = [0] * (len(order) + 2)
        live = sum(size[b] for b in inputs)
        for b in inputs:
            if b not in returned:
                delta[end[b] + 1] -= size[b]
        for u in order:
            i = step[u]
            for b in u.outputs:
                donor = None
                if kinds[u.node] == "realized" and keys[b] is not None:
                    donor = next(
                        (d for d in u.reads if owner.get(d) is not None and d not in returned and end[d] == i and keys[d] == keys[b]),
                        None,
                    )
                if donor is None:
                    delta[i] += size[b]
                else:
                    delta[i + 1] += size[donor]  # its free below is not one: the output holds it
                if b not in returned:
                    delta[end.get(b, i) + 1] -= size[b]
        peak = live
        for d in delta:
            live += d
            peak = max(peak, live)
        return peak

    candidates = [baseline]
    for method in (_lpmf, _bfs, _dfs):
        order = method(baseline, readers, size, inputs, returned)
        if len(order) == len(baseline):
            candidates.append(order)
    best = min(candidates, key=peak_of)  # the first of equals: the graph's own order where it is as good
    if best is baseline:
        return nodes
    return _emit(nodes, [u.node for u in best])


def _lpmf(units: list[_Unit], readers: dict, size: dict, inputs: list, returned: set) -> list[_Unit]:
    """Least peak memory first (Inductor's ``topological_sort_lpmf``)."""
    indegree = {u: len(u.preds) for u in units}
    outdegree = {b: len(rs) + (1 if b in returned else 0) for b, rs in readers.items()}
    for u in units:
        for b in u.outputs:
            outdegree.setdefault(b, 1 if b in returned else 0)
    to_free = dict.fromkeys(units, 0)
    for u in units:
        to_free[u] += sum(size[b] for b in u.reads if outdegree[b] == 1)
        to_free[u] += sum(size[b] for b in u.outputs if outdegree[b] == 0)
    ready = [u for u in units if indegree[u] == 0]
    live = sum(size[b] for b in inputs)
    most = max(live, sum(size[b] for b in returned if b in size))
    gap = most - live
    schedule = []
    while ready:
        chosen = min(ready, key=lambda u: (u.size if u.size > gap else 0, u.size - to_free[u], u.index))
        ready.remove(chosen)
        schedule.append(chosen)
        live += chosen.size
        most = max(most, live)
        live -= to_free[chosen]
        gap = most - live
        for succ in chosen.succs:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                ready.append(succ)
        for b in chosen.reads:
            outdegree[b] -= 1
            if outdegree[b] == 1:
                for reader in readers[b]:
                    to_free[reader] += size[b]
    return schedule


def _bfs(units: list[_Unit], *_: Any) -> list[_Unit]:
    """First the kernel whose predecessors ran earliest (Inductor's ``topological_sort_bfs``)."""
    import heapq

    indegree = {u: len(u.preds) for u in units}
    ran: dict[_Unit, int] = {}

    def entry(u: _Unit) -> tuple:
        return (sorted({ran[p] for p in u.preds}), u.index, id(u), u)

    heap = [entry(u) for u in units if indegree[u] == 0]
    heapq.heapify(heap)
    schedule = []
    while heap:
        chosen = heapq.heappop(heap)[-1]
        ran[chosen] = len(schedule)
        schedule.append(chosen)
        for succ in chosen.succs:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(heap, entry(succ))
    return schedule


def _dfs(units: list[_Unit], readers: dict, size: dict, *_: Any) -> list[_Unit]:
    """Depth first, smallest kernels (with what they read) first (Inductor's ``topological_sort_dfs``)."""
    weight = {u: u.size + sum(size[b] for b in u.reads) for u in units}
    seen: set[_Unit] = set()
    schedule: list[_Unit] = []
    for root in sorted(units, key=lambda u: (weight[u], u.index)):
        stack = [(root, False)]
        while stack:
            unit, expanded = stack.pop()
            if expanded:
                schedule.append(unit)
                continue
            if unit in seen:
                continue
            seen.add(unit)
            stack.append((unit, True))
            for pred in sorted(unit.preds, key=lambda u: (weight[u], u.index), reverse=True):
                if pred not in seen:
                    stack.append((pred, False))
    return schedule


def _emit(nodes: list[fx.Node], kernels: list[fx.Node]) -> list[fx.Node]:
    """All nodes, the inputs first, each kernel in ``kernels``' order preceded by what it needs that has
    not run, then the rest in the graph's order, the output last."""
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    position = {n: i for i, n in enumerate(nodes)}

    def need(node: fx.Node) -> None:
        stack = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            for m in sorted(n.all_input_nodes, key=position.__getitem__, reverse=True):
                if m not in done:
                    stack.append((m, False))

    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            need(n)
    for k in kernels:
        need(k)
    for n in nodes:
        if n.op != "output":
            need(n)
    for n in nodes:
        if n.op == "output":
            need(n)
    return order


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
        if kind in ("kernel", "reduction") or (kind == "scatter" and not in_place):
            return node.target(*args, **kwargs)
        with self.counter.paused():
            value = node.target(*args, **kwargs)
        if kind not in ("realized", "scatter"):
            return value
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
        link = getattr(link, "_torchdynamo_orig_backend", None) or getattr(link, "_inner_convert", None)
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
    graphs: int = 0


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
        outcome.graphs += 1
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
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(dict(module.named_buffers(remove_duplicate=False)))
    names = list(named)

    def call(state: list[torch.Tensor], tensors: list[torch.Tensor]) -> Any:
        values = list(constants)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        return torch.func.functional_call(module, dict(zip(names, state)), args, kwargs)

    primals: set[Any] = set()

    def forward(gm: fx.GraphModule, _inputs: Any) -> GraphRun:
        primals.update(storage_key(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")
        if _layout_optimized(gm, target):
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
    return lambda values: compiled([named[n] for n in names], [values[i] for i in tensor_at])


def _layout_optimized(gm: fx.GraphModule, target: torch.device) -> bool:
    """Whether Inductor runs this training graph's convolutions channels-last (its
    ``GraphLowering.decide_layout_opt``; with oneDNN on the CPU it always does, and its CUDA rules
    are asked without it where fake CPU tensors stand in for CUDA)."""
    try:
        from torch._inductor.graph import GraphLowering
    except Exception:  # noqa: BLE001 - no Inductor here
        return False
    decide = getattr(GraphLowering, "decide_layout_opt", None)
    if decide is None:
        return False
    on_cpu = any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "cpu"
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )
    rules = torch.backends.mkldnn.flags(enabled=False) if target.type != "cpu" and on_cpu else contextlib.nullcontext()
    try:
        with rules:
            return bool(decide(gm, is_inference=False))
    except Exception:  # noqa: BLE001 - the heuristics failed on this graph: the default layout
        return False


def channels_last_inputs(gm: fx.GraphModule) -> int:
    """Inductor's layout optimization in a forward graph: each graph input a convolution reads (its
    batch, its weight) that is not channels-last is copied to channels-last first, and the copy is
    what the convolution reads and what is saved for backward. Returns the copies made. (The copies
    here keep the input's layout: their bytes are the same, and the graph's views, traced for the
    input's layout, stay valid.)

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> conv = lambda x, w: torch.ops.aten.convolution.default(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        >>> gm = make_fx(conv)(torch.zeros(2, 3, 8, 8), torch.zeros(4, 3, 3, 3))
        >>> channels_last_inputs(gm), [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
        (2, ['clone', 'clone_1'])
    """
    graph = gm.graph
    convolutions = [n for n in graph.nodes if n.target is torch.ops.aten.convolution.default]
    copies: dict[fx.Node, fx.Node] = {}
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for conv in convolutions:
        for arg in conv.args[:2]:
            if not isinstance(arg, fx.Node) or arg.op != "placeholder" or arg in copies:
                continue
            value = arg.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.dim() != 4:
                continue
            if value.is_contiguous(memory_format=torch.channels_last):
                continue
            with graph.inserting_before(first):
                copy_node = graph.call_function(torch.ops.aten.clone.default, (arg,))
            copy_node.meta["val"] = value.clone()
            copies[arg] = copy_node
    for original, copy_node in copies.items():
        for user in list(original.users):
            if user is not copy_node and (user.target is torch.ops.aten.convolution.default or user.op == "output"):
                user.replace_input_with(original, copy_node)
    if copies:
        gm.recompile()
    return len(copies)


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
        self.check_breaks = _remembered_breaks(check, key) if key is not None else check
        self.outcomes: list[Outcome] = []

    def install(self, model: nn.Module, source: nn.Module | None = None) -> nn.Module:
        """``model`` (the step's own copy) with its compiled modules, the root too, replaced.

        ``source``: the module ``model`` was copied from. A copy loses what ``module.compile()``
        set (torch leaves it out of a module's state): the source's modules, by name, say which
        were compiled and how.
        """
        compiled = {name: compile_options(m) for name, m in source.named_modules() if is_compiled(m)} if source is not None else {}
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
                out.append(f"{where}: estimated as compiled (Inductor's partition, fusion and memory planning){dynamic}")
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


#: Graph breaks found, by what a step's model is made from, then by module name and input signature.
_BREAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remembered_breaks(check: Callable[..., str | None], key: Any) -> Callable[..., str | None]:
    """``check``, its answer for a module and its inputs' structure (not their sizes) remembered for ``key``."""
    try:
        seen = _BREAKS.setdefault(key, {})
    except TypeError:  # not weakly referable: nothing remembered
        return check

    def remembered(module: nn.Module, *args: Any, **kwargs: Any) -> str | None:
        flat, spec = pytree.tree_flatten((args, kwargs))
        shape = tuple(
            (v.dtype, v.dim(), v.requires_grad) if isinstance(v, torch.Tensor) else repr(v)[:100] for v in flat
        )
        sig = (type(module).__qualname__, str(spec), shape)
        if sig not in seen:
            seen[sig] = check(module, *args, **kwargs)
        return seen[sig]

    return remembered


def graph_breaks(module: nn.Module, *args: Any, **kwargs: Any) -> str | None:
    """Whether dynamo breaks ``module``'s forward into several graphs at these inputs: how, or ``None``.

    Dynamo traces a copy of the module and inputs on the ``meta`` device, with the estimate's
    dispatch and function modes put aside, through a backend that only counts graphs. Its
    forward runs as a copy of its code: dynamo keeps what it compiles on the code object it
    ran, and the user's own compiled module must find no entry of ours there
    (``torch._dynamo.explain`` would reset every compiled module of the process instead).
    ``None`` too where dynamo cannot trace the copy (no break is then known).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - no dynamo: nothing to check
        return None
    graphs: list[Any] = []
    reasons: list[str] = []

    def count(gm: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        why = getattr(gm, "compile_subgraph_reason", None)
        if why is not None and getattr(why, "graph_break", False):
            reasons.append(str(getattr(why, "reason", why)))
        return gm.forward

    with _disable_current_modes(), _no_function_modes():
        meta_module, meta_args, meta_kwargs = _on_meta(module, args, kwargs)
        forward = _copied_function(type(meta_module).forward)
        try:
            torch.compile(types.MethodType(forward, meta_module), backend=count, dynamic=False)(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001 - dynamo cannot trace the meta copy: no break known
            return None
    breaks = max(len(graphs) - 1, len(reasons))
    if not breaks:
        return None
    first = reasons[0].strip().splitlines()[0][:160] if reasons else "unknown"
    return f"{breaks} graph break{'s' if breaks > 1 else ''} (first: {first})"


def _copied_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own (dynamo's caches are kept on code objects)."""
    function = getattr(function, "__func__", function)
    code = function.__code__
    copied_code = code.replace(co_name=code.co_name)
    copied = types.FunctionType(copied_code, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__qualname__ = function.__qualname__
    return copied


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """The torch function modes (the estimate's RNN rules) put aside for the block."""
    from torch.overrides import _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        yield


def _on_meta(module: nn.Module, args: tuple, kwargs: dict) -> tuple[nn.Module, tuple, dict]:
    """``module`` (deep-copied) and the inputs with every tensor a ``meta`` tensor of its shape, strides and type."""
    memo: dict[int, Any] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        made = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(made, requires_grad=t.requires_grad)
        return made.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else made

    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in memo:
            memo[id(t)] = meta(t)
    copied = copy.deepcopy(module, memo)
    mapped = pytree.tree_map(lambda v: meta(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
    return copied, mapped[0], mapped[1]
