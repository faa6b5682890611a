"""Text, audio and plain-torch models held back from the zoo: the same checks, on models it lacks.

:data:`HOLDOUT_TEXT` (name -> :class:`~benchmarks.zoo.registry.ZooModel`) holds models the
zoo (:data:`~benchmarks.zoo.ZOO`: GPT-2, Llama, BERT, T5, BART) does not, each of another kind of
operation: sliding-window and grouped-query attention (Mistral, Qwen2 with tied embeddings),
partial rotary (GPT-NeoX, Phi), ALiBi (Bloom), learned positions (OPT), multi-query attention
with a parallel block (Falcon), GeGLU and a scaled embedding (Gemma), a mixture of experts in
grouped matmuls given an attention mask of ones (Mixtral), one layer's weights shared
by all layers (ALBERT), distillation-style and relative-position encoders (DistilBERT, RoBERTa,
DeBERTa-v2, ELECTRA's discriminator), audio (Whisper's convolutional front end and
encoder-decoder, Wav2Vec2's convolutional feature extractor with group norm, weight-normed
positional convolution, time masking and CTC loss), two towers and a contrastive loss (CLIP);
and, written with torch alone: ``nn.TransformerEncoder`` with a key padding mask,
``nn.Transformer`` with causal and padding masks, ``nn.MultiheadAttention`` with its own key and
value widths and additive masks, a bidirectional LSTM over ``pack_padded_sequence``, a GRU
encoder-decoder,
``EmbeddingBag`` with offsets beside one module called twice and tied input/output embeddings,
``weight_norm``/``spectral_norm`` parametrizations, and ``torch.utils.checkpoint`` reentrant and
non-reentrant in one model.

``benchmarks/zoo/checks.py`` checks them as it checks the zoo (``tests/test_zoo_holdout_text.py``),
and ``benchmarks/zoo_conformance.conform`` on the GPU (``tests/test_zoo_holdout_text_cuda.py``).

Example::

    >>> from benchmarks.zoo import ZOO
    >>> len(HOLDOUT_TEXT) >= 14 and not set(HOLDOUT_TEXT) & set(ZOO)
    True
    >>> entry = HOLDOUT_TEXT["packed_lstm"]
    >>> out = entry.builder("small")()(*entry.inputs("small")(2))
    >>> float(entry.loss(out, entry.targets("small")(2))) > 0
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.utils.checkpoint import checkpoint

from .registry import ADAMW, SGD_MOMENTUM, ZooModel, class_loss, token_loss

HF = ("transformers",)

# -- losses and inputs beside the zoo's ---------------------------------------------------


def _output_logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def token_click_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy per token (ELECTRA's replaced-token detection)."""
    return F.binary_cross_entropy_with_logits(_output_logits(output).float(), labels)


