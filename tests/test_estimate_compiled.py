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


#: every model the tests run, by name
ALL = {
    **MODELS,
    "cnn_pool": (functools.partial(SmallCNN, pool=True), *MODELS["cnn"][1:]),
    "broken": (Broken, lambda b: torch.randn(b, 512, 256), lambda b: torch.randn(b, 512, 256), F.mse_loss, 4),
    "outer": (Outer, *MODELS["mlp"][1:]),
}


@MODELLED
def test_a_graph_break_falls_back_to_the_uncompiled_estimate_with_a_bound():
    est, eager, measured = estimate("broken"), estimate("broken", wrap=uncompiled), measured_peak("broken")
    assert "estimated uncompiled: 1 graph break" in est.notes[0], est.notes
    assert est.peak == eager.peak
    bound = est.error_bounds["torch.compile (model, estimated uncompiled)"]
    assert bound == est.peak_breakdown["activations"] + est.peak_breakdown["activation_gradients"] > 0
    assert est.peak - bound <= measured <= est.peak, (est.peak, bound, measured)
    assert "± " in str(est)


EAGER_BACKEND = functools.partial(torch.compile, backend="eager")


def test_the_eager_backend_is_the_uncompiled_step_without_a_bound():
    est, eager = estimate("mlp", wrap=EAGER_BACKEND), estimate("mlp", wrap=uncompiled)
    assert "backend='eager'" in est.notes[0] and not est.error_bounds
    assert est.peak == eager.peak == measured_peak("mlp", wrap=EAGER_BACKEND)


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
