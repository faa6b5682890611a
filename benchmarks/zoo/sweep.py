"""A wide sweep of small models the zoo lacks, for the CPU checks only.

:data:`SWEEP` (name -> :class:`~benchmarks.zoo.registry.ZooModel`) holds 78 small models, each
built from a config or code at one size (``"small"`` and ``"real"`` build the same model: the
sweep is for the CPU, where a model's figures are exact at any size): transformers decoders,
encoders, encoder-decoders, a state-space model and vision models, all given attention masks of
ones where they take masks; timm and torchvision CNNs and vision transformers of kinds the zoo
lacks; and plain-torch models of operations it lacks (dilated convolutions, a GRU
encoder-decoder, message passing by ``index_add_``, an STFT front end, pixel shuffle,
``max_norm`` embeddings, unfold and fold). Two of them, Mixtral and the GRU encoder-decoder (its
class is the held-back set's), also joined :data:`~benchmarks.zoo.holdout_text.HOLDOUT_TEXT` for
the GPU runs. ``benchmarks/zoo_sweep.py`` runs the checks on each.

Example::

    >>> len(SWEEP) >= 45 and not set(SWEEP) & {"gpt2", "llama", "resnet50"}
    True
    >>> entry = SWEEP["tcn"]
    >>> out = entry.builder("small")()(entry.inputs("small")(2))
    >>> tuple(out.shape)
    (2, 10)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .holdout_text import GRUSeq2Seq
from .registry import ADAMW, SGD_MOMENTUM, ZooModel, class_loss, token_loss

__all__ = ["SWEEP"]

VOCAB, SEQ = 256, 32


def _transformers(config: str, model: str, **settings: Any) -> Callable[[str], nn.Module]:
    def build(size: str) -> nn.Module:
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, model)(getattr(transformers, config)(**settings))

    return build


def _timm(name: str, **settings: Any) -> Callable[[str], nn.Module]:
    def build(size: str) -> nn.Module:
        import timm

        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=10, **settings)

    return build


def _torchvision(name: str, **settings: Any) -> Callable[[str], nn.Module]:
    def build(size: str) -> nn.Module:
        import torchvision.models
        import torchvision.models.segmentation
        import torchvision.models.video

        torch.manual_seed(0)
        found = (torchvision.models, torchvision.models.video, torchvision.models.segmentation)
        return getattr(next(m for m in found if hasattr(m, name)), name)(weights=None, **settings)

    return build


def _plain(make: Callable[[], nn.Module]) -> Callable[[str], nn.Module]:
    def build(size: str) -> nn.Module:
        torch.manual_seed(0)
        return make()

    return build


# -- inputs and targets --------------------------------------------------------------------


def _tokens_and_mask(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (batch, SEQ)), "attention_mask": torch.ones(batch, SEQ, dtype=torch.long)}


def _tokens(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (batch, SEQ))}


def _token_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ))


def _seq2seq(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {**_tokens_and_mask(size, batch), "decoder_input_ids": torch.randint(1, VOCAB, (batch, SEQ // 2))}


def _seq2seq_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ // 2))


def _pixels(side: int) -> Callable[[str, int], dict[str, torch.Tensor]]:
    return lambda size, batch: {"pixel_values": torch.randn(batch, 3, side, side)}


def _images(side: int) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randn(batch, 3, side, side)


def _classes(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch,))


# -- plain torch ---------------------------------------------------------------------------


class DilatedTCN(nn.Module):
    """A temporal convolution network: residual Conv1d layers dilated 1, 2, 4, 8."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(8, 32, 1)
        self.layers = nn.ModuleList(nn.Conv1d(32, 32, 3, dilation=d, padding=d) for d in (1, 2, 4, 8))
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for conv in self.layers:
            h = h + F.relu(conv(h))
        return self.out(h.mean(-1))


class MessagePassing(nn.Module):
    """Three rounds of messages summed into each node by ``index_add_`` over a fixed edge list."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.edges = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, target = self.edges
        for layer in self.rounds:
            messages = layer(x)[:, source]
            summed = torch.zeros(x.shape, dtype=messages.dtype, device=x.device)  # bf16 under autocast
            x = x + summed.index_add_(1, target, messages).relu()
        return self.head(x.mean(1))


class SpectrogramCNN(nn.Module):
    """A power spectrogram (``torch.stft``, complex) with a periodic Hann window buffer, then a CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(128))
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        power = torch.stft(wave, 128, 64, window=self.window, return_complex=True).abs().pow(2)
        return self.head(self.conv(power.unsqueeze(1).log1p()).mean((2, 3)))


