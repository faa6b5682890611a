"""The zoo's registry: name -> how to build, feed, train and size each model.

One :class:`ZooModel` per entry. ``entry.estimate_kwargs(size)`` is what
``estimate_memory`` takes (a zero-argument model builder, a ``batch_size ->
inputs`` function, targets, loss, optimizer, autocast); ``entry.training(size,
device)`` is the same step built for real. ``size`` is ``"small"`` (the CPU
tests: a step takes milliseconds) or ``"real"`` (the GPU: realistic sizes, each
step well under a second and under 10 GB on an H100).

Third-party models are built by their own constructors, as users write them:
``timm.create_model(..., pretrained=False, drop_path_rate=...)``,
``torchvision.models.resnet50(weights=None)``, ``transformers`` models from a
config. Nothing is downloaded.

Example::

    >>> from benchmarks.zoo import ZOO
    >>> entry = ZOO["lstm_lm"]
    >>> entry.family, entry.setup
    ('RNN', 'AdamW, fp32')
    >>> model = entry.builder("small")()
    >>> out = model(entry.inputs("small")(2))
    >>> float(entry.loss(out, entry.targets("small")(2))) > 0
    True
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import models

SIZES = ("small", "real")

#: The two optimizers the zoo trains with.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
SGD_MOMENTUM = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


@functools.lru_cache(maxsize=None)
def missing_package(package: str) -> str | None:
    """Why ``package`` cannot be used here (``None`` when it imports).

    The one place the zoo tries its optional packages. Any exception counts, not only
    ``ImportError``: beside torch's CPU wheel 2.13, PyPI's torchvision raises
    ``RuntimeError: operator torchvision::nms does not exist`` at import, and timm
    imports torchvision.
    """
    try:
        module = importlib.import_module(package)
    except Exception as err:  # noqa: BLE001 - any failure to import means "not here"
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return f"{package} cannot be imported here ({why}; pip install 'pytorch_mem_profiler[zoo]')"
    if package == "transformers" and not module.utils.is_torch_available():
        # transformers 5 imports beside torch < 2.6, with stand-ins for its models
        return f"transformers {module.__version__} refuses torch {torch.__version__} (pip install 'transformers<5')"
    return None


@dataclass(frozen=True)
class ZooModel:
    """One zoo model and its training step.

    Attributes:
        name: the registry key.
        family: decoder, encoder, encoder-decoder, vision transformer, CNN, RNN,
            recommendation, UNet, mixture of experts, compiled.
        exercises: what about it tests the profiler and the estimate.
        build: ``size -> nn.Module`` (the model's own constructor).
        make_inputs: ``(size, batch_size) -> inputs`` (a tensor, a tuple, or a dict of keyword inputs).
        make_targets: ``(size, batch_size) -> targets`` (a tensor or a tuple).
        loss: ``loss(output, *targets) -> scalar``.
        optimizer: a factory taking the parameters.
        autocast: ``None`` or ``torch.bfloat16`` (the forward under ``torch.autocast``).
        batch: the batch size by size.
        needs: packages it imports besides torch.
        unsupported: the operation ``estimate_memory`` refuses by design (data-dependent shapes), or ``None``.
        needs_compile: it runs ``torch.compile`` (skipped where compile cannot run).
    """

    name: str
    family: str
    exercises: str
    build: Callable[[str], nn.Module]
    make_inputs: Callable[[str, int], Any]
    make_targets: Callable[[str, int], Any]
    loss: Callable[..., torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    autocast: torch.dtype | None
    batch: dict[str, int]
    needs: tuple[str, ...] = ()
    unsupported: str | None = None
    needs_compile: bool = False

    @property
    def setup(self) -> str:
        opt = "AdamW" if self.optimizer is ADAMW else "SGD momentum"
        return f"{opt}, {'bf16 autocast' if self.autocast is torch.bfloat16 else 'fp32'}"

    def unavailable(self) -> str | None:
        """Why this model cannot run here, or ``None``."""
        for package in self.needs:
            reason = missing_package(package)
            if reason:
                return f"{self.name} needs {package}: {reason}"
        if self.needs_compile:
            return compile_unavailable()
        return None

    def builder(self, size: str) -> Callable[[], nn.Module]:
        """A zero-argument function building the model: ``estimate_memory(model=...)`` takes it."""
        _check_size(size)
        return functools.partial(self.build, size)

    def inputs(self, size: str) -> Callable[[int], Any]:
        _check_size(size)
        return functools.partial(self.make_inputs, size)

    def targets(self, size: str) -> Callable[[int], Any]:
        _check_size(size)
        return functools.partial(self.make_targets, size)

    def estimate_kwargs(self, size: str) -> dict[str, Any]:
        """Keyword arguments of ``estimate_memory`` for this model's step (add ``batch_size=``)."""
        return {
            "model": self.builder(size),
            "example_inputs": self.inputs(size),
            "targets": self.targets(size),
            "loss_fn": self.loss,
            "optimizer": self.optimizer,
            "autocast": self.autocast,
        }


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")


@functools.lru_cache(maxsize=None)
def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot train a model here (no C compiler, an unsupported Python), or ``None``."""
    try:
        model = nn.Linear(4, 4)
        compiled = torch.compile(model)
        compiled(torch.randn(2, 4)).sum().backward()
    except Exception as err:  # noqa: BLE001 - any failure means compile is not usable here
        return f"torch.compile cannot run here ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    finally:
        torch._dynamo.reset()
    return None


# -- losses -----------------------------------------------------------------------------


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position, on float32 logits (as training code does under autocast)."""
    logits = _logits(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def class_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(output).float(), labels)


def click_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output.float(), labels)


