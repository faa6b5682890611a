"""``estimate_memory`` on steps that read the value of a random draw (LayerDrop, stochastic depth, a
random per-step choice), against the CPU counter's measurement of a real step.

By default (``random_draws="largest"``) a uniform draw is put at an end of its range, the top and
then the bottom, and the larger step kept: a LayerDrop model's estimate is then the measured peak of
its step that skips no layer (the same model at ``p = 0``), whichever way its code compares the draw.
With ``random_draws="seeded"`` the estimate draws from its own generator, seeded with ``draws.SEED``
at each fake step; a real step seeded the same way (``torch.manual_seed(SEED)`` before its two steps,
nothing else drawing) makes the same draws in the same order, so it takes the same branches: its
peak, measured by the profiler's CPU counter, is the truth. Reads of values that depend on the
inputs or the weights stay refused, naming the operation and the line.
"""

from __future__ import annotations

import functools
import inspect
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler, estimate_memory
from pytorch_mem_profiler.estimate import EstimateUnsupported
from pytorch_mem_profiler.estimate.draws import SEED

from .helpers import measured_peak

CPU = torch.device("cpu")
ADAM = torch.optim.Adam


class LayerDrop(nn.Module):
    """A stack of wide layers, each skipped in training when ``torch.rand([]) < p`` (BART's LayerDrop),
    and a head that always runs."""

    def __init__(self, p: float, layers: int = 6, width: int = 256) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:  # the line a read is noted at
                continue
            x = x + layer(x)
        return self.head(x)


class VectorDrop(LayerDrop):
    """fairseq's ``LayerDropModuleList``: one vector of draws per forward, indexed per layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draws = torch.empty(len(self.layers)).uniform_()
        for i, layer in enumerate(self.layers):
            if draws[i] > self.p:
                x = x + layer(x)
        return self.head(x)


class SurvivalDrop(LayerDrop):
    """Stochastic depth written with a survival probability: a layer runs when its draw is below it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if not self.training or torch.rand(1).item() < 1.0 - self.p:
                x = x + layer(x)
        return self.head(x)


class RandomChoices(nn.Module):
    """Per-step choices made with torch: ``randint(...).item()``, ``rand(1).item()``, a Bernoulli
    draw into a new tensor, a random permutation's slice read as a list."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.branches[int(torch.randint(0, 3, ()).item())](x)
        if torch.rand(1).item() < 0.5:
            x = x * 2
        if bool(x.new_empty(()).bernoulli_(0.5)):
            x = torch.relu(x)
        for i in torch.randperm(3)[:2].tolist():
            x = self.branches[i](x)
        return x


def measured(build, x_shape, optimizer=ADAM, steps: int = 2) -> int:
    """The profiler's largest iteration peak over ``steps`` real steps drawing from ``SEED``."""

    def make_input() -> torch.Tensor:
        x = torch.zeros(x_shape)
        torch.manual_seed(SEED)  # the estimate's draws, in the same order
        return x

    return measured_peak(build, make_input, optimizer, steps=steps)


def line_of(cls, text: str) -> str:
    source, first = inspect.getsourcelines(cls)
    number = first + next(i for i, line in enumerate(source) if text in line)
    return f"{inspect.getsourcefile(cls)}:{number}"


SEEDED = {"random_draws": "seeded"}


