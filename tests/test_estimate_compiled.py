"""estimate_memory on ``torch.compile``'d models (on the CPU) against the compiled step's own allocations.

The truth is the CPU allocator's (benchmarks/cpu_allocations.py): ``torch.profiler``'s memory
events report every allocation and free of the CPU allocator, Inductor's buffers included (the
project's CPU counter is a dispatch mode, and dynamo runs no compiled code while one is on: under
it a compiled model runs uncompiled). What a kernel takes and gives back inside one ATen operator
is left out, as the CPU counter and the estimate leave it out (their peak is that of live
tensors); the uncompiled step's truth is checked to equal the estimate of it, which
tests/test_zoo.py holds to the CPU counter's.

The figures: the peak of two steps (forward, loss, backward, AdamW's step, ``zero_grad``) above
nothing, the model's parameters and the batch counted, as the estimate counts them.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_allocations import cpu_allocations, live_tensor_peak, unique_bytes  # noqa: E402
from benchmarks.zoo import compile_unavailable, models  # noqa: E402
from pytorch_mem_profiler import estimate_memory  # noqa: E402
from pytorch_mem_profiler.estimate import compiled as compiled_module  # noqa: E402
from pytorch_mem_profiler.estimate.compiled import GraphRun, compile_options  # noqa: E402
from pytorch_mem_profiler.estimate.inductor_plan import plan_graph  # noqa: E402
from pytorch_mem_profiler.estimate.counter import StorageLifeCounter  # noqa: E402
from pytorch_mem_profiler.torch_versions import INDUCTOR_PLAN_MODELLED  # noqa: E402

pytestmark = pytest.mark.skipif(compile_unavailable() is not None, reason=str(compile_unavailable()))

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
COMPILED = "estimated as compiled"
#: the tests of the estimate as compiled need the releases whose Inductor it models
MODELLED = pytest.mark.skipif(not INDUCTOR_PLAN_MODELLED, reason=f"torch {torch.__version__}'s Inductor is not modelled: estimated uncompiled")


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention with dropout, a GELU MLP."""

    def __init__(self, dim: int = 128, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(p), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class SmallCNN(nn.Module):
    """Convolutions with BatchNorm and ReLU, a strided convolution, global average pooling."""

    def __init__(self, c: int = 16, classes: int = 10, pool: bool = False) -> None:
        super().__init__()
        down: list[nn.Module] = [nn.MaxPool2d(2)] if pool else []
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, stride=1 if pool else 2), nn.BatchNorm2d(2 * c), nn.ReLU(), *down,
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


#: name -> (build, inputs(batch), targets(batch), loss, batch)
MODELS = {
    # the zoo's compiled model, 4 blocks: its peak at the start of backward, where the order of kernels counts
    "mlp": (lambda: models.MLPMixerish(dim=256, layers=4, classes=10), lambda b: torch.randn(b, 64, 256),
            lambda b: torch.randint(0, 10, (b,)), F.cross_entropy, 8),
    # 8 blocks: the residual sum is read by 5 buffers and becomes one (its peak at the end of forward)
    "mlp8": (lambda: models.MLPMixerish(dim=128, layers=8, classes=10), lambda b: torch.randn(b, 64, 128),
             lambda b: torch.randint(0, 10, (b,)), F.cross_entropy, 8),
    "transformer": (TinyTransformer, lambda b: torch.randint(0, 512, (b, 64)), lambda b: torch.randint(0, 512, (b, 64)),
                    token_loss, 8),
    "cnn": (SmallCNN, lambda b: torch.randn(b, 3, 32, 32), lambda b: torch.randint(0, 10, (b,)), F.cross_entropy, 8),
}  # fmt: skip


