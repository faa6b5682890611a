"""What Inductor allocates for a graph: which values are buffers, in which order its kernels run, what it reuses.

:func:`plan_graph` reads a forward or backward graph (as AOTAutograd hands it to its compiler)
the way Inductor lowers and schedules it, in outline:

- an operator Inductor runs as its own kernel (matrix products, convolutions, attention,
  anything it has no fused lowering for) makes a buffer, and the values it reads are made
  buffers first (``kernel``);
- pointwise operations (and copies, casts, indexing, random numbers) are ``fused``: no buffer,
  unless the value is read by such a kernel or leaves the graph (an output, a tensor saved for
  backward), or Inductor's store-or-recompute rules say so (a value read by several nodes that
  reads more than ``realize_reads_threshold`` buffers, a large expression; see
  :func:`_realize_on_reuse`): then ``realized``; what a fused value reads stays alive until the
  value's last use;
- a ``reduction`` makes a buffer and reads its inputs fused; a scatter on the CPU is ATen's
  kernel on buffers, writing into the tensor it scatters into (``scatter``), on CUDA a reduction;
- a buffer dies after its last use; one that a later buffer of its size reuses (Inductor's memory
  planning) is kept until then; a fused kernel's output takes the place of an input buffer of its
  size that dies there (its in-place update);
- the kernels run in the order Inductor's ``reorder_for_peak_memory`` picks: of the graph's own
  order and three topological orders, the one whose estimated peak is lowest (kernels as the
  units, fused values run just before the first kernel that reads them).

:func:`channels_last_inputs` adds the copies Inductor's layout optimization makes of the inputs
its convolutions read. These are Inductor's rules in outline, not every heuristic of its lowering
and scheduler; ``docs/estimate.md`` has the measured differences.

Example::

    >>> import torch
    >>> from torch import fx
    >>> def f(x, w):
    ...     h = torch.ops.aten.mm.default(x, w)                 # a kernel of its own: a buffer
    ...     g = torch.ops.aten.mul.Tensor(h, 0.5)               # fused ...
    ...     return torch.ops.aten.relu.default(g), h            # ... into the output's kernel
    >>> graph = fx.symbolic_trace(f).graph
    >>> plan = plan_graph(graph)
    >>> [str(n.target) for n in graph.nodes if plan.kinds[n.name] in MATERIALIZED]
    ['aten.mm.default', 'aten.relu.default']
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..measure.storage_counting import NEW, return_kinds

__all__ = ["MATERIALIZED", "GraphPlan", "plan_graph", "storage_key", "channels_last_inputs", "layout_optimized"]

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
            bias = None if cpu else _unfused_bias(node)
            if bias is not None:  # its readers read ``mm + bias``: the bias and the addition too
                reads[node] |= reads.get(bias, frozenset({bias}))
                ops[node] += ops.get(bias, 1) + 1
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


def _unfused_bias(node: fx.Node) -> fx.Node | None:
    """The bias of an ``addmm`` that Inductor, on a GPU, runs as ``mm`` with the bias added in its readers.

    Inductor's post-grad pass ``unfuse_bias_add_to_pointwise`` rewrites ``addmm(bias, a, b)`` whose
    users are all pointwise (through views) as ``mm(a, b) + bias``, the addition fused into each
    user (``baddbmm`` likewise, where this torch does: :func:`_unfused_products`): the ``mm`` is the buffer, and every fused value reading it reads the bias as well, which
    counts toward the reads that make Inductor store a value rather than compute it again (a
    residual stream of linear layers is stored every second block on CUDA, every fourth on the
    CPU). Kept fused: a bias of another dtype than the factors, one that is not bias-like (a
    full-size accumulator), and half-precision biases where ``keep_addmm_fused_for_half_dtypes``
    says so. ``None`` where the ``addmm`` stays one kernel.
    """
    if node.op != "call_function" or node.target not in _unfused_products() or len(node.args) < 3:
        return None
    bias, first, second = node.args[:3]
    values = [getattr(a, "meta", {}).get("val") for a in (bias, first, second)]
    out = node.meta.get("val")
    if not all(isinstance(v, torch.Tensor) for v in (*values, out)):
        return None
    if len({v.dtype for v in values}) != 1 or node.kwargs.get("beta", 1) == 0:
        return None
    if values[0].dtype in (torch.bfloat16, torch.float16) and _inductor_flag("keep_addmm_fused_for_half_dtypes"):
        return None
    bias_like = (
        bias.op in ("placeholder", "get_attr")
        or values[0].dim() != out.dim()
        or any(b == 1 and o != 1 for b, o in zip(values[0].shape, out.shape))
        or 0 in values[0].stride()
    )
    return bias if bias_like and all(_pointwise_use(user) for user in node.users) else None


@functools.lru_cache(maxsize=1)
def _unfused_products() -> frozenset[Any]:
    """``addmm``, and ``baddbmm`` where this torch's Inductor unfuses its bias too (2.14 and later)."""
    products = {torch.ops.aten.addmm.default}
    try:
        from torch._inductor.fx_passes import post_grad
    except Exception:  # noqa: BLE001 - no Inductor: nothing is compiled
        return frozenset(products)
    if hasattr(post_grad, "unfuse_bias_baddbmm_to_pointwise"):
        products.add(torch.ops.aten.baddbmm.default)
    return frozenset(products)


def _pointwise_use(node: fx.Node) -> bool:
    """Inductor's ``is_pointwise_use``: a pointwise operator, or a view or item whose users all are."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or (
        isinstance(target, torch._ops.OpOverload) and any(a.alias_info is not None for a in target._schema.arguments)
    ):
        return all(_pointwise_use(user) for user in node.users)
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


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


def _inductor_flag(name: str) -> bool:
    """A boolean of Inductor's config (``False`` where this torch has none, as its older versions behave)."""
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001 - no Inductor: nothing is compiled
        return False
    return bool(getattr(config, name, False))


def _inductor_reorders() -> bool:
    return _inductor_flag("reorder_for_peak_memory")


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




def layout_optimized(gm: fx.GraphModule, target: torch.device) -> bool:
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
        >>> channels_last_inputs(gm), sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)
        (2, 2)
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