def pixel_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), labels)


# -- inputs -----------------------------------------------------------------------------


def _tokens(vocab: int, seq: int) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(0, vocab, (batch, seq))


def _images(image: dict[str, int], channels: int = 3) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randn(batch, channels, image[size], image[size])


def _classes(count: int) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(0, count, (batch,))


# -- transformers (Hugging Face), from configs -------------------------------------------


def gpt2(size: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "small":
        config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    else:  # GPT-2 small: 124M parameters, tied embeddings
        config = GPT2Config()
    return GPT2LMHeadModel(config)


def llama(size: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == "small":
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    else:  # 16 query heads sharing 4 key-value heads (grouped-query attention), RoPE
        config = LlamaConfig(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def bert(size: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    if size == "small":
        config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64)
    else:  # BERT-base
        config = BertConfig()
    return BertForMaskedLM(config)


def t5(size: str) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    if size == "small":
        config = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)
    else:  # t5-small
        config = T5Config(vocab_size=32_128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


def bart(size: str) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    if size == "small":
        config = BartConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)
    else:  # bart-base
        config = BartConfig(vocab_size=50_265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                            decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
    return BartForConditionalGeneration(config)


LM_SHAPES = {"small": (512, 32), "real": (50_257, 512)}  # vocabulary, sequence


def _lm_inputs(shapes: dict[str, tuple[int, int]]) -> Callable[[str, int], Any]:
    return lambda size, batch: {"input_ids": torch.randint(0, shapes[size][0], (batch, shapes[size][1]))}


def _lm_targets(shapes: dict[str, tuple[int, int]]) -> Callable[[str, int], Any]:
    return lambda size, batch: torch.randint(0, shapes[size][0], (batch, shapes[size][1]))


LLAMA_SHAPES = {"small": (512, 32), "real": (32_000, 512)}
BERT_SHAPES = {"small": (512, 32), "real": (30_522, 128)}
SEQ2SEQ_SHAPES = {"small": (512, 32, 16), "real": (32_128, 256, 64)}  # vocabulary, source, target
BART_SHAPES = {"small": (512, 32, 16), "real": (50_265, 256, 64)}


def _seq2seq_inputs(shapes: dict[str, tuple[int, int, int]]) -> Callable[[str, int], Any]:
    def make(size: str, batch: int) -> dict[str, torch.Tensor]:
        vocab, source, target = shapes[size]
        return {"input_ids": torch.randint(0, vocab, (batch, source)), "decoder_input_ids": torch.randint(0, vocab, (batch, target))}

    return make


def _seq2seq_targets(shapes: dict[str, tuple[int, int, int]]) -> Callable[[str, int], Any]:
    return lambda size, batch: torch.randint(0, shapes[size][0], (batch, shapes[size][2]))


# -- timm and torchvision, by their functions --------------------------------------------


def vit(size: str) -> nn.Module:
    import timm

    if size == "small":
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, drop_path_rate=0.1, img_size=32, patch_size=8, depth=2, num_classes=10)
    return timm.create_model("vit_small_patch16_224", pretrained=False, drop_path_rate=0.1)


def swin(size: str) -> nn.Module:
    import timm

    if size == "small":
        return timm.create_model(
            "swin_tiny_patch4_window7_224", pretrained=False, drop_path_rate=0.1, img_size=64, window_size=2,
            embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), num_classes=10,
        )
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, drop_path_rate=0.2)