def contrastive_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric cross-entropy over the image-text similarity matrix."""
    return (F.cross_entropy(output.logits_per_image.float(), labels) + F.cross_entropy(output.logits_per_text.float(), labels)) / 2


def ctc_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """CTC over every frame (Wav2Vec2 fine-tuning), every label sequence full length."""
    log_probs = _output_logits(output).float().log_softmax(-1).transpose(0, 1)  # (frames, batch, vocab)
    frames, batch = log_probs.shape[:2]
    input_lengths = torch.full((batch,), frames, dtype=torch.long, device=labels.device)
    target_lengths = torch.full((batch,), labels.shape[1], dtype=torch.long, device=labels.device)
    return F.ctc_loss(log_probs, labels, input_lengths, target_lengths, zero_infinity=True)


def _ids(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], dict[str, torch.Tensor]]:
    return lambda size, batch: {"input_ids": torch.randint(1, shapes[size][0], (batch, shapes[size][1]))}


def _ids_padded(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], dict[str, torch.Tensor]]:
    """Token ids and an attention mask with trailing padding, as a tokenizer pads a batch."""

    def make(size: str, batch: int) -> dict[str, torch.Tensor]:
        ids = _padded(shapes)(size, batch)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    return make


def _ids_unpadded(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], dict[str, torch.Tensor]]:
    """Token ids and an attention mask of ones (a batch without padding), as a collator gives them."""
    return lambda size, batch: {"input_ids": torch.randint(1, shapes[size][0], (batch, shapes[size][1])),
                                "attention_mask": torch.ones(batch, shapes[size][1], dtype=torch.long)}


def _id_targets(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(0, shapes[size][0], (batch, shapes[size][1]))


def _labels(count: int) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(0, count, (batch,))


def _tokens(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], torch.Tensor]:
    return lambda size, batch: torch.randint(1, shapes[size][0], (batch, shapes[size][1]))


def _padded(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, int], torch.Tensor]:
    """Token ids with trailing padding (id 0): sample ``i`` loses ``i % 4`` eighths of the sequence."""

    def make(size: str, batch: int) -> torch.Tensor:
        vocab, seq = shapes[size][:2]
        ids = torch.randint(1, vocab, (batch, seq))
        for i in range(batch):
            ids[i, seq - (i % 4) * seq // 8 :] = 0
        return ids

    return make


def _lengths(seq: int, batch: int) -> torch.Tensor:
    return torch.tensor([seq - (i % 4) * seq // 8 for i in range(batch)], dtype=torch.long)


# -- transformers (Hugging Face), from configs ---------------------------------------------


def _sdpa(config: Any) -> Any:
    config._attn_implementation = "sdpa"
    return config


def mistral(size: str) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    if size == "small":  # a window of 16 over 32 tokens: the sliding mask differs from the causal one
        config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, sliding_window=16, max_position_embeddings=64)
    else:
        config = MistralConfig(vocab_size=32_000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                               num_attention_heads=16, num_key_value_heads=4, sliding_window=256, max_position_embeddings=2048)
    return MistralForCausalLM(_sdpa(config))


def qwen2(size: str) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if size == "small":
        config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=64)
    else:  # Qwen2-0.5B's shape, fewer layers and a smaller vocabulary
        config = Qwen2Config(vocab_size=32_000, hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14,
                             num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048)
    return Qwen2ForCausalLM(_sdpa(config))


def qwen2_checkpointed(size: str) -> nn.Module:
    model = qwen2(size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def gpt_neox(size: str) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    if size == "small":
        config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True)
    else:  # Pythia-160M
        config = GPTNeoXConfig(vocab_size=50_304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048)
    return GPTNeoXForCausalLM(_sdpa(config))


def bloom(size: str) -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    if size == "small":
        config = BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    else:
        config = BloomConfig(vocab_size=50_257, hidden_size=1024, n_layer=12, n_head=16)
    return BloomForCausalLM(config)


def opt(size: str) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    if size == "small":
        config = OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=64)
    else:  # OPT-125M
        config = OPTConfig(vocab_size=50_272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                           max_position_embeddings=2048, word_embed_proj_dim=768)
    return OPTForCausalLM(_sdpa(config))


def falcon(size: str) -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    if size == "small":
        config = FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                              parallel_attn=True, bias=False)
    else:
        config = FalconConfig(vocab_size=50_304, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                              multi_query=True, parallel_attn=True, bias=False)
    return FalconForCausalLM(_sdpa(config))


def phi(size: str) -> nn.Module:
    from transformers import PhiConfig, PhiForCausalLM

    if size == "small":
        config = PhiConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           partial_rotary_factor=0.5, max_position_embeddings=64)
    else:
        config = PhiConfig(vocab_size=51_200, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                           num_attention_heads=16, partial_rotary_factor=0.5, max_position_embeddings=2048)
    return PhiForCausalLM(_sdpa(config))


def gemma(size: str) -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    if size == "small":
        config = GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    else:
        config = GemmaConfig(vocab_size=32_000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=2048)
    return GemmaForCausalLM(_sdpa(config))


def mixtral(size: str) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    if size == "small":
        config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    else:
        config = MixtralConfig(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                               num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048)
    return MixtralForCausalLM(_sdpa(config))


def albert(size: str) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    if size == "small":
        config = AlbertConfig(vocab_size=512, embedding_size=16, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=64)
    else:  # ALBERT-base: one layer's weights run twelve times
        config = AlbertConfig(vocab_size=30_000, embedding_size=128, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072)
    return AlbertForMaskedLM(config)


def distilbert(size: str) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    if size == "small":
        config = DistilBertConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64, num_labels=4)
    else:
        config = DistilBertConfig(num_labels=4)
    return DistilBertForSequenceClassification(config)


def roberta(size: str) -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    if size == "small":
        config = RobertaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=66)
    else:  # RoBERTa-base
        config = RobertaConfig(vocab_size=50_265, max_position_embeddings=514)
    return RobertaForMaskedLM(config)


def deberta_v2(size: str) -> nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    if size == "small":
        config = DebertaV2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 max_position_embeddings=64, relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                                 max_relative_positions=-1, position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True)
    else:  # DeBERTa-v3-base's shape
        config = DebertaV2Config(vocab_size=128_100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072, max_position_embeddings=512, relative_attention=True, position_buckets=256,
                                 pos_att_type=["p2c", "c2p"], max_relative_positions=-1, position_biased_input=False,
                                 norm_rel_ebd="layer_norm", share_att_key=True)
    return DebertaV2ForMaskedLM(config)


def electra(size: str) -> nn.Module:
    from transformers import ElectraConfig, ElectraForPreTraining

    if size == "small":
        config = ElectraConfig(vocab_size=512, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64)
    else:  # ELECTRA-base's discriminator
        config = ElectraConfig(vocab_size=30_522, embedding_size=768, hidden_size=768, num_hidden_layers=12,
                               num_attention_heads=12, intermediate_size=3072)
    return ElectraForPreTraining(config)


def whisper(size: str) -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    if size == "small":
        config = WhisperConfig(vocab_size=512, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                               max_source_positions=32, max_target_positions=64, decoder_start_token_id=1, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2)
    else:  # Whisper-base
        config = WhisperConfig(vocab_size=51_865, num_mel_bins=80, d_model=512, encoder_layers=6, decoder_layers=6,
                               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                               max_source_positions=1500, max_target_positions=448)
    return WhisperForConditionalGeneration(_sdpa(config))


WHISPER_SHAPES = {"small": (512, 16, 32, 16), "real": (51_865, 80, 1500, 128)}  # vocabulary, mel bins, positions, target


def _whisper_inputs(size: str, batch: int) -> dict[str, torch.Tensor]:
    vocab, mels, positions, target = WHISPER_SHAPES[size]
    return {"input_features": torch.randn(batch, mels, 2 * positions), "decoder_input_ids": torch.randint(1, vocab, (batch, target))}


def _whisper_targets(size: str, batch: int) -> torch.Tensor:
    vocab, _, _, target = WHISPER_SHAPES[size]
    return torch.randint(0, vocab, (batch, target))


def wav2vec2(size: str) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    if size == "small":
        config = Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                num_conv_pos_embedding_groups=2, feat_extract_norm="group", mask_time_prob=0.3, mask_time_length=4)
    else:  # Wav2Vec2-base with a CTC head
        config = Wav2Vec2Config(vocab_size=32, feat_extract_norm="group")
    return Wav2Vec2ForCTC(config)


WAV2VEC2_SHAPES = {"small": (1600, 10), "real": (16_000 * 4, 40)}  # samples, labels


def _audio(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(batch, WAV2VEC2_SHAPES[size][0])}


def _ctc_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(1, 32, (batch, WAV2VEC2_SHAPES[size][1]))


def clip(size: str) -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    if size == "small":
        config = CLIPConfig(
            text_config={"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "max_position_embeddings": 32, "bos_token_id": 1, "eos_token_id": 2},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                           "image_size": 32, "patch_size": 8},
            projection_dim=16,
        )
    else:  # ViT-B/32 and its text tower
        config = CLIPConfig(text_config={}, vision_config={"patch_size": 32}, projection_dim=512)
    return CLIPModel(_sdpa(config))


CLIP_SHAPES = {"small": (512, 16, 32), "real": (49_408, 77, 224)}  # vocabulary, text, image side


def _clip_inputs(size: str, batch: int) -> dict[str, torch.Tensor]:
    vocab, text, side = CLIP_SHAPES[size]
    return {"input_ids": torch.randint(1, vocab, (batch, text)), "pixel_values": torch.randn(batch, 3, side, side)}


def _diagonal(size: str, batch: int) -> torch.Tensor:
    return torch.arange(batch)


# -- written with torch alone ----------------------------------------------------------------


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` over padded sequences (``src_key_padding_mask`` from the padding id),
    mean-pooled over the real tokens, a classifier."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids == 0
        x = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` (pre-norm): a causal target mask, padding masks on source and memory."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, heads, layers, layers, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        padding = source == 0
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1], device=target.device)
        y = self.transformer(self.embed(source), self.embed(target), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=padding, memory_key_padding_mask=padding)
        return self.head(y)


class FrozenFastPathEncoder(nn.Module):
    """A frozen ``nn.TransformerEncoder`` (eval mode, no gradients: torch's fused fast path) feeding a
    trained ``nn.TransformerEncoder`` (the slow path, with the padding mask) and a classifier: a
    student over a teacher's features. With ``nested``, the teacher gets the padding mask too and
    turns the batch into a nested tensor, whose size follows the mask's values."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, classes: int = 4, nested: bool = False) -> None:
        super().__init__()
        self.nested = nested
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.teacher = nn.TransformerEncoder(layer, layers, enable_nested_tensor=True).eval().requires_grad_(False)
        self.student = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.1, batch_first=True), 1)
        self.head = nn.Linear(dim, classes)

    def train(self, mode: bool = True) -> FrozenFastPathEncoder:
        super().train(mode)
        self.teacher.eval()  # frozen: always in eval mode, as a teacher is
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        padding = ids == 0
        x = self.embed(ids)
        with torch.no_grad():
            features = self.teacher(x.detach(), src_key_padding_mask=padding if self.nested else None)
        y = self.student(x + features, src_key_padding_mask=padding)
        return self.head(y[:, 0])