@functools.lru_cache(maxsize=None)
def measured_peak(name: str, compile_it: bool = True, wrap=None) -> int:
    """The peak of two real steps of ``name`` (compiled, or ``wrap(model)``), its first step (compiling) run before."""
    build, inputs, targets, loss_fn, batch = ALL[name]
    torch.manual_seed(0)
    model = build()
    run = wrap(model) if wrap is not None else torch.compile(model) if compile_it else model
    x, y = inputs(batch), targets(batch)
    optimizer = ADAMW(model.parameters())

    def step() -> None:
        out = run(x)  # kept to the step's end, as the estimate's step keeps it
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out, loss

    step()
    optimizer = ADAMW(model.parameters())  # the estimate's steps start without optimizer state
    base = unique_bytes([*model.parameters(), *model.buffers(), x, y])
    return base + live_tensor_peak(cpu_allocations(lambda: (step(), step())))


def uncompiled(model: nn.Module) -> nn.Module:
    return model


@functools.lru_cache(maxsize=None)
def estimate(name: str, wrap=torch.compile):
    build, inputs, targets, loss_fn, batch = ALL[name]
    return estimate_memory(
        lambda: wrap(build()), inputs, targets=targets, loss_fn=loss_fn, optimizer=ADAMW, batch_size=batch,
        device="cpu", fit=False,
    )  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _reset_dynamo():
    yield
    measured_peak.cache_clear()
    estimate.cache_clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_the_allocator_truth_of_an_uncompiled_step_is_the_estimates(name):
    assert measured_peak(name, compile_it=False) == estimate(name, wrap=uncompiled).peak


@MODELLED
@pytest.mark.parametrize("name", list(MODELS))
def test_a_compiled_model_is_estimated_as_inductor_runs_it(name):
    measured = measured_peak(name)
    est = estimate(name)
    eager = estimate(name, wrap=uncompiled)
    assert est.notes and COMPILED in est.notes[0], est.notes
    assert not est.error_bounds
    # within 0.05% (exact on the transformer and the 8-block MLP; 8 KiB under on the 4-block MLP, 40 B over on the CNN) ...
    assert abs(est.peak - measured) <= 5e-4 * measured, f"{name}: estimated {est.peak:,} B, measured {measured:,} B"
    # ... where the uncompiled estimate is 0.8% to 13% over
    assert eager.peak - measured >= 5e-3 * measured, (name, eager.peak, measured)


@pytest.mark.xfail(
    strict=True,
    reason="max pooling's backward on the CPU: Inductor scatters through ATen (config.cpp."
    "fallback_scatter_reduce_sum) with its int64 indices made twice, in two layouts; the estimate "
    "makes them once (estimated 4,629,240 B, measured 5,219,000 B, -11.3%); on CUDA the scatter is one kernel",
)
@MODELLED
def test_max_pooling_on_the_cpu():
    measured, est = measured_peak("cnn_pool"), estimate("cnn_pool")
    assert abs(est.peak - measured) <= 5e-4 * measured, (est.peak, measured)


# -- what is not estimated as compiled ------------------------------------------------------
class Broken(nn.Module):
    """Two linear layers with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


class Outer(nn.Module):
    """The MLP as a compiled submodule of an uncompiled model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(MODELS["mlp"][0]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Cache:
    """An object pytree does not know, holding tensors (as a language model's key-value cache does)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.layers = [{"keys": keys}, {"values": values}]
        self.seen = keys.shape[1]


class CachingMLP(nn.Module):
    """Returns its logits and a :class:`Cache` of two hidden states, as a causal language model returns its cache."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        h = F.gelu(self.a(x))
        k = self.b(h)
        return self.head((x + k).mean(dim=1)), Cache(k, h)


class ReadsOnlyEager(nn.Module):
    """Reads a value in Python unless compiling, as libraries do (``if not torch.compiler.is_compiling()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MODELS["mlp"][0]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and bool((x != x).any()):  # NaN check: dynamo leaves it out
            raise ValueError("NaN in the input")
        return self.body(x)


def gpt2(**config: Any) -> nn.Module:
    """A small transformers GPT-2 (tied embeddings and a key-value cache in its output by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, **config))


def logits_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return token_loss(out.logits, targets)


TOKENS = (lambda b: torch.randint(0, 512, (b, 64)), lambda b: torch.randint(0, 512, (b, 64)), logits_loss, 8)