def resnet50(size: str) -> nn.Module:
    import torchvision

    if size == "small":
        return torchvision.models.resnet18(weights=None, num_classes=10)
    return torchvision.models.resnet50(weights=None)


def resnet18(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(weights=None, num_classes=10 if size == "small" else 1000)


def convnext(size: str) -> nn.Module:
    import torchvision
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    if size == "small":
        return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.1, num_classes=10)
    return torchvision.models.convnext_tiny(weights=None, stochastic_depth_prob=0.1)


def efficientnet(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.efficientnet_b0(weights=None, num_classes=10 if size == "small" else 1000)


def mobilenet(size: str) -> nn.Module:
    import torchvision

    return torchvision.models.mobilenet_v3_large(weights=None, num_classes=10 if size == "small" else 1000)


def _num_classes(size: str) -> int:
    return 10 if size == "small" else 1000


def _class_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, _num_classes(size), (batch,))


# -- the zoo's own models ----------------------------------------------------------------


def unet(size: str) -> nn.Module:
    return models.UNet(channels=4, depth=2, classes=3) if size == "small" else models.UNet(channels=32, depth=4, classes=3)


UNET_IMAGE = {"small": 16, "real": 256}


def moe(size: str) -> nn.Module:
    if size == "small":
        return models.TopKMoE(vocab=256, dim=32, heads=2, layers=1, experts=4, top_k=2)
    return models.TopKMoE(vocab=8192, dim=512, heads=8, layers=4, experts=8, top_k=2)


MOE_SHAPES = {"small": (256, 16), "real": (8192, 512)}


def neumf(size: str) -> nn.Module:
    return models.NeuMF(users=2_000, items=500, mf_dim=8, mlp=(32, 16, 8)) if size == "small" else models.NeuMF()


NEUMF_SIZES = {"small": (2_000, 500), "real": (138_493, 26_744)}