@pytest.mark.parametrize("cls,end", [(LayerDrop, "top"), (VectorDrop, "top"), (SurvivalDrop, "bottom")])
def test_by_default_the_step_is_the_one_that_skips_no_layer(cls, end):
    # whichever way the code compares its draw (draw < p skips, draws[i] > p keeps, draw < 1 - p keeps)
    build = functools.partial(cls, 0.5)
    est = estimate_memory(build, torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False)
    assert est.peak == measured(functools.partial(LayerDrop, 0.0), (64, 256))
    assert est.random_draws == end
    assert f"this one at the {end}, where a LayerDrop step skips no layer" in str(est)
    seeded = estimate_memory(build, torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    assert seeded.peak < est.peak and seeded.random_draws == "seeded"  # the seeded draws skip some
    # p = 1 skips every layer at either end: a probability of one is no draw's choice
    always = estimate_memory(functools.partial(cls, 1.0), torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False)
    assert always.peak == measured(functools.partial(LayerDrop, 1.0), (64, 256))


def test_the_end_chosen_holds_at_every_batch_size_and_in_the_what_ifs():
    est = estimate_memory(functools.partial(SurvivalDrop, 0.5), torch.zeros(64, 256), optimizer=ADAM, device=CPU,
                          compare={"seeded": SEEDED, "sgd": {"optimizer": torch.optim.SGD}})  # fmt: skip
    assert est.fit is not None and est.fit.error is not None and est.fit.error < 1e-9  # the same branches at 2x and 3x
    assert est.random_draws == "bottom" and est.alternatives["sgd"].random_draws == "bottom"
    assert est.alternatives["seeded"].random_draws == "seeded" and est.alternatives["seeded"].peak < est.peak


class Headless(LayerDrop):
    """LayerDrop with nothing after the layers: a step that skips them all has nothing to differentiate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = x + layer(x)
        return x


def test_an_end_whose_step_cannot_run_leaves_the_other_ends():
    # at the bottom every draw is below p: every layer skipped, and backward has no graph (as a real
    # step drawing so would fail); the top's step, which skips none, is the estimate
    build = functools.partial(Headless, 0.5)
    est = estimate_memory(build, torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False)
    assert est.random_draws == "top" and est.peak == measured(functools.partial(Headless, 0.0), (64, 256))
    # where no draw decides anything the step's own error is raised, as it is
    with pytest.raises(RuntimeError, match="does not require grad"):
        estimate_memory(functools.partial(Headless, 1.0), torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False)


def test_the_command_estimates_the_largest_step_unless_told_to_take_the_seeded_draws(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import functools, sys, torch\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[1])!r})\n"
        "from tests.test_estimate_draws import LayerDrop\n"
        "batch_size = 64\n"
        "def build_model():\n    return LayerDrop(0.5)\n"
        "def example_inputs(batch_size):\n    return torch.zeros(batch_size, 256)\n"
    )
    largest = estimate_memory(functools.partial(LayerDrop, 0.5), torch.zeros(64, 256), device=CPU, fit=False)
    seeded = estimate_memory(functools.partial(LayerDrop, 0.5), torch.zeros(64, 256), device=CPU, fit=False, **SEEDED)
    for flags, expected, other in (([], largest, seeded), (["--seeded-draws"], seeded, largest)):
        assert main(["estimate", str(path), "--device", "cpu", "--units", "B", *flags]) == 0
        out = capsys.readouterr().out
        assert f".{expected.peak} B\n" in out and f".{other.peak} B\n" not in out


def test_random_draws_other_than_the_two_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="random_draws must be 'largest' or 'seeded'"):
        estimate_memory(nn.Linear(8, 8), torch.zeros(4, 8), device=CPU, fit=False, random_draws="top")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_uniform_draw_at_the_top_stays_inside_its_range(dtype):
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    mode.draws.extreme = "top"
    with mode, mode.draws.on():
        top = float(torch.rand([], dtype=dtype))
        ranged = torch.empty(3, dtype=dtype).uniform_(-2.0, 6.0)
        values = [float(v) for v in ranged]
    assert 0.0 < top < 1.0 and top >= 1.0 - 2 * torch.finfo(dtype).eps
    assert all(-2.0 < v < 6.0 and v > 5.9 for v in values)
    mode.draws.extreme = "bottom"
    with mode, mode.draws.on():
        assert float(torch.rand([], dtype=dtype)) == 0.0
        assert float(torch.empty(2, dtype=dtype).uniform_(-2.0, 6.0)[1]) == -2.0


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_layerdrop_takes_the_branches_a_real_step_drawing_the_same_numbers_takes(p):
    build = functools.partial(LayerDrop, p)
    est = estimate_memory(build, torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    assert est.peak == measured(build, (64, 256))
    # one read per layer and step, noted at the line that compares the draw
    (line, reads), = est.random_reads.items()
    assert line.startswith(line_of(LayerDrop, "torch.rand([]) < self.p")) and reads == 2 * 6
    assert any("drawn at random" in note and line in note for note in est.notes)
    assert "Note: The step read 12 values drawn at random" in str(est)
    assert "the estimate's own seeded draws" in str(est)


def test_the_draws_decide_the_memory_and_are_the_same_at_every_batch_size():
    kept = estimate_memory(functools.partial(LayerDrop, 0.0), torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    dropped = estimate_memory(functools.partial(LayerDrop, 1.0), torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    half = estimate_memory(functools.partial(LayerDrop, 0.5), torch.zeros(64, 256), optimizer=ADAM, device=CPU, **SEEDED)
    assert dropped.peak < half.peak < kept.peak  # some layers skipped, not all
    again = estimate_memory(functools.partial(LayerDrop, 0.5), torch.zeros(64, 256), optimizer=ADAM, device=CPU, **SEEDED)
    assert again.peak == half.peak and again.fit == half.fit
    # the same layers are skipped at twice and three times the batch: the fit's lines hold
    assert half.fit is not None and half.fit.error is not None and half.fit.error < 1e-9


def test_a_vector_of_draws_indexed_per_layer():
    build = functools.partial(VectorDrop, 0.5)
    est = estimate_memory(build, torch.zeros(64, 256), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    assert est.peak == measured(build, (64, 256))
    assert sum(est.random_reads.values()) == 2 * 6


def test_random_choices_made_with_torch():
    est = estimate_memory(RandomChoices, torch.zeros(32, 128), optimizer=ADAM, device=CPU, fit=False, **SEEDED)
    assert est.peak == measured(RandomChoices, (32, 128))
    assert len(est.random_reads) == 4  # randint().item(), rand(1).item(), bool(bernoulli_), tolist()
    # by default the uniform one at either end, the others seeded as before: never below the seeded step's
    largest = estimate_memory(RandomChoices, torch.zeros(32, 128), optimizer=ADAM, device=CPU, fit=False)
    assert largest.peak >= est.peak and largest.random_draws in ("top", "bottom")


def test_the_process_generator_and_a_given_one_are_left_as_they_were():
    given = torch.Generator().manual_seed(123)

    class Seeded(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) * (1.0 if torch.rand([], generator=given) < 0.5 else 2.0)

    state, given_state = torch.get_rng_state(), given.get_state()
    est = estimate_memory(Seeded, torch.zeros(4, 8), optimizer=ADAM, device=CPU, fit=False)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(given.get_state(), given_state)
    assert sum(est.random_reads.values()) == 2


class ReadsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # an input's value
            return self.fc(x)
        return x


class DrawTimesInput(ReadsItsInput):
    def forward(self, x):
        if torch.rand([]) * x.mean() > 0:  # a draw mixed with an input: the input's value decides
            return self.fc(x)
        return self.fc(-x)


class ReadsAWeight(ReadsItsInput):
    def forward(self, x):
        return self.fc(x) * self.fc.weight.abs().max().item()


@pytest.mark.parametrize(
    "model,text",
    [(ReadsItsInput, "if x.sum() > 0"), (DrawTimesInput, "torch.rand([]) * x.mean() > 0"), (ReadsAWeight, ".item()")],
    ids=["input", "draw-times-input", "weight"],
)
def test_values_that_depend_on_inputs_or_weights_stay_refused_naming_the_line(model, text):
    with pytest.raises(EstimateUnsupported, match="_local_scalar_dense") as caught:
        estimate_memory(model, torch.zeros(4, 8), optimizer=ADAM, device=CPU, fit=False)
    assert line_of(model, text) in str(caught.value)


def test_reading_the_loss_stays_refused():
    def loss_fn(out):
        loss = out.sum()
        print(loss.item(), file=io.StringIO())  # a log line reading the loss
        return loss

    with pytest.raises(EstimateUnsupported, match="_local_scalar_dense") as caught:
        estimate_memory(nn.Linear(8, 8), torch.zeros(4, 8), loss_fn=loss_fn, device=CPU, fit=False)
    assert "loss.item()" in str(caught.value)


def _bart(layerdrop: float):
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=512, d_model=64, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,  # nothing else draws
    )  # fmt: skip
    return BartForConditionalGeneration(config)


def _transformers_missing() -> str | None:
    try:
        import transformers  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import means "not here"
        return f"transformers cannot be imported here ({type(err).__name__})"
    return None


@pytest.mark.skipif(_transformers_missing() is not None, reason=str(_transformers_missing()))
def test_bart_with_layerdrop_is_estimated_as_its_largest_step_or_as_a_real_step_with_the_same_draws():
    from .helpers import transformers_or_skip

    transformers_or_skip()  # transformers 5 imports beside torch < 2.6 but builds no models there
    inputs = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "decoder_input_ids": torch.zeros(2, 8, dtype=torch.long)}

    def loss_fn(out):
        return out.logits.float().sum()

    est = estimate_memory(functools.partial(_bart, 0.5), inputs, optimizer=ADAM, loss_fn=loss_fn, device=CPU, fit=False, **SEEDED)
    assert {line.split(":")[0].rsplit("/", 1)[-1] for line in est.random_reads} == {"modeling_bart.py"}
    assert sum(est.random_reads.values()) == 2 * (3 + 3)  # one draw per layer, encoder and decoder, two steps

    def real_peak(layerdrop: float) -> int:
        def make_input() -> dict[str, torch.Tensor]:
            real = {k: v.clone() for k, v in inputs.items()}
            torch.manual_seed(SEED)  # the estimate's draws, in the same order
            return real

        return measured_peak(functools.partial(_bart, layerdrop), make_input, ADAM, loss_fn=loss_fn)

    assert est.peak == real_peak(0.5)
    # by default: the step that skips no layer, which a run of any length meets (a real one at p = 0)
    largest = estimate_memory(functools.partial(_bart, 0.5), inputs, optimizer=ADAM, loss_fn=loss_fn, device=CPU, fit=False)
    assert largest.peak == real_peak(0.0) > est.peak and largest.random_draws == "top"


class _HostMasked(nn.Module):
    """A time mask drawn with numpy (as wav2vec2's ``_compute_mask_indices``), given to
    ``torch.tensor`` and used to overwrite the masked frames with a learned vector."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.fill = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        h = self.proj(x)
        mask = torch.tensor(np.random.default_rng(0).random(h.shape[:2]) < 0.3, device=h.device)
        h = h.clone()
        h[mask] = self.fill.to(h.dtype)  # index_put_ by a boolean mask: nonzero of its values
        return h


@pytest.mark.parametrize("batch", [2, 16])
def test_a_mask_from_host_data_indexes_with_its_real_shape(batch):
    pytest.importorskip("numpy")
    frames = 40  # batch 16: 640 mask elements, above the size draws give values to
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    measured = measured_peak(_HostMasked, lambda: torch.randn(batch, frames, 16), sgd)
    estimate = estimate_memory(_HostMasked, lambda b: torch.randn(b, frames, 16), optimizer=sgd, batch_size=batch, device="cpu")
    assert estimate.peak == measured
    # the fit's larger batches index by larger masks too, each its own number of rows
    assert estimate.fit is not None and estimate.fit.per_sample > 0


class _GlobalTokens(nn.Module):
    """Longformer's and LED's reading of their mask: the mask of ones made additive in floating point
    (``(1.0 - mask) * finfo.min``, a row per sequence), the global tokens found as its positive
    entries and the global branch taken on ``.any().item()``; here that branch keeps a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        mask[:, :2] = 2  # the first two tokens attend globally, as a user marks them
        additive = (1.0 - mask[:, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        is_global = additive > 0  # 1 - 2 < 0, times finfo.min: positive where a token is global
        h = self.proj(x)
        if is_global.flatten().any().item():
            h = h + h.mean(1, keepdim=True)
        if (additive < 0).flatten().any().item():  # none is masked out: no such branch
            h = h * 0
        return h


@pytest.mark.parametrize("batch", [2, 16])
def test_a_floating_point_mask_made_from_a_mask_of_ones_keeps_its_values(batch):
    """A floating-point mask computed from values alone keeps them up to HOST_VALUE_NUMEL elements
    (here 2 x 300 and 16 x 300, above the SMALL_VALUE_NUMEL a draw gets), so the global branch is
    taken as the real step takes it: estimated to the byte on the CPU, and without a GPU for CUDA."""
    frames = 300
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    measured = measured_peak(_GlobalTokens, lambda: torch.randn(batch, frames, 16), sgd)
    estimate = estimate_memory(_GlobalTokens, lambda b: torch.randn(b, frames, 16), optimizer=sgd, batch_size=batch, device="cpu", fit=False)
    assert estimate.peak == measured
    on_gpu = estimate_memory(_GlobalTokens, lambda b: torch.randn(b, frames, 16), optimizer=sgd, batch_size=batch, device="cuda", fit=False)
    assert on_gpu.peak > 0 and sum(on_gpu.peak_breakdown.values()) == on_gpu.peak


def test_a_floating_point_range_stays_without_values_above_small_value_numel():
    """Ranges, unlike results computed from values, keep floating-point values only up to
    SMALL_VALUE_NUMEL elements: a sinusoidal table made from one each step is not computed for real."""
    from pytorch_mem_profiler.estimate.draws import SMALL_VALUE_NUMEL
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        with mode.draws.on():
            small, large = torch.arange(float(SMALL_VALUE_NUMEL)), torch.arange(float(SMALL_VALUE_NUMEL + 1))
            from_ones = torch.ones(4, SMALL_VALUE_NUMEL) * 3.0
    assert small.constant is not None and large.constant is None
    assert from_ones.constant is not None and float(from_ones.constant.sum()) == 12.0 * SMALL_VALUE_NUMEL


def test_the_line_named_is_a_libraries_whose_folder_begins_like_torchs():
    """torchvision's folder begins with torch's name: its frames are a library's, not torch's."""
    import traceback
    from pathlib import Path

    from pytorch_mem_profiler.estimate.draws import user_line

    torch_dir = Path(torch.__file__).resolve().parent
    sibling = str(torch_dir.parent / "torchvision" / "models" / "detection" / "generalized_rcnn.py")
    frames = [
        traceback.FrameSummary(sibling, 104, "forward", line="if degenerate_boxes.any():"),
        traceback.FrameSummary(str(torch_dir / "nn" / "modules" / "module.py"), 1837, "inner", line="result = forward_call()"),
        traceback.FrameSummary(str(torch_dir / "_ops.py"), 916, "__call__", line="return self._op()"),
    ]
    assert user_line(frames) == f"{sibling}:104: if degenerate_boxes.any():"
    # with no library frame, the innermost of torch.nn or torch.optim
    assert user_line(frames[1:]) == f"{torch_dir / 'nn' / 'modules' / 'module.py'}:1837: result = forward_call()"


def test_the_inputs_keep_the_values_the_user_fixed_and_none_they_did_not():
    """While the inputs are made: integer and boolean factories that are not random keep their values,
    and so do host tensors read and what is computed from them alone; random draws (token ids),
    floating-point data and ``empty`` stay without (their values are not the user's); a fill
    factory's values are the user's whatever its dtype (a floating-point mask of ones)."""
    from pytorch_mem_profiler.estimate.fake import fake_mode

    positions = torch.arange(8).repeat(2, 1)
    mode = fake_mode()
    with mode, mode.draws.inputs():
        ones = torch.ones(3, 8, dtype=torch.long)
        mask = torch.full((3, 8), True)
        arange = torch.arange(8)
        padded = ones.clone()
        padded[0, -2:] = 0
        read = positions[:1] + 1
        ids = torch.randint(0, 10, (3, 8))
        floats = torch.randn(3, 8)
        float_mask = torch.ones(3, 8)
        empty = torch.empty(3, 8, dtype=torch.long)
    assert torch.equal(ones.constant, torch.ones(3, 8, dtype=torch.long))
    assert bool(mask.constant.all()) and torch.equal(arange.constant, torch.arange(8))
    assert int(padded.constant.sum()) == 22 and int(ones.constant.sum()) == 24
    assert torch.equal(read.constant, torch.arange(1, 9)[None])
    assert ids.constant is None and floats.constant is None and empty.constant is None
    assert torch.equal(float_mask.constant, torch.ones(3, 8))
    # the step writing into its input never writes into the user's tensor
    with mode, mode.draws.inputs():
        given = positions[0]
    with mode:
        given.add_(100)
    assert torch.equal(positions, torch.arange(8).repeat(2, 1))


def test_without_inputs_being_made_nothing_gets_values():
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        ones = torch.ones(3, 8, dtype=torch.long)
    assert ones.constant is None


def test_in_the_step_fill_factories_keep_their_values_of_any_dtype():
    """A mask of ones the model makes itself carries its values (a library reads them), up to
    HOST_VALUE_NUMEL elements; ``empty``, a floating-point range of more than SMALL_VALUE_NUMEL
    elements and what is computed from the data do not."""
    from pytorch_mem_profiler.estimate.fake import HOST_VALUE_NUMEL, fake_mode

    mode = fake_mode()
    with mode:
        data = torch.empty(3, 400)
        with mode.draws.on():
            ones = torch.ones(3, 400)
            full = data.new_full((3, 400), 7, dtype=torch.long)
            zeros = torch.zeros_like(data, dtype=torch.bool)
            too_big = torch.ones(HOST_VALUE_NUMEL + 1)
            steps = torch.arange(400.0)
            empty = torch.empty(3, 400)
            skipped = bool(ones.bool().all())
    assert torch.equal(ones.constant, torch.ones(3, 400)) and int(full.constant.sum()) == 7 * 1200
    assert zeros.constant is not None and not bool(zeros.constant.any())
    assert too_big.constant is None and steps.constant is None and empty.constant is None
    assert skipped


def test_in_the_step_ranges_keep_their_values():
    """A range follows from its arguments, as a fill does: integer ranges up to HOST_VALUE_NUMEL
    elements keep their values, floating-point ones up to SMALL_VALUE_NUMEL. So the mask of the
    frames left after a convolutional front end, written at ``torch.arange(batch)`` into zeros
    (Speech2Text, wav2vec2), has values, and transformers skips it, all ones, as the real step does."""
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        with mode.draws.on():
            positions = torch.arange(400)
            grid = torch.linspace(0, 1, 64)
            identity = torch.eye(8)
            lengths = torch.full((3,), 20)
            frames = torch.zeros(3, 20, dtype=torch.long)
            frames[(torch.arange(3), lengths - 1)] = 1
            frames = frames.flip([-1]).cumsum(-1).flip([-1])
            all_kept = bool(frames.all())
    assert torch.equal(positions.constant, torch.arange(400))
    assert torch.equal(grid.constant, torch.linspace(0, 1, 64)) and torch.equal(identity.constant, torch.eye(8))
    assert frames.constant is not None and all_kept


# -- values of fake tensors on another device than the CPU ------------------------------------------
# A fake CUDA tensor can be made without a GPU (no runtime call): these run on any machine. Python
# indexing and ``.to("cuda")`` go through C++ device checks that torch's CPU-only build refuses, so
# the tests use ``unsqueeze``, ``narrow`` and ``select``, and sending to the GPU needs a CUDA build.


def test_a_mask_of_ones_on_the_gpu_keeps_its_values_on_the_cpu():
    """A fill factory on the GPU's device gets its value, kept on the CPU beside the fake tensor: views,
    casts and reductions of it keep theirs on the GPU's device, a Python read gives the real answer,
    and no GPU memory is touched (the values are CPU tensors)."""
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        with mode.draws.on():
            ones = torch.ones(4, 8, device="cuda")
            expanded = ones.unsqueeze(1)
            as_long = ones.long()
            everything = ones.all()
            skipped = bool(everything)
            ones.narrow(1, 0, 1).zero_()  # written with a value: every alias follows
            first_column_kept, rest = bool(ones.all()), bool(ones.narrow(1, 1, 7).all())
    assert ones.device.type == expanded.device.type == as_long.device.type == everything.device.type == "cuda"
    assert as_long.dtype == torch.long and int(as_long.constant.sum()) == 32
    assert all(t.constant.device.type == "cpu" for t in (ones, expanded, as_long, everything))
    assert skipped and not first_column_kept and rest
    assert expanded.constant.shape == (4, 1, 8) and float(expanded.constant.sum()) == 28.0  # the view saw the write


def test_a_gpu_value_written_by_data_without_one_is_dropped_from_every_alias():
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        data = torch.empty(4, 8, device="cuda")  # a stand-in for data: no values
        with mode.draws.on():
            ones = torch.ones(4, 8, device="cuda")
            row = ones.select(0, 0)
            mixed = ones * data
            ones.mul_(data)
            with pytest.raises(Exception) as refused:
                bool(row.all())
    assert mixed.constant is None and ones.constant is None and row.constant is None
    assert "DataDependent" in type(refused.value).__name__


def test_a_gpu_mask_with_its_value_indexes_by_the_positions_it_selects():
    """SpecAugment's time mask (made from numpy, sent to the GPU) indexing the hidden states:
    ``hidden[mask] = embedding`` and ``hidden[mask]``. The fake kernel cannot read a mask without
    its value, and the value is set aside while it runs; it is given the positions the mask
    selects instead, with their values, as the real kernel expands a mask itself. It refused the
    call before (``aten.nonzero``: a data-dependent shape)."""
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        hidden = torch.empty(2, 300, 8, device="cuda")  # data: no values
        embedding = torch.empty(8, device="cuda")
        with mode.draws.on():
            frames = torch.arange(300, device="cuda")
            row = (frames >= 10) & (frames < 20)
            mask = torch.stack([row, frames < 3])
            written = torch.ops.aten.index_put_.default(hidden, [mask], embedding)
            picked = torch.ops.aten.index.Tensor(hidden, [mask])
            columns = torch.ops.aten.index.Tensor(hidden, [None, row])
    assert written is hidden and hidden.device.type == "cuda"
    assert tuple(picked.shape) == (13, 8) and tuple(columns.shape) == (2, 10, 8)
    assert picked.device.type == columns.device.type == "cuda"


def test_a_draw_on_the_gpus_device_is_taken_and_its_read_noted():
    """LayerDrop drawing on the model's device (``torch.rand([], device=x.device)``): the branch is
    taken as on the CPU, from the estimate's generator, and the line that read it is noted."""
    from pytorch_mem_profiler.estimate.fake import fake_mode

    def taken(device: str) -> tuple[bool, float]:
        mode = fake_mode()
        with mode:
            with mode.draws.on():
                draw = torch.rand([], device=device)
                skip = bool(draw < 0.5)
        assert len(mode.draws.reads) == 1
        return skip, float(draw.constant)

    assert taken("cuda") == taken("cpu")


@pytest.mark.skipif(
    not torch.cuda.is_available() and (not torch.backends.cuda.is_built() or torch.torch_version.TorchVersion(torch.__version__) < "2.5"),
    reason="without a GPU, torch's CPU-only build refuses .to('cuda') before any mode sees it, and torch 2.4's fake copy starts CUDA",
)
def test_a_value_sent_to_the_gpu_stays_on_the_cpu():
    from pytorch_mem_profiler.estimate.fake import fake_mode

    mode = fake_mode()
    with mode:
        with mode.draws.on():
            sent = torch.ones(2, 3).to("cuda")
            back = sent.cpu()
    assert sent.device.type == "cuda" and sent.constant.device.type == "cpu" and torch.equal(sent.constant, torch.ones(2, 3))
    assert back.device.type == "cpu" and torch.equal(back.constant, torch.ones(2, 3))


@pytest.mark.skipif(
    not torch.cuda.is_available() and (not torch.backends.cuda.is_built() or torch.torch_version.TorchVersion(torch.__version__) < "2.5"),
    reason="without a GPU, torch's CPU-only build refuses .to('cuda') before any mode sees it, and torch 2.4's fake copy starts CUDA",
)
def test_an_operator_whose_shape_is_a_value_kept_for_the_gpu_gets_the_real_shape():
    """``nonzero``, ``unique``, ``masked_select`` and ``repeat_interleave`` of a mask the user gave
    and the step sent to the GPU (ViLT keeps the patches its pixel mask keeps with
    ``x_mask.nonzero()``): the fake kernel cannot size them without values; the values kept beside
    the fake CUDA tensor do, as the real step's. Without values they stay refused."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from pytorch_mem_profiler.estimate.fake import fake_mode

    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 10:] = 0
    mask[2, :3] = 0
    mode = fake_mode()
    with mode:
        with mode.draws.inputs():  # as the estimate places the user's inputs on the device
            sent = mode.draws.placed(mode, torch.empty(3, 16, dtype=torch.long, device="cuda"), mask)
        with mode.draws.on():
            kept = sent.nonzero()
            rows = kept[:, 0].unique()
            selected = (sent * 3).masked_select(sent.bool())
            repeated = torch.repeat_interleave(sent.flatten())
            per_row = [kept[kept[:, 0] == r] for r in rows]
            unknown = torch.randn(64, 64, device="cuda")  # larger than a draw given values
            with pytest.raises(DynamicOutputShapeException):
                (unknown > 0).nonzero()
    expected = mask.nonzero()
    for fake, real in ((kept, expected), (rows, expected[:, 0].unique()), (selected, (mask * 3).masked_select(mask.bool())),
                       (repeated, torch.repeat_interleave(mask.flatten()))):  # fmt: skip
        assert fake.device.type == "cuda" and fake.shape == real.shape and torch.equal(fake.constant, real)
    assert [r.shape[0] for r in per_row] == [16, 10, 13]