#: every model the tests run, by name
ALL = {
    **MODELS,
    "cnn_pool": (functools.partial(SmallCNN, pool=True), *MODELS["cnn"][1:]),
    "broken": (Broken, lambda b: torch.randn(b, 512, 256), lambda b: torch.randn(b, 512, 256), F.mse_loss, 4),
    "outer": (Outer, *MODELS["mlp"][1:]),
    "caching": (CachingMLP, lambda b: torch.randn(b, 64, 128), lambda b: torch.randint(0, 10, (b,)),
                lambda out, y: F.cross_entropy(out[0], y), 8),
    "reads_only_eager": (ReadsOnlyEager, *MODELS["mlp"][1:]),
    "gpt2": (gpt2, *TOKENS),
    "gpt2_untied": (functools.partial(gpt2, tie_word_embeddings=False), *TOKENS),
    "gpt2_no_cache": (functools.partial(gpt2, use_cache=False), *TOKENS),
    "lstm": (lambda: models.RecurrentLM("lstm", vocab=512, dim=64), lambda b: torch.randint(0, 512, (b, 32)),
             lambda b: torch.randint(0, 512, (b, 32)), token_loss, 8),
}  # fmt: skip


@MODELLED
def test_a_graph_break_falls_back_to_the_uncompiled_estimate_with_a_bound():
    est, eager, measured = estimate("broken"), estimate("broken", wrap=uncompiled), measured_peak("broken")
    assert "estimated uncompiled: 1 graph break" in est.notes[0], est.notes
    assert est.peak == eager.peak
    bound = est.error_bounds["torch.compile (model, estimated uncompiled)"]
    assert bound == est.peak_breakdown["activations"] + est.peak_breakdown["activation_gradients"] > 0
    assert est.peak - bound <= measured <= est.peak, (est.peak, bound, measured)
    assert "± " in str(est)


# -- what a forward returns, and what it reads while traced ------------------------------------
@MODELLED
def test_an_output_object_pytree_does_not_know_is_estimated_as_compiled_to_the_byte():
    # AOTAutograd refuses an output it cannot flatten; the object's tensors are the forward graph's outputs
    est = estimate("caching")
    assert COMPILED in est.notes[0], est.notes
    assert est.peak == measured_peak("caching")


@MODELLED
def test_the_module_is_traced_as_dynamo_traces_it_and_the_flag_is_put_back():
    # the eager path reads a value (a NaN check), which a fake tensor has not; dynamo's path does not
    est = estimate("reads_only_eager")
    assert COMPILED in est.notes[0], est.notes
    assert est.peak == estimate("mlp").peak  # the same compiled MLP's (8 KiB under its measured peak, as above)
    measured = measured_peak("reads_only_eager")
    assert abs(est.peak - measured) <= 5e-4 * measured, (est.peak, measured)
    assert not torch.compiler.is_compiling()


@MODELLED
@pytest.mark.parametrize("name", ["gpt2_untied", "gpt2_no_cache"])
def test_a_transformers_causal_lm_is_estimated_as_compiled_to_the_byte(name):
    pytest.importorskip("transformers")
    est = estimate(name)
    # its key-value cache (a DynamicCache) is an output pytree does not know; without the cache its
    # attention mask is made on the path transformers takes while dynamo compiles, which reads no value
    assert COMPILED in est.notes[0], est.notes
    assert not est.error_bounds
    assert est.peak == measured_peak(name), (est.peak, measured_peak(name))


@MODELLED
def test_a_transformers_causal_lm_with_tied_embeddings_and_its_cache_is_estimated_as_compiled():
    pytest.importorskip("transformers")
    est, eager = estimate("gpt2"), estimate("gpt2", wrap=uncompiled)
    measured = measured_peak("gpt2")
    assert COMPILED in est.notes[0], est.notes
    # Known gap: in a fresh process the compiled step measures 23,023,224 B and the estimate is 2.0% under
    # it, in backward; after another GPT-2 was compiled in the process (dynamo reuses that graph for the
    # tied model) it measures 22,565,496 B, the estimate's figure. Run uncompiled it would be 30% over.
    assert abs(est.peak - measured) <= 0.025 * measured, (est.peak, measured)
    assert eager.peak - measured >= 0.2 * measured, (eager.peak, measured)


