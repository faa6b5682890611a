"""Each answer of :mod:`pytorch_mem_profiler.torch_versions` held against what the installed torch does.

Run on every torch the project supports (2.4 here, CI's 2.13, the GPU machine's 2.11, the
newest): an answer that a release makes wrong fails here, not as a wrong figure elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler.torch_versions import (
    COMPILE_YIELDS_TO_DISPATCH_MODES,
    FSDP2_ON_CPU,
    SDPA_ENABLE_GQA,
    TORCH_VERSION,
    attention_softmax,
    fake_tolist_reads_values,
    math_attention_upcasts,
    release,
)


class _Ops(TorchDispatchMode):
    """The operators that ran inside the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_release_reads_every_kind_of_version_string():
    assert release("2.4.1+cu121") == (2, 4)
    assert release("2.13.0+cpu") == (2, 13)
    assert release("2.11.0a0+git0123abc") == (2, 11)
    assert release(torch.__version__) == TORCH_VERSION >= (2, 4)
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        release("nightly")


def test_enable_gqa_is_answered_as_attention_takes_it():
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    try:
        out = nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError as err:
        assert "enable_gqa" in str(err)
        assert not SDPA_ENABLE_GQA
    else:
        assert SDPA_ENABLE_GQA and out.shape == (1, 4, 8, 16)


def _math_attention_ops(dtype: torch.dtype) -> list[str]:
    ops = _Ops()
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 16, dtype=dtype, requires_grad=True)
        with ops:
            torch.ops.aten._scaled_dot_product_attention_math(q, q, q, None, 0.0, False)
    return ops.names


def test_the_softmax_is_the_one_atens_math_attention_runs():
    ran = [name for name in _math_attention_ops(torch.float32) if "softmax" in name]
    ops, scores = _Ops(), torch.zeros(2, 4)
    with ops:
        out = attention_softmax(scores)
    assert ops.names == ran == (["aten._safe_softmax"] if TORCH_VERSION >= (2, 5) else ["aten._softmax"])
    assert out.sum().item() == 2.0
    # the point of _safe_softmax: a row masked out entirely gives zeros where softmax gives NaN
    masked = attention_softmax(torch.full((1, 4), float("-inf")))
    assert masked.isnan().all() if ran == ["aten._softmax"] else masked.eq(0).all()


def test_the_float32_copies_follow_atens_math_attention_and_its_switch():
    def copies() -> int:
        return _math_attention_ops(torch.bfloat16).count("aten._to_copy")

    assert (copies() > 0) == math_attention_upcasts() == (TORCH_VERSION >= (2, 5))
    switch = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    if switch is None:
        return  # torch 2.4: no switch, and no copies
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        switch(True)  # reductions in bf16: no float32 copies
        assert copies() == 0 and not math_attention_upcasts()
    finally:
        switch(allowed)
    assert math_attention_upcasts() == (not allowed)


def test_fsdp2_on_the_cpu_runs_where_it_is_said_to():
    if torch.cuda.is_available() and not FSDP2_ON_CPU:
        pytest.skip("with a GPU, torch 2.4's FSDP2 finds the CUDA streams it makes")
    from torch.distributed.device_mesh import init_device_mesh

    from pytorch_mem_profiler.estimate.parallel import fake_process_group, fully_shard_function

    model = nn.Linear(8, 8)
    with fake_process_group(2):
        fully_shard_function()(model, mesh=init_device_mesh("cpu", (2,)))
        try:
            out = model(torch.randn(2, 8))
        except RuntimeError as err:  # torch 2.4: its streams need CUDA's driver
            assert not FSDP2_ON_CPU and "CUDA" in str(err), err
        else:
            assert FSDP2_ON_CPU and out.shape == (2, 8)


def _counting_backend(runs: list[int]):  # type: ignore[no-untyped-def]
    """A ``torch.compile`` backend whose compiled code appends to ``runs`` each time it runs."""

    def backend(graph, example_inputs):  # type: ignore[no-untyped-def]
        def compiled(*args):  # type: ignore[no-untyped-def]
            runs.append(1)
            return graph.forward(*args)

        return compiled

    return backend


def test_compiled_code_under_a_dispatch_mode_runs_as_said():
    runs: list[int] = []
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: (x.sin() * 2).cos(), backend=_counting_backend(runs))
        x = torch.randn(4)
        expected = f(x)
        assert len(runs) == 1  # compiled, outside any mode
        ops = _Ops()
        with ops:
            got = f(x)
        # later torch runs the frame eagerly under the mode; 2.4 runs the compiled code
        assert len(runs) == (1 if COMPILE_YIELDS_TO_DISPATCH_MODES else 2)
        assert "aten.sin" in ops.names and torch.allclose(got, expected)
    finally:
        torch._dynamo.reset()