class PixelShuffleSR(nn.Module):
    """Super-resolution x2: a sub-pixel convolution (``PixelShuffle``) added to bicubic upsampling."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.PReLU(), nn.Conv2d(32, 12, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False)


class MaxNormEmbeddings(nn.Module):
    """``nn.Embedding(max_norm=1)`` (rows renormalized in place in forward) and an MLP head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, max_norm=1.0)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x))


class UnfoldFold(nn.Module):
    """Patches by ``F.unfold``, projected, and part of them folded back into an image."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 16, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(F.unfold(x, 4, stride=4).transpose(1, 2)).relu()
        folded = F.fold(h.transpose(1, 2)[:, :48], (32, 32), 4, stride=4)
        return self.head(h.mean(1)) + folded.mean()


def _smoothed_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), labels.reshape(-1), label_smoothing=0.1)


def _l1(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(output, target)


def _entries() -> list[ZooModel]:
    hf, tm, tv = ("transformers",), ("timm",), ("torchvision",)
    lm = dict(vocab_size=VOCAB, max_position_embeddings=64)
    llama_like = dict(lm, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    vit = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_labels=10)
    entries: list[tuple[str, str, str, Callable[[str], nn.Module], Any, Any, Any, Any, Any, tuple[str, ...]]] = [
        ("gptj", "decoder", "GPT-J: partial rotary, parallel block", _transformers("GPTJConfig", "GPTJForCausalLM",
         vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("gpt_bigcode", "decoder", "GPTBigCode: multi-query attention", _transformers("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, multi_query=True), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("gemma2", "decoder", "Gemma2: sliding and full attention alternating, soft-capped logits", _transformers("Gemma2Config", "Gemma2ForCausalLM",
         **dict(llama_like, head_dim=16, sliding_window=16)), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("phi3", "decoder", "Phi-3: fused qkv and gate-up projections", _transformers("Phi3Config", "Phi3ForCausalLM", **llama_like, pad_token_id=0),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("olmo", "decoder", "OLMo: non-parametric layer norm, bf16 autocast", _transformers("OlmoConfig", "OlmoForCausalLM",
         **dict(llama_like, num_key_value_heads=4), pad_token_id=0), _tokens, _token_targets, token_loss, ADAMW, torch.bfloat16, hf),
        ("mixtral", "mixture of experts", "Mixtral: top-2 of 4 experts in grouped matmuls", _transformers("MixtralConfig", "MixtralForCausalLM",
         **llama_like, num_local_experts=4, num_experts_per_tok=2), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("mamba", "state space", "Mamba: selective scan (the slow path on the CPU)", _transformers("MambaConfig", "MambaForCausalLM",
         vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("xlnet", "decoder", "XLNet: two-stream relative attention", _transformers("XLNetConfig", "XLNetLMHeadModel",
         vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, d_inner=128), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("funnel", "encoder", "Funnel: pooled sequence, upsampled by a decoder", _transformers("FunnelConfig", "FunnelForMaskedLM",
         vocab_size=VOCAB, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1], num_decoder_layers=1),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("modernbert", "encoder", "ModernBERT: unpadded by the attention mask's values, local and global attention",
         _transformers("ModernBertConfig", "ModernBertForMaskedLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, pad_token_id=0), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("marian", "encoder-decoder", "Marian: sinusoidal positions, encoder-decoder", _transformers("MarianConfig", "MarianMTModel",
         vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
         decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0), _seq2seq, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("t5_bf16", "encoder-decoder", "T5: relative position buckets, bf16 autocast", _transformers("T5Config", "T5ForConditionalGeneration",
         vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0), _seq2seq, _seq2seq_targets, token_loss,
         ADAMW, torch.bfloat16, hf),
        ("fnet", "encoder", "FNet: Fourier token mixing, and a pooler whose output the masked-LM loss never uses",
         _transformers("FNetConfig", "FNetForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       max_position_embeddings=64, use_tpu_fourier_optimizations=False), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("pegasus", "encoder-decoder", "Pegasus given no decoder mask: its decoder makes one of ones, which transformers skips",
         _transformers("PegasusConfig", "PegasusForConditionalGeneration", vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0), _seq2seq, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("beit", "vision transformer", "BEiT: a relative position index memoized in a cache every instance shares",
         _transformers("BeitConfig", "BeitForImageClassification", **vit, intermediate_size=128, use_relative_position_bias=True),
         _pixels(32), _classes, class_loss, ADAMW, None, hf),
        ("hf_vit", "vision transformer", "transformers ViT", _transformers("ViTConfig", "ViTForImageClassification", **vit, intermediate_size=128),
         _pixels(32), _classes, class_loss, ADAMW, None, hf),
        ("dinov2", "vision transformer", "DINOv2: layer scale, interpolated positions", _transformers("Dinov2Config", "Dinov2ForImageClassification",
         **vit), _pixels(32), _classes, class_loss, ADAMW, None, hf),
        ("segformer", "vision transformer", "SegFormer: efficient attention with reduced keys, Mix-FFN", _transformers("SegformerConfig",
         "SegformerForImageClassification", num_labels=10, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], decoder_hidden_size=64),
         _pixels(64), _classes, class_loss, ADAMW, None, hf),
    ]
    encoder = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
    entries += [  # joined later, from a probe of models no registry held
        ("qwen3", "decoder", "Qwen3: query and key norms, GQA", _transformers("Qwen3Config", "Qwen3ForCausalLM", **llama_like, head_dim=16),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("gemma3", "decoder", "Gemma3: local and global layers, query and key norms", _transformers("Gemma3TextConfig", "Gemma3ForCausalLM",
         **llama_like, head_dim=16, sliding_window=16), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("cohere", "decoder", "Cohere: parallel block, logit scale, bf16 autocast", _transformers("CohereConfig", "CohereForCausalLM", **llama_like),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, torch.bfloat16, hf),
        ("stablelm", "decoder", "StableLM: partial rotary, layer norm", _transformers("StableLmConfig", "StableLmForCausalLM", **llama_like),
         _tokens_and_mask, _token_targets, token_loss, SGD_MOMENTUM, None, hf),
        ("starcoder2", "decoder", "Starcoder2: biased projections, GELU MLP", _transformers("Starcoder2Config", "Starcoder2ForCausalLM", **llama_like),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("olmo2", "decoder", "OLMo2: norms after attention and MLP", _transformers("Olmo2Config", "Olmo2ForCausalLM", **llama_like, pad_token_id=0),
         _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("granite", "decoder", "Granite: scaled embeddings, residuals and logits", _transformers("GraniteConfig", "GraniteForCausalLM", **llama_like),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("gpt2_eager", "decoder", "GPT-2 with eager attention: scores, mask, softmax written out", _transformers("GPT2Config", "GPT2LMHeadModel",
         vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation="eager"), _tokens_and_mask, _token_targets,
         token_loss, ADAMW, None, hf),
        ("bert_eager", "encoder", "BERT with eager attention", _transformers("BertConfig", "BertForMaskedLM", **encoder, attn_implementation="eager"),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("mpnet", "encoder", "MPNet: relative position bias in every layer", _transformers("MPNetConfig", "MPNetForMaskedLM", **encoder),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("xlm_roberta", "encoder", "XLM-RoBERTa", _transformers("XLMRobertaConfig", "XLMRobertaForMaskedLM", **encoder, pad_token_id=1),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("convbert", "encoder", "ConvBERT: span-based dynamic convolution heads", _transformers("ConvBertConfig", "ConvBertForMaskedLM", **encoder),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("mobilebert", "encoder", "MobileBERT: bottlenecks, stacked feed-forwards, no-norm layers", _transformers("MobileBertConfig",
         "MobileBertForMaskedLM", **dict(encoder, intermediate_size=64), intra_bottleneck_size=32, embedding_size=32), _tokens_and_mask,
         _token_targets, token_loss, ADAMW, None, hf),
        ("roformer", "encoder", "RoFormer: rotary positions in an encoder", _transformers("RoFormerConfig", "RoFormerForMaskedLM", **encoder),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("esm", "encoder", "ESM: a protein language model, token dropout", _transformers("EsmConfig", "EsmForMaskedLM", **encoder, pad_token_id=1,
         mask_token_id=2), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("nystromformer", "encoder", "Nystromformer: landmark attention, a depthwise convolution over values", _transformers("NystromformerConfig",
         "NystromformerForMaskedLM", **encoder, num_landmarks=8, segment_means_seq_len=32), _tokens_and_mask, _token_targets, token_loss, ADAMW,
         None, hf),
    ]
    timm_models = {
        "resnest14d": {}, "res2net50_14w_8s": {}, "repvgg_a0": {}, "cspdarknet53": {}, "xception41": {}, "ghostnet_100": {}, "dla34": {},
        "hrnet_w18_small": {}, "coatnet_nano_rw_224": {"img_size": 64}, "maxvit_nano_rw_256": {"img_size": 64},
        "xcit_nano_12_p16_224": {"img_size": 64}, "cait_xxs24_224": {"img_size": 64}, "efficientnetv2_rw_t": {},
        "gcvit_xxtiny": {"img_size": 64}, "twins_svt_small": {"img_size": 64}, "beit_base_patch16_224": {"img_size": 64, "depth": 2},
        "mobileone_s0": {}, "sebotnet33ts_256": {"img_size": 64},
        "convnextv2_atto": {}, "efficientvit_b0": {}, "edgenext_xx_small": {}, "hiera_tiny_224": {"img_size": (64, 64)}, "regnetz_b16": {},
        "repvit_m0_9": {},
    }  # fmt: skip
    for name, settings in timm_models.items():
        entries.append((f"timm_{name}", "timm", f"timm {name}", _timm(name, **settings), _images(64), _classes, class_loss, SGD_MOMENTUM, None, tm))
    torchvision_models = {"vgg11_bn": 32, "mobilenet_v2": 64, "efficientnet_v2_s": 64, "wide_resnet50_2": 64, "maxvit_t": 224, "mnasnet0_5": 64,
                          "convnext_tiny": 64, "alexnet": 64}
    for name, side in torchvision_models.items():
        entries.append((f"tv_{name}", "torchvision", f"torchvision {name}", _torchvision(name, num_classes=10), _images(side), _classes, class_loss,
                        ADAMW, None, tv))  # fmt: skip
    entries += [
        ("timm_resnetv2_50", "timm", "timm resnetv2_50: pre-activation, bf16 autocast", _timm("resnetv2_50"), _images(64), _classes, class_loss,
         SGD_MOMENTUM, torch.bfloat16, tm),
        ("tv_regnet_x_400mf", "torchvision", "torchvision RegNetX-400MF: grouped convolutions, bf16 autocast",
         _torchvision("regnet_x_400mf", num_classes=10), _images(64), _classes, class_loss, SGD_MOMENTUM, torch.bfloat16, tv),
        ("tv_r3d_18", "torchvision", "torchvision R3D-18: 3-D convolutions over frames", _torchvision("r3d_18", num_classes=10),
         lambda size, batch: torch.randn(batch, 3, 8, 32, 32), _classes, class_loss, ADAMW, None, tv),
        ("tv_inception_v3", "torchvision", "torchvision Inception v3: factorized convolutions, concatenated branches",
         _torchvision("inception_v3", num_classes=10, aux_logits=False, init_weights=False), _images(96), _classes, class_loss, ADAMW, None, tv),
        ("tv_fcn", "torchvision", "torchvision FCN-ResNet-50: dilated backbone, per-pixel loss",
         _torchvision("fcn_resnet50", num_classes=5, weights_backbone=None), _images(64), lambda size, batch: torch.randint(0, 5, (batch, 64, 64)),
         lambda output, labels: F.cross_entropy(output["out"], labels), ADAMW, None, tv),
        ("tcn", "plain torch", "dilated residual Conv1d", _plain(DilatedTCN), lambda size, batch: torch.randn(batch, 8, 64), _classes, class_loss,
         ADAMW, None, ()),
        ("gru_encoder_decoder", "plain torch", "GRU encoder-decoder, teacher forcing", _plain(lambda: GRUSeq2Seq(VOCAB, 32)),
         lambda size, batch: (torch.randint(1, VOCAB, (batch, SEQ)), torch.randint(1, VOCAB, (batch, SEQ))), _token_targets, token_loss, ADAMW, None, ()),
        ("message_passing", "plain torch", "index_add_ over a fixed edge list", _plain(MessagePassing),
         lambda size, batch: torch.randn(batch, 64, 16), lambda size, batch: torch.randint(0, 4, (batch,)), class_loss, ADAMW, None, ()),
        ("spectrogram", "plain torch", "torch.stft with a periodic window buffer, then a CNN", _plain(SpectrogramCNN),
         lambda size, batch: torch.randn(batch, 4096), _classes, class_loss, ADAMW, None, ()),
        ("pixel_shuffle", "plain torch", "sub-pixel convolution and bicubic upsampling", _plain(PixelShuffleSR),
         lambda size, batch: torch.randn(batch, 3, 16, 16), lambda size, batch: torch.randn(batch, 3, 32, 32), _l1, ADAMW, None, ()),
        ("max_norm_embeddings", "plain torch", "Embedding(max_norm=1), label smoothing", _plain(MaxNormEmbeddings),
         lambda size, batch: torch.randint(0, VOCAB, (batch, SEQ)), _token_targets, _smoothed_loss, ADAMW, None, ()),
        ("unfold_fold", "plain torch", "F.unfold patches and F.fold back", _plain(UnfoldFold), _images(32), _classes, class_loss, ADAMW, None, ()),
    ]
    return [
        ZooModel(name, family, exercises, build, inputs, targets, loss, optimizer, autocast, {"small": 2, "real": 2}, needs)
        for name, family, exercises, build, inputs, targets, loss, optimizer, autocast, needs in entries
    ]


#: The sweep's models by name.
SWEEP: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}