def _neumf_inputs(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    users, items = NEUMF_SIZES[size]
    return torch.randint(0, users, (batch,)), torch.randint(0, items, (batch,))


def _clicks(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, 2, (batch,)).float()


def sparse_recommender(size: str) -> nn.Module:
    if size == "small":
        return models.SparseRecommender(rows=1_000, dim=8, tables=3, dense=13)
    return models.SparseRecommender(rows=1_000_000, dim=64, tables=8, dense=13)


SPARSE_SHAPES = {"small": (1_000, 3, 4), "real": (1_000_000, 8, 16)}  # rows, tables, ids per bag


def _sparse_inputs(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, tables, bag = SPARSE_SHAPES[size]
    return torch.randn(batch, 13), torch.randint(0, rows, (batch, tables, bag))


def lstm_lm(size: str) -> nn.Module:
    return models.RecurrentLM("lstm", vocab=128, dim=32) if size == "small" else models.RecurrentLM("lstm", vocab=10_000, dim=1024)


def gru_lm(size: str) -> nn.Module:
    return models.RecurrentLM("gru", vocab=128, dim=32) if size == "small" else models.RecurrentLM("gru", vocab=10_000, dim=1024)


RNN_SHAPES = {"small": (128, 8), "real": (10_000, 128)}


def checkpointed(size: str) -> nn.Module:
    if size == "small":
        return models.CheckpointedTransformer(vocab=512, ctx=64, dim=64, heads=4, layers=3)
    return models.CheckpointedTransformer(vocab=32_000, ctx=1024, dim=768, heads=12, layers=12)


CKPT_SHAPES = {"small": (512, 32), "real": (32_000, 1024)}


def batchnorm_cnn(size: str) -> nn.Module:
    if size == "small":
        return models.BatchNormCNN(channels=8, stages=2, per_stage=2, classes=10)
    return models.BatchNormCNN(channels=64, stages=4, per_stage=3, classes=1000)


def compiled_mlp(size: str) -> nn.Module:
    model = models.MLPMixerish(dim=32, layers=2, classes=10) if size == "small" else models.MLPMixerish(dim=1024, layers=8, classes=1000)
    return torch.compile(model)


COMPILED_SHAPES = {"small": (8, 32), "real": (256, 1024)}  # tokens, width


def _entries() -> list[ZooModel]:
    image = {"small": 32, "real": 224}
    return [
        ZooModel("gpt2", "decoder", "transformers GPT-2 small: tied embeddings, causal attention, 50k-vocabulary logits",
                 gpt2, _lm_inputs(LM_SHAPES), _lm_targets(LM_SHAPES), token_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 8}, ("transformers",)),
        ZooModel("gpt2_fp32_sgd", "decoder", "the same GPT-2 in float32 with SGD and momentum",
                 gpt2, _lm_inputs(LM_SHAPES), _lm_targets(LM_SHAPES), token_loss, SGD_MOMENTUM, None,
                 {"small": 2, "real": 4}, ("transformers",)),
        ZooModel("llama", "decoder", "transformers Llama: grouped-query attention (16 heads, 4 key-value), RoPE, SwiGLU, RMSNorm",
                 llama, _lm_inputs(LLAMA_SHAPES), _lm_targets(LLAMA_SHAPES), token_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 8}, ("transformers",)),
        ZooModel("bert", "encoder", "transformers BERT-base masked LM: bidirectional attention, GELU, tied decoder",
                 bert, _lm_inputs(BERT_SHAPES), _lm_targets(BERT_SHAPES), token_loss, ADAMW, None,
                 {"small": 2, "real": 32}, ("transformers",)),
        ZooModel("t5", "encoder-decoder", "transformers T5-small: relative position bias, cross-attention, encoder kept for the decoder",
                 t5, _seq2seq_inputs(SEQ2SEQ_SHAPES), _seq2seq_targets(SEQ2SEQ_SHAPES), token_loss, ADAMW, None,
                 {"small": 2, "real": 32}, ("transformers",)),
        ZooModel("bart", "encoder-decoder", "transformers BART-base in bf16: learned positions, cross-attention",
                 bart, _seq2seq_inputs(BART_SHAPES), _seq2seq_targets(BART_SHAPES), token_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 16}, ("transformers",)),
        ZooModel("vit", "vision transformer", "timm ViT-S/16 by timm.create_model, drop-path rates computed in the constructor",
                 vit, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 64}, ("timm",)),
        ZooModel("swin", "vision transformer", "timm Swin-T: shifted windows, relative position tables (buffers), drop path",
                 swin, _images({"small": 64, "real": 224}), _class_targets, class_loss, ADAMW, None,
                 {"small": 2, "real": 32}, ("timm",)),
        ZooModel("resnet50", "CNN", "torchvision ResNet-50 (ResNet-18 at the small size): BatchNorm buffers, in-place ReLU",
                 resnet50, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None,
                 {"small": 2, "real": 64}, ("torchvision",)),
        ZooModel("resnet18_bf16", "CNN", "torchvision ResNet-18 under bf16 autocast with AdamW",
                 resnet18, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 128}, ("torchvision",)),
        ZooModel("convnext", "CNN", "torchvision ConvNeXt-T: depthwise 7x7, LayerNorm over channels, layer scale, stochastic depth",
                 convnext, _images(image), _class_targets, class_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 32}, ("torchvision",)),
        ZooModel("efficientnet", "CNN", "torchvision EfficientNet-B0: depthwise convolutions, squeeze-excitation, SiLU, stochastic depth",
                 efficientnet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, None,
                 {"small": 2, "real": 64}, ("torchvision",)),
        ZooModel("mobilenet", "CNN", "torchvision MobileNetV3-Large: depthwise convolutions, squeeze-excitation, hard-swish",
                 mobilenet, _images(image), _class_targets, class_loss, SGD_MOMENTUM, torch.bfloat16,
                 {"small": 2, "real": 128}, ("torchvision",)),
        ZooModel("lstm_lm", "RNN", "2-layer nn.LSTM language model (cuDNN on CUDA)",
                 lstm_lm, _tokens_by(RNN_SHAPES), _token_targets(RNN_SHAPES), token_loss, ADAMW, None,
                 {"small": 2, "real": 32}),
        ZooModel("gru_lm", "RNN", "2-layer nn.GRU language model (cuDNN on CUDA), SGD with momentum",
                 gru_lm, _tokens_by(RNN_SHAPES), _token_targets(RNN_SHAPES), token_loss, SGD_MOMENTUM, None,
                 {"small": 2, "real": 32}),
        ZooModel("neumf", "recommendation", "NeuMF with the MovieLens-20M table sizes: dense embeddings, a large batch",
                 neumf, _neumf_inputs, _clicks, click_loss, ADAMW, None,
                 {"small": 64, "real": 65_536}),
        ZooModel("sparse_recommender", "recommendation", "DLRM-style: 8 EmbeddingBag(sparse=True) tables, sparse gradients and momentum",
                 sparse_recommender, _sparse_inputs, _clicks, click_loss, SGD_MOMENTUM, None,
                 {"small": 16, "real": 8192}),
        ZooModel("unet", "UNet", "UNet: skip connections, BatchNorm, transposed convolution and bilinear upsampling",
                 unet, _images(UNET_IMAGE), _pixel_targets, pixel_loss, ADAMW, None,
                 {"small": 2, "real": 8}),
        ZooModel("moe", "mixture of experts", "top-2 routing over 8 experts: tokens gathered by nonzero, scattered by index_add",
                 moe, _tokens_by(MOE_SHAPES), _token_targets(MOE_SHAPES), token_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 8}, unsupported="aten.nonzero"),
        ZooModel("checkpointed", "decoder", "GPT-style blocks each under torch.utils.checkpoint: recomputation in backward",
                 checkpointed, _tokens_by(CKPT_SHAPES), _token_targets(CKPT_SHAPES), token_loss, ADAMW, torch.bfloat16,
                 {"small": 2, "real": 16}),
        ZooModel("batchnorm_cnn", "CNN", "VGG-style, BatchNorm after each of 12 convolutions: running statistics as buffers",
                 batchnorm_cnn, _images(image), _class_targets, class_loss, SGD_MOMENTUM, torch.bfloat16,
                 {"small": 2, "real": 64}),
        ZooModel("compiled_mlp", "compiled", "a residual MLP under torch.compile (inductor): fused kernels, no module hooks inside",
                 compiled_mlp, _compiled_inputs, _class_targets, class_loss, ADAMW, None,
                 {"small": 2, "real": 64}, needs_compile=True),
    ]


def _tokens_by(shapes: dict[str, tuple[int, int]]) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(0, shapes[size][0], (batch, shapes[size][1]))


def _token_targets(shapes: dict[str, tuple[int, int]]) -> Callable[[str, int], torch.Tensor]:
    return _tokens_by(shapes)


def _pixel_targets(size: str, batch: int) -> torch.Tensor:
    side = UNET_IMAGE[size]
    return torch.randint(0, 3, (batch, side, side))


def _compiled_inputs(size: str, batch: int) -> torch.Tensor:
    tokens, width = COMPILED_SHAPES[size]
    return torch.randn(batch, tokens, width)


#: Every zoo model by name, in the table's order.
ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}