def test_an_estimate_of_a_compiled_model_is_its_eager_steps_and_leaves_its_compiled_code_alone():
    # torch 2.4 failed compiling the fake step (a fake mode of its own); torch 2.13 skipped the frame
    # under the estimate's counting mode and then for good: the user's model ran eagerly ever after
    from pytorch_mem_profiler.estimate import estimate_memory

    runs: list[int] = []
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        compiled = torch.compile(eager, backend=_counting_backend(runs))
        x = torch.randn(8, 16)
        compiled(x)
        assert len(runs) == 1
        inner = nn.Linear(16, 32)
        partly = nn.Sequential(torch.compile(inner, backend=_counting_backend(runs)), nn.GELU())
        partly.compile(backend=_counting_backend(runs))  # nn.Module.compile(): in place
        for model, twin in ((compiled, eager), (partly, nn.Sequential(inner, nn.GELU()))):
            estimate = estimate_memory(model, x, device="cpu", fit=False)
            reference = estimate_memory(twin, x, device="cpu", fit=False)
            assert estimate.peak == reference.peak > 0 and estimate.weights == reference.weights
        assert len(runs) == 1  # nothing compiled ran in the fake steps
        expected = eager(x)
        assert torch.allclose(compiled(x), expected)
        assert len(runs) == 2  # the user's compiled code runs after the estimates
    finally:
        torch._dynamo.reset()


def test_the_cpu_profiler_says_how_this_torch_runs_a_compiled_model_under_its_counter(caplog):
    """Torch 2.13 runs the compiled frame eagerly while the counter counts (the figures are the
    uncompiled step's); torch 2.4 runs the compiled code, whose tensors the counter misses. Each
    gets its warning."""
    import io

    from pytorch_mem_profiler import memory_profiler

    runs: list[int] = []
    torch._dynamo.reset()
    try:
        model = torch.compile(nn.Linear(64, 64), backend=_counting_backend(runs))
        with caplog.at_level("WARNING", logger="pytorch_mem_profiler"):
            with memory_profiler(model, 1, stream=io.StringIO()) as profiler:
                model(torch.randn(8, 64)).sum().backward()
                record = profiler.record_stats()
        messages = [r.getMessage() for r in caplog.records]
        if COMPILE_YIELDS_TO_DISPATCH_MODES:
            assert not runs  # no compiled code ran under the counter: the frame ran eagerly
            assert any("runs a compiled model's frames eagerly" in m for m in messages), messages
        else:
            assert len(runs) == 1  # the compiled code ran, under the counter
            assert any("runs a compiled model's code past the CPU counter" in m for m in messages), messages
        assert record.weights == (64 * 64 + 64) * 4  # what the counter adopted is still right
    finally:
        torch._dynamo.reset()


def test_fake_tolist_reads_values_answers_as_fake_tensors_read_a_value():
    """Where the answer is yes, ``tolist()`` of a fake tensor with a value gives the value under a mode
    that keeps values; where it is no, torch's ``tolist`` makes symbols (torch 2.4)."""
    import inspect

    from torch._subclasses.fake_tensor import FakeTensor

    makes_symbols = "create_unbacked_symint" in inspect.getsource(FakeTensor.tolist)
    assert fake_tolist_reads_values() is not makes_symbols
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode, mode.draws.on():
        drawn = torch.randperm(3)
        assert sorted(drawn.tolist()) == [0, 1, 2]  # on every torch, the estimate's step reads the draw


def test_dynamos_frame_hook_is_read_alike_both_ways_and_left_as_it_was():
    # torch offers get_eval_frame_callback (2.13); where it does not, the hook is read by setting it
    from pytorch_mem_profiler import torch_versions

    if torch_versions.set_dynamo_frame_hook is None:
        pytest.skip("this torch has no Dynamo")
    assert torch_versions.dynamo_frame_hook() is None  # eager code: nothing would be compiled
    assert torch_versions._read_by_setting() is None
    # False: Dynamo's run-only hook (cached code runs, no frame is compiled), safe to hold here
    prior = torch_versions.set_dynamo_frame_hook(False)
    try:
        assert torch_versions._read_by_setting() is False
        assert torch_versions.dynamo_frame_hook() is False  # put back: read again alike
    finally:
        torch_versions.set_dynamo_frame_hook(prior)
    assert torch_versions.dynamo_frame_hook() is None


def test_never_compiled_marks_the_code_by_whichever_call_this_torch_has(monkeypatch):
    import types

    from pytorch_mem_profiler import torch_versions

    def sample() -> None:
        pass

    marked: list = []
    # a torch before the frame execution strategies: skip_code(code)
    monkeypatch.setattr(torch_versions, "_EVAL_FRAME", types.SimpleNamespace(skip_code=marked.append))
    torch_versions.never_compiled(sample.__code__)
    assert marked == [sample.__code__]

    # one that answers otherwise: nothing raised at import, the frame compiled as before
    def refuse(code) -> None:  # type: ignore[no-untyped-def]
        raise TypeError("incompatible function arguments")

    monkeypatch.setattr(torch_versions, "_EVAL_FRAME", types.SimpleNamespace(skip_code=refuse))
    torch_versions.never_compiled(sample.__code__)