class CrossAttentionClassifier(nn.Module):
    """``nn.MultiheadAttention`` with key and value widths of their own (separate projections), an
    additive float mask and a key padding mask, the per-head weights returned and used."""

    def __init__(self, vocab: int, dim: int, heads: int, memory_dim: int, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.memory = nn.Linear(dim, memory_dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True, kdim=memory_dim, vdim=memory_dim)
        self.weights_head = nn.Linear(heads, 1)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        memory = torch.tanh(self.memory(x))
        seq = ids.shape[1]
        distance = torch.arange(seq, device=ids.device)
        bias = -(distance[:, None] - distance[None, :]).abs().float() / seq  # an ALiBi-like additive mask
        padding = torch.zeros(ids.shape, device=ids.device).masked_fill(ids == 0, float("-inf"))
        y, weights = self.attn(x, memory, memory, attn_mask=bias, key_padding_mask=padding, need_weights=True,
                               average_attn_weights=False)
        mixed = self.weights_head(weights.permute(0, 2, 3, 1)).squeeze(-1).mean(-1, keepdim=True)  # (batch, seq, 1)
        return self.head((y * mixed).mean(1))


class GRUSeq2Seq(nn.Module):
    """A 2-layer GRU encoder whose last hidden state starts a GRU decoder (teacher forcing): biases of
    3 x hidden, so the weights' flat cuDNN buffer on CUDA is smaller than their separate blocks."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.encoder = nn.GRU(width, 2 * width, num_layers=2, batch_first=True)
        self.decoder = nn.GRU(width, 2 * width, batch_first=True)
        self.head = nn.Linear(2 * width, vocab)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _, hidden = self.encoder(self.embed(source))
        out, _ = self.decoder(self.embed(target), hidden[-1:].contiguous())
        return self.head(out)


class PackedLSTM(nn.Module):
    """A bidirectional LSTM over ``pack_padded_sequence`` (unsorted lengths), padded back, a classifier."""

    def __init__(self, vocab: int, dim: int, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.head(padded.sum(1) / lengths.to(padded.dtype).unsqueeze(1))


class BagsAndTiedLM(nn.Module):
    """A context ``EmbeddingBag`` (mean, 1-D ids and offsets) beside a token embedding tied to the
    output layer, and one block called twice (shared weights, two sets of saved activations)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.context = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor, context: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.context(context, offsets).unsqueeze(1)
        x = x + self.block(x)
        x = x + self.block(x)  # the same weights again
        return self.out(x)


class NormalizedTextCNN(nn.Module):
    """A 1-D convolutional text model whose convolutions are ``weight_norm``-parametrized and whose
    classifier is ``spectral_norm``-parametrized (power iteration buffers updated in training)."""

    def __init__(self, vocab: int, dim: int, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList(weight_norm(nn.Conv1d(dim, dim, k, padding=k // 2)) for k in (3, 5))
        self.mix = weight_norm(nn.Linear(2 * dim, dim), dim=None)
        self.head = spectral_norm(nn.Linear(dim, classes))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).transpose(1, 2)
        pooled = torch.cat([F.relu(conv(x)).amax(-1) for conv in self.convs], dim=1)
        return self.head(F.gelu(self.mix(pooled)))


class MixedCheckpointLM(nn.Module):
    """Transformer blocks with dropout, even ones under reentrant ``torch.utils.checkpoint``, odd ones
    under non-reentrant; the random state is replayed in each recomputation."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=i % 2 == 0)
        return self.head(self.norm(x))


def _plain(small: Callable[[], nn.Module], real: Callable[[], nn.Module]) -> Callable[[str], nn.Module]:
    return lambda size: small() if size == "small" else real()


TEXT_SHAPES = {"small": (512, 32), "real": (32_000, 512)}
SEQ2SEQ_SHAPES = {"small": (512, 32, 16), "real": (32_000, 256, 128)}  # vocabulary, source, target
BAG_SHAPES = {"small": (512, 16, 8), "real": (32_000, 512, 64)}  # vocabulary, sequence, context ids per sample


def _seq2seq(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, source, target = SEQ2SEQ_SHAPES[size]
    return _padded({size: (vocab, source)})(size, batch), torch.randint(1, vocab, (batch, target))


def _seq2seq_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, SEQ2SEQ_SHAPES[size][0], (batch, SEQ2SEQ_SHAPES[size][2]))


def _seq2seq_tokens(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, source, target = SEQ2SEQ_SHAPES[size]
    return torch.randint(1, vocab, (batch, source)), torch.randint(1, vocab, (batch, target))


def _packed(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, seq = TEXT_SHAPES[size]
    return _padded(TEXT_SHAPES)(size, batch), _lengths(seq, batch)


def _bags(size: str, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vocab, seq, per_sample = BAG_SHAPES[size]
    return (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch * per_sample,)),
            torch.arange(0, batch * per_sample, per_sample))


def _bag_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, BAG_SHAPES[size][0], (batch, BAG_SHAPES[size][1]))


def _entries() -> list[ZooModel]:
    lm = {"small": (512, 32), "real": (32_000, 512)}
    neox = {"small": (512, 32), "real": (50_304, 512)}
    opt_shapes = {"small": (512, 32), "real": (50_272, 512)}
    bloom_shapes = {"small": (512, 32), "real": (50_257, 512)}
    phi_shapes = {"small": (512, 32), "real": (51_200, 512)}
    enc = {"small": (512, 32), "real": (30_522, 128)}
    albert_shapes = {"small": (512, 32), "real": (30_000, 256)}
    roberta_shapes = {"small": (512, 32), "real": (50_265, 256)}
    deberta_shapes = {"small": (512, 32), "real": (128_100, 256)}
    small2 = {"small": 2}
    return [
        ZooModel("mistral", "decoder", "transformers Mistral: sliding-window attention (window < sequence), GQA 16/4, RoPE",
                 mistral, _ids_padded(lm), _id_targets(lm), token_loss, ADAMW, torch.bfloat16, {**small2, "real": 8}, HF),
        ZooModel("qwen2", "decoder", "transformers Qwen2: query/key/value biases, GQA, tied input and output embeddings",
                 qwen2, _ids(lm), _id_targets(lm), token_loss, SGD_MOMENTUM, None, {**small2, "real": 8}, HF),
        ZooModel("qwen2_checkpointed", "decoder", "the same Qwen2 in bf16 with transformers' gradient checkpointing, reentrant",
                 qwen2_checkpointed, _ids(lm), _id_targets(lm), token_loss, ADAMW, torch.bfloat16, {**small2, "real": 16}, HF),
        ZooModel("gpt_neox", "decoder", "transformers GPT-NeoX (Pythia-160M): rotary on a quarter of each head, parallel residual",
                 gpt_neox, _ids_padded(neox), _id_targets(neox), token_loss, SGD_MOMENTUM, None, {**small2, "real": 8}, HF),
        ZooModel("bloom", "decoder", "transformers Bloom: ALiBi biases (baddbmm), embedding LayerNorm, tied embeddings",
                 bloom, _ids(bloom_shapes), _id_targets(bloom_shapes), token_loss, ADAMW, torch.bfloat16, {**small2, "real": 6}, HF),
        ZooModel("opt", "decoder", "transformers OPT-125M: learned positions from the attention mask's cumulative sum",
                 opt, _ids_padded(opt_shapes), _id_targets(opt_shapes), token_loss, ADAMW, None, {**small2, "real": 8}, HF),
        ZooModel("falcon", "decoder", "transformers Falcon: multi-query attention, attention and MLP in parallel, no biases",
                 falcon, _ids(neox), _id_targets(neox), token_loss, SGD_MOMENTUM, torch.bfloat16, {**small2, "real": 8}, HF),
        ZooModel("phi", "decoder", "transformers Phi: half-rotary heads, parallel block, dense GELU MLP",
                 phi, _ids(phi_shapes), _id_targets(phi_shapes), token_loss, ADAMW, torch.bfloat16, {**small2, "real": 8}, HF),
        ZooModel("gemma", "decoder", "transformers Gemma: head dim 256 with one key-value head, GeGLU, scaled embedding, (1+w) RMSNorm",
                 gemma, _ids(lm), _id_targets(lm), token_loss, ADAMW, None, {**small2, "real": 4}, HF),
        ZooModel("mixtral", "mixture of experts", "transformers Mixtral: top-2 of 4 experts in grouped matmuls (F.grouped_mm), "
                 "an attention mask of ones", mixtral, _ids_unpadded(lm), _id_targets(lm), token_loss, ADAMW, None, {**small2, "real": 4}, HF),
        ZooModel("albert", "encoder", "transformers ALBERT-base: one layer's weights run by all twelve, factorized embedding",
                 albert, _ids(albert_shapes), _id_targets(albert_shapes), token_loss, SGD_MOMENTUM, None, {**small2, "real": 16}, HF),
        ZooModel("distilbert", "encoder", "transformers DistilBERT: sequence classification from the first token",
                 distilbert, _ids_padded(enc), _labels(4), class_loss, ADAMW, None, {**small2, "real": 64}, HF),
        ZooModel("roberta", "encoder", "transformers RoBERTa-base in bf16: positions from the padding id's cumulative sum",
                 roberta, _ids_padded(roberta_shapes), _id_targets(roberta_shapes), token_loss, ADAMW, torch.bfloat16, {**small2, "real": 16}, HF),
        ZooModel("deberta_v2", "encoder", "transformers DeBERTa-v2: disentangled relative attention (c2p, p2c), bucketed positions",
                 deberta_v2, _ids_padded(deberta_shapes), _id_targets(deberta_shapes), token_loss, ADAMW, None, {**small2, "real": 6}, HF),
        ZooModel("electra", "encoder", "transformers ELECTRA discriminator: a binary loss per token",
                 electra, _ids_padded(enc), lambda size, batch: torch.randint(0, 2, (batch, enc[size][1])).float(), token_click_loss,
                 SGD_MOMENTUM, torch.bfloat16, {**small2, "real": 64}, HF),
        ZooModel("whisper", "audio encoder-decoder", "transformers Whisper-base: two Conv1d over mel frames, encoder-decoder",
                 whisper, _whisper_inputs, _whisper_targets, token_loss, ADAMW, torch.bfloat16, {**small2, "real": 8}, HF),
        ZooModel("wav2vec2", "audio encoder", "transformers Wav2Vec2-base: conv feature extractor with GroupNorm, weight-normed "
                 "positional conv, time masking, CTC loss", wav2vec2, _audio, _ctc_targets, ctc_loss, SGD_MOMENTUM, None,
                 {**small2, "real": 8}, HF),
        ZooModel("clip", "two towers", "transformers CLIP ViT-B/32: text and image towers, a contrastive loss over the batch",
                 clip, _clip_inputs, _diagonal, contrastive_loss, ADAMW, None, {"small": 4, "real": 64}, HF),
        ZooModel("torch_encoder", "encoder", "nn.TransformerEncoder with src_key_padding_mask, mean over the real tokens",
                 _plain(lambda: PaddedEncoder(512, 64, 4, 2), lambda: PaddedEncoder(32_000, 768, 12, 12)),
                 _padded(TEXT_SHAPES), _labels(4), class_loss, ADAMW, torch.bfloat16, {**small2, "real": 16}),
        ZooModel("frozen_fastpath", "encoder", "a frozen nn.TransformerEncoder in eval mode under no_grad (torch's fused fast path) "
                 "feeding a trained one with a padding mask", _plain(lambda: FrozenFastPathEncoder(512, 64, 4, 2),
                 lambda: FrozenFastPathEncoder(32_000, 768, 12, 6)), _padded(TEXT_SHAPES), _labels(4), class_loss, SGD_MOMENTUM,
                 None, {**small2, "real": 32}),
        ZooModel("frozen_fastpath_nested", "encoder", "the same, the frozen encoder given the padding mask: the batch "
                 "as a nested tensor of the real tokens", _plain(lambda: FrozenFastPathEncoder(512, 64, 4, 2, nested=True),
                 lambda: FrozenFastPathEncoder(32_000, 768, 12, 6, nested=True)), _padded(TEXT_SHAPES), _labels(4), class_loss,
                 ADAMW, torch.bfloat16, {**small2, "real": 32}, unsupported="aten._nested_tensor_from_mask"),
        ZooModel("torch_seq2seq", "encoder-decoder", "nn.Transformer, pre-norm: causal target mask, source and memory padding masks",
                 _plain(lambda: TorchSeq2Seq(512, 64, 4, 2), lambda: TorchSeq2Seq(32_000, 512, 8, 6)),
                 _seq2seq, _seq2seq_targets, token_loss, SGD_MOMENTUM, None, {**small2, "real": 16}),
        ZooModel("mha_masks", "attention", "nn.MultiheadAttention: kdim/vdim projections, additive float mask, padding mask, "
                 "per-head weights used", _plain(lambda: CrossAttentionClassifier(512, 64, 4, 48), lambda: CrossAttentionClassifier(32_000, 1024, 16, 768)),
                 _padded(TEXT_SHAPES), _labels(4), class_loss, ADAMW, None, {**small2, "real": 16}),
        ZooModel("packed_lstm", "RNN", "bidirectional 2-layer nn.LSTM over pack_padded_sequence (unsorted lengths), padded back",
                 _plain(lambda: PackedLSTM(512, 32), lambda: PackedLSTM(32_000, 1024)),
                 # the packed data's rows are the sum of the lengths the inputs give (kept with their
                 # values), and batch_sizes is a host tensor the LSTM's kernels read
                 _packed, _labels(4), class_loss, SGD_MOMENTUM, None, {**small2, "real": 32}),
        ZooModel("gru_seq2seq", "RNN", "GRU encoder-decoder: the encoder's last hidden state starts the decoder, teacher forcing",
                 _plain(lambda: GRUSeq2Seq(512, 32), lambda: GRUSeq2Seq(32_000, 512)),
                 _seq2seq_tokens, _seq2seq_targets, token_loss, ADAMW, None, {**small2, "real": 32}),
        ZooModel("bags_tied", "embeddings", "EmbeddingBag (mean, offsets), token embedding tied to the output, one block called twice",
                 _plain(lambda: BagsAndTiedLM(512, 32), lambda: BagsAndTiedLM(32_000, 1024)),
                 _bags, _bag_targets, token_loss, ADAMW, torch.bfloat16, {**small2, "real": 16}),
        ZooModel("normalized_cnn", "parametrized", "weight_norm and spectral_norm parametrizations over Conv1d and Linear",
                 _plain(lambda: NormalizedTextCNN(512, 32), lambda: NormalizedTextCNN(32_000, 1024)),
                 _tokens(TEXT_SHAPES), _labels(4), class_loss, SGD_MOMENTUM, torch.bfloat16, {**small2, "real": 64}),
        ZooModel("mixed_checkpoint", "decoder", "torch.utils.checkpoint reentrant and non-reentrant in one model, dropout replayed",
                 _plain(lambda: MixedCheckpointLM(512, 64, 4, 4), lambda: MixedCheckpointLM(32_000, 768, 12, 12)),
                 _tokens(TEXT_SHAPES), _id_targets(TEXT_SHAPES), token_loss, ADAMW, None, {**small2, "real": 16}),
    ]


#: The held-back text, audio and plain-torch models by name.
HOLDOUT_TEXT: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}