def test_a_trace_that_fails_leaves_the_eager_estimate_to_the_byte(monkeypatch):
    pytest.importorskip("transformers")
    from benchmarks.zoo import ZOO

    entry = ZOO["gpt2"]
    kwargs = dict(
        targets=entry.targets("small"), loss_fn=entry.loss, optimizer=entry.optimizer, batch_size=entry.batch["small"],
        autocast=entry.autocast, device="cuda", emulate=True, fit=False,
    )  # fmt: skip
    eager = estimate_memory(lambda: entry.build("small"), entry.inputs("small"), **kwargs)

    def fails(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("a trace that fails")

    monkeypatch.setattr(compiled_module, "_trace", fails)
    # the graph-break check before the trace runs dynamo, whose leftovers in reference cycles once kept the
    # first step's output (GPT-2's logits and cache, 98,304 B) alive into the second
    fallen_back = estimate_memory(lambda: torch.compile(entry.build("small")), entry.inputs("small"), **kwargs)
    assert "the trace failed under the fake mode (RuntimeError: a trace that fails)" in fallen_back.notes[0]
    assert fallen_back.peak == eager.peak and dict(fallen_back.phases) == dict(eager.phases)


@MODELLED
def test_a_module_dynamo_captures_no_graph_of_is_its_eager_step():
    # dynamo skips a forward holding an nn.LSTM (torch._dynamo.config.allow_rnn is off): the compiled
    # model runs eagerly, and so is it estimated, where tracing it as one graph was 7% over on the CPU
    est, eager, measured = estimate("lstm"), estimate("lstm", wrap=uncompiled), measured_peak("lstm")
    assert "estimated uncompiled: dynamo captured no graph of it" in est.notes[0], est.notes
    assert est.peak == eager.peak == measured


EAGER_BACKEND = functools.partial(torch.compile, backend="eager")


def test_the_eager_backend_is_the_uncompiled_step_without_a_bound():
    est, eager = estimate("mlp", wrap=EAGER_BACKEND), estimate("mlp", wrap=uncompiled)
    assert "backend='eager'" in est.notes[0] and not est.error_bounds
    assert est.peak == eager.peak == measured_peak("mlp", wrap=EAGER_BACKEND)


@MODELLED
def test_on_cuda_the_note_says_compiling_a_new_shape_is_not_counted():
    # a process that compiles times candidate kernels on the GPU (an H200 reserved 803 MB more for the zoo's
    # compiled MLP at 141 than the estimate, and ran it under the card once Inductor's cache held the code)
    build, inputs, targets, loss_fn, batch = MODELS["mlp"]
    on_cuda = estimate_memory(
        lambda: torch.compile(build()), inputs, targets=targets, loss_fn=loss_fn, optimizer=ADAMW,
        batch_size=batch, device="cuda", emulate=True, fit=False,
    )  # fmt: skip
    assert COMPILED in on_cuda.notes[0] and "not counted: what Inductor takes while it compiles a new shape" in on_cuda.notes[0]
    assert "not counted" not in estimate("mlp").notes[0]  # on the CPU: no such note


@MODELLED
def test_cuda_graphs_fall_back_on_cuda_only():
    reduce_overhead = functools.partial(torch.compile, mode="reduce-overhead")
    assert compile_options(reduce_overhead(nn.Linear(2, 2))).cudagraphs
    est = estimate("mlp", wrap=reduce_overhead)
    assert COMPILED in est.notes[0]
    build, inputs, targets, loss_fn, batch = MODELS["mlp"]
    on_cuda = estimate_memory(
        lambda: reduce_overhead(build()), inputs, targets=targets, loss_fn=loss_fn, optimizer=ADAMW,
        batch_size=batch, device="cuda", emulate=True, fit=False,
    )  # fmt: skip
    assert "CUDA graphs" in on_cuda.notes[0] and on_cuda.error_bounds


# -- how a model is compiled ----------------------------------------------------------------
@MODELLED
def test_module_compile_and_a_compiled_submodule_are_found():
    def compiled_in_place(model: nn.Module) -> nn.Module:
        model.compile()
        return model

    whole = estimate("mlp")
    in_place = estimate("mlp", wrap=compiled_in_place)

    assert COMPILED in in_place.notes[0] and in_place.peak == whole.peak
    inner = estimate("outer", wrap=uncompiled)
    assert inner.notes == ("torch.compile'd body: estimated as compiled (Inductor's partition, fusion and memory planning)",)
    assert inner.peak == whole.peak
    assert any(module.startswith("body") for module, _ in inner.layers.by_module)


@MODELLED
def test_the_users_compiled_model_is_left_as_it_was():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = models.MLPMixerish(dim=32, layers=2, classes=10)
    model.compile()
    compiled_call = model._compiled_call_impl
    x = torch.randn(2, 64, 32)
    with torch.no_grad():
        model(x)  # compiled for inference: one graph to compile
    code = type(model).forward.__code__
    entries = len(_debug_get_cache_entry_list(code))
    est = estimate_memory(model, x, optimizer=ADAMW, device="cpu", fit=False)
    assert COMPILED in est.notes[0]
    assert model._compiled_call_impl is compiled_call
    # dynamo keeps its compiled code on the user's code object: no entry added, none reset
    assert len(_debug_get_cache_entry_list(code)) == entries > 0
    assert all(type(p) is nn.Parameter and not isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())


# -- the graph runner on a graph with bytes computed by hand -----------------------------------
def test_fused_values_are_not_allocated_and_a_kernel_output_takes_a_dying_buffers_place():
    from torch.fx.experimental.proxy_tensor import make_fx

    from pytorch_mem_profiler.estimate.fake import fake_mode

    def f(x, w, v):
        h = torch.ops.aten.mm.default(x, w)  # a kernel of its own: 64 x 256 float32
        g = torch.ops.aten.add.Tensor(torch.ops.aten.mul.Tensor(h, 0.5), 1.0)  # fused: never allocated
        r = torch.ops.aten.relu.default(g)  # read by a kernel: a buffer, written over h, which dies there
        return (torch.ops.aten.mm.default(r, v),)  # 64 x 16 float32

    mode = fake_mode()
    with mode:
        x, w, v = torch.empty(64, 128), torch.empty(128, 256), torch.empty(256, 16)
        gm = make_fx(f)(x, w, v)
    plan = plan_graph(gm.graph, reorder=False)
    assert [plan.kinds[n] for n in ("mm", "mul", "add", "relu", "mm_1")] == ["kernel", "fused", "fused", "realized", "kernel"]
    assert plan.in_place == {plan.order.index("relu"): "mm"}
    counter = StorageLifeCounter(torch.device("cpu"))
    with mode:
        run = GraphRun(gm, counter)
        counter.start()
        try:
            (out,) = run([x, w, v])
        finally:
            counter.stop()
    # h (then r in its place) and the output: not h * 0.5, not h * 0.5 + 1, not r beside h
    assert counter.peak == 64 * 256 * 4 + 64 * 16 * 4
    assert tuple(out.shape) == (64, 16)


def _residual_linears(blocks: int):
    """``x + linear(relu(x))``, ``blocks`` times, then a sum: traced as AOTAutograd hands Inductor a graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from pytorch_mem_profiler.estimate.fake import fake_mode

    aten = torch.ops.aten

    def f(x, *weights):
        for w, b in zip(weights[::2], weights[1::2]):
            h = aten.relu.default(x)  # read by the matrix product: a buffer
            x = aten.add.Tensor(x, aten.addmm.default(b, h, aten.t.default(w)))
        return (aten.sum.default(x),)

    with fake_mode():
        args = [torch.empty(64, 32)] + [t for _ in range(blocks) for t in (torch.empty(32, 32), torch.empty(32))]
        return make_fx(f)(*args)


def test_on_a_gpu_a_linear_bias_is_read_where_the_sum_is_and_the_residual_stream_is_stored_sooner():
    # Inductor on a GPU runs addmm(bias, a, b) whose users are all pointwise as mm(a, b) + bias, the
    # addition fused into the users (post_grad's unfuse_bias_add_to_pointwise): each block then adds two
    # reads to the residual sum (the product and the bias), one on the CPU, where addmm stays whole. A sum
    # read by two nodes (the next block's relu and its addition) is stored once it reads more than
    # realize_reads_threshold (4) buffers: counted by hand, after the second, fourth and sixth block on a
    # GPU (x, 2 + 2 reads), after the fourth on the CPU (x and four products); the last sum has one reader.
    gm = _residual_linears(7)
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    on_gpu = plan_graph(gm.graph, reorder=False, device_type="cuda")
    on_cpu = plan_graph(gm.graph, reorder=False, device_type="cpu")
    assert [i for i, n in enumerate(adds, 1) if on_gpu.kinds[n.name] == "realized"] == [2, 4, 6]
    assert [i for i, n in enumerate(adds, 1) if on_cpu.kinds[n.name] == "realized"] == [4]
    addmms = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert {on_gpu.kinds[n] for n in addmms} == {on_cpu.kinds[n] for n in addmms} == {"kernel"}


def test_an_addmm_read_by_a_kernel_or_left_as_an_output_keeps_its_bias():
    from pytorch_mem_profiler.estimate.inductor_plan import _unfused_bias

    gm = _residual_linears(2)
    first, second = [n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert _unfused_bias(first) is first.args[0] and _unfused_bias(second) is second.args[0]
    # the same product also read by a matrix product (not pointwise): Inductor keeps addmm whole
    user = gm.graph.call_function(torch.ops.aten.mm.default, (first, first))
    assert _unfused_bias(first) is None
    gm.graph.erase_node(user)
    assert _unfused_bias(first) is first.args[0]


def test_a_pause_counts_nothing_and_storages_counted_before_still_die():
    counter = StorageLifeCounter(torch.device("cpu"))
    counter.start()
    try:
        a = torch.zeros(256)
        with counter.paused():
            b = torch.zeros(1024)
            del a
        c = torch.zeros(64)
    finally:
        counter.stop()
    assert counter.peak == 1024 and counter.read().allocated == 256
    del b, c


@MODELLED
def test_a_compiled_transformer_emulating_cuda_traces_cudas_attention_kernel(monkeypatch):
    graphs: list[fx.GraphModule] = []
    original = GraphRun.__init__

    def keep(self, gm, counter, **kwargs):
        graphs.append(gm)
        original(self, gm, counter, **kwargs)

    monkeypatch.setattr(compiled_module.GraphRun, "__init__", keep)
    build, inputs, targets, loss_fn, batch = MODELS["transformer"]
    est = estimate_memory(
        lambda: torch.compile(build()), inputs, targets=targets, loss_fn=loss_fn, optimizer=ADAMW, batch_size=batch,
        device="cuda", emulate=True, fit=False,
    )  # fmt: skip
    assert est.emulated and COMPILED in est.notes[0]
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten._scaled_dot_product_efficient_attention.default" in ops  # float32 on CUDA: the efficient kernel
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in ops


@pytest.mark.skipif(INDUCTOR_PLAN_MODELLED, reason="this torch's Inductor is modelled: estimated as compiled")
def test_where_inductor_is_not_modelled_a_compiled_model_is_estimated_uncompiled_saying_why():
    model = torch.compile(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    est = estimate_memory(model, torch.randn(4096, 64), optimizer=ADAMW, device="cpu", fit=False)
    assert len(est.notes) == 1 and "estimated uncompiled" in est.notes[0] and torch.__version__ in est.notes[0]
    assert est.peak_phase == "backward" and est.error_bounds  # what compiling could have saved at the peak: the bound
