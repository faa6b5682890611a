"""A wide sweep of small models the zoo lacks, for the CPU's checks and a quick GPU run.

:data:`SWEEP` (name -> :class:`~benchmarks.zoo.registry.ZooModel`) holds 156 small models, each
built from a config or code at one size (``"small"`` and ``"real"`` build the same model: the
sweep is for the CPU, where a model's figures are exact at any size): transformers decoders,
encoders, encoder-decoders, state-space and recurrent models, time series, speech, video and vision models, all given attention masks of
ones where they take masks; timm and torchvision CNNs and vision transformers of kinds the zoo
lacks; and plain-torch models of operations it lacks (dilated convolutions, a GRU
encoder-decoder, message passing by ``index_add_``, an STFT front end, pixel shuffle,
``max_norm`` embeddings, unfold and fold, max unpooling, ``grid_sample``, complex Fourier
layers, a VAE, a projected LSTM, ``scatter_reduce``, ``cumsum`` attention, ``cdist``, 3-D
transposed convolutions, an orthogonal parametrization). The GPU machine runs them too, at the
same sizes: ``benchmarks/zoo_conformance.py --registry sweep --quick``. Two of them, Mixtral and the GRU encoder-decoder (its
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


def _right_padded(size: str, batch: int) -> dict[str, torch.Tensor]:
    """Token ids padded on the right (id 0; sample ``i`` loses ``i % 4`` eighths) and their mask."""
    ids = torch.randint(1, VOCAB, (batch, SEQ))
    for i in range(batch):
        ids[i, SEQ - (i % 4) * SEQ // 8 :] = 0
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _long_tokens_and_mask(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (batch, 2 * SEQ)), "attention_mask": torch.ones(batch, 2 * SEQ, dtype=torch.long)}


def _long_token_targets(size: str, batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, 2 * SEQ))


def _filterbanks(size: str, batch: int) -> dict[str, torch.Tensor]:
    """Speech features (80 frames of 16 filterbank channels), their mask, and the decoder's tokens."""
    return {"input_features": torch.randn(batch, 80, 16), "attention_mask": torch.ones(batch, 80, dtype=torch.long),
            "decoder_input_ids": torch.randint(1, VOCAB, (batch, SEQ // 2))}


def _waveform(size: str, batch: int) -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(batch, 4000)}


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
        # a buffer, so that the edge list goes to the model's device with it
        self.register_buffer("edges", torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(0)), persistent=False)

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


class SegNetLite(nn.Module):
    """Max pooling that returns its indices, and ``MaxUnpool2d`` placing values back by them (SegNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)
        self.dec = nn.Conv2d(16, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, where = self.pool(self.enc(x))
        return self.dec(self.unpool(pooled, where, output_size=x.shape[-2:]))


class SpatialTransformer(nn.Module):
    """A localisation net predicts an affine transform; ``affine_grid`` and ``grid_sample`` apply it."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 8, 5, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 6))
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).view(-1, 2, 3) + torch.eye(2, 3, device=x.device)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.body(F.grid_sample(x, grid, align_corners=False))


class FourierNeuralOperator(nn.Module):
    """Spectral convolutions: ``rfft2``, complex weights (``cfloat`` parameters) on the lowest modes, ``irfft2``."""

    def __init__(self, width: int = 16, modes: int = 8) -> None:
        super().__init__()
        self.lift = nn.Conv2d(3, width, 1)
        self.modes = modes
        self.spectral = nn.ParameterList(nn.Parameter(torch.randn(width, width, modes, modes, dtype=torch.cfloat) / width) for _ in range(2))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(2))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        for weight, pointwise in zip(self.spectral, self.pointwise):
            spectrum = torch.fft.rfft2(h)
            mixed = torch.zeros_like(spectrum)
            m = self.modes
            mixed[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], weight)
            h = F.gelu(torch.fft.irfft2(mixed, s=h.shape[-2:]) + pointwise(h))
        return self.head(h.mean((2, 3)))


class VariationalAutoencoder(nn.Module):
    """A VAE: reparameterised sample (``randn_like``), the reconstruction and the KL term in one loss."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 32))
        self.dec = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 256))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_var = self.enc(x).chunk(2, dim=-1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
        return self.dec(z), mean, log_var


def _vae_loss(output: tuple[torch.Tensor, torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    recon, mean, log_var = output
    kl = -0.5 * (1 + log_var - mean.pow(2) - log_var.exp()).sum(-1).mean()
    return F.binary_cross_entropy_with_logits(recon, target) + kl


class ProjectedLSTM(nn.Module):
    """A bidirectional two-layer ``nn.LSTM`` with ``proj_size`` (LSTMP: the hidden state projected)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True, bidirectional=True, proj_size=16)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


class GraphAttention(nn.Module):
    """GAT-style attention over a fixed edge list: scores softmaxed per node by ``scatter_reduce`` (amax) and ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.score = nn.Linear(32, 1)
        self.head = nn.Linear(16, 4)
        self.register_buffer("edges", torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(1)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, target = self.edges
        h = self.proj(x)
        scores = F.leaky_relu(self.score(torch.cat([h[:, source], h[:, target]], -1)).squeeze(-1), 0.2)
        top = torch.full(x.shape[:2], -1e9, dtype=scores.dtype, device=x.device).scatter_reduce(1, target.expand_as(scores), scores, "amax")
        weights = (scores - top[:, target]).exp()
        total = torch.zeros(x.shape[:2], dtype=weights.dtype, device=x.device).index_add_(1, target, weights)
        summed = torch.zeros_like(h).index_add_(1, target, h[:, source] * (weights / total[:, target]).unsqueeze(-1))
        return self.head(F.elu(summed).mean(1))


class CumulativeLinearAttention(nn.Module):
    """Causal linear attention: key-value outer products summed by ``cumsum`` over positions."""

    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for qkv, norm in zip(self.qkv, self.norms):
            q, k, v = (F.elu(t) + 1 if i < 2 else t for i, t in enumerate(qkv(norm(h)).chunk(3, -1)))
            state = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=1)  # (batch, positions, width, width)
            scale = torch.cumsum(k, dim=1)
            h = h + torch.einsum("bpi,bpij->bpj", q, state) / (q * scale).sum(-1, keepdim=True)
        return self.head(h)


class MetricLearning(nn.Module):
    """An embedding net for triplets: ``nn.Bilinear`` scores, ``torch.cdist`` over the batch, a triplet margin loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        self.bilinear = nn.Bilinear(32, 32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        anchor, positive, negative = (self.net(t) for t in x.unbind(1))
        return anchor, positive, negative, torch.cdist(anchor, negative).mean() + self.bilinear(anchor, positive).mean()


def _triplet_loss(output: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    anchor, positive, negative, extra = output
    return F.triplet_margin_loss(anchor, positive, negative) + 0.01 * extra + 0 * target.sum()


class VolumeNet(nn.Module):
    """3-D: strided ``Conv3d``, ``InstanceNorm3d``, ``ConvTranspose3d`` back up, trilinear interpolation."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv3d(1, 8, 3, stride=2, padding=1), nn.InstanceNorm3d(8, affine=True), nn.LeakyReLU())
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.out = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.up(self.down(x)))
        return y + F.interpolate(x.mean(1, keepdim=True).expand(-1, 2, -1, -1, -1), size=y.shape[-3:], mode="trilinear")


class OrthogonalRNNCell(nn.Module):
    """A recurrent cell whose hidden-to-hidden weight is kept orthogonal by ``parametrizations.orthogonal`` (matrix exponential), unrolled in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.inp = nn.Linear(32, 32)
        self.rec = nn.utils.parametrizations.orthogonal(nn.Linear(32, 32, bias=False))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 32, device=x.device)
        outputs = []
        for step in self.embed(x).unbind(1):
            h = torch.tanh(self.inp(step) + self.rec(h))
            outputs.append(h)
        return self.head(torch.stack(outputs, 1))


def _smoothed_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), labels.reshape(-1), label_smoothing=0.1)


def _mae_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """ViT-MAE's own reconstruction loss over the masked patches (the target is unused)."""
    return output.loss


def _main_output_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The mean square of a model's main output (logits, predictions, a depth map, an image, hidden
    states): for models trained on their own heads' outputs here (the target is unused)."""
    for name in ("logits", "prediction_outputs", "predicted_depth", "reconstruction", "last_hidden_state", "state_preds"):
        found = getattr(output, name, None)
        if isinstance(found, torch.Tensor):
            return found.float().pow(2).mean()
    raise TypeError(f"no main output in {type(output).__name__}")


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
    entries += [  # a third probe: families, layers and training code none of the above has
        ("llama_classifier", "decoder", "Llama for sequence classification: right padding, pooled at each row's last token",
         _transformers("LlamaConfig", "LlamaForSequenceClassification", **llama_like, pad_token_id=0, num_labels=10), _right_padded, _classes,
         class_loss, ADAMW, None, hf),
        ("bigbird", "encoder", "BigBird: block-sparse attention, random blocks drawn by numpy",
         _transformers("BigBirdConfig", "BigBirdForMaskedLM", **dict(encoder, max_position_embeddings=2 * SEQ), attention_type="block_sparse",
                       block_size=4, num_random_blocks=2), _long_tokens_and_mask, _long_token_targets, token_loss, ADAMW, None, hf),
        ("reformer", "decoder", "Reformer: reversible layers recomputed in backward, LSH and local chunked attention, axial positions",
         _transformers("ReformerConfig", "ReformerModelWithLMHead", vocab_size=VOCAB, hidden_size=64, attention_head_size=16, num_attention_heads=4,
                       attn_layers=["local", "lsh"], axial_pos_shape=(4, 8), axial_pos_embds_dim=(32, 32), feed_forward_size=128, is_decoder=True,
                       local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, num_hashes=1, max_position_embeddings=SEQ, pad_token_id=0,
                       # its training seeds torch from the OS (torch.seed()): fixed hashing, no dropout, so two runs agree
                       hash_seed=0, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0),
         _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("canine", "encoder", "CANINE: hashed character embeddings, downsampling convolution, local attention, upsampling",
         _transformers("CanineConfig", "CanineForSequenceClassification", **encoder, num_hash_functions=2, num_hash_buckets=64,
                       downsampling_rate=4, local_transformer_stride=8, num_labels=10), _tokens_and_mask, _classes, class_loss, ADAMW, None, hf),
        ("squeezebert", "encoder", "SqueezeBERT: grouped 1-D convolutions for the projections", _transformers("SqueezeBertConfig",
         "SqueezeBertForMaskedLM", **encoder, embedding_size=64), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("speech2text", "encoder-decoder", "Speech2Text: strided Conv1d subsampling of filterbank features, then a transformer",
         _transformers("Speech2TextConfig", "Speech2TextForConditionalGeneration", vocab_size=VOCAB, d_model=64, encoder_layers=1,
                       decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       input_feat_per_channel=16, num_conv_layers=2, conv_channels=32, conv_kernel_sizes=(5, 5), max_source_positions=64,
                       max_target_positions=64, pad_token_id=0, decoder_start_token_id=0), _filterbanks, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("sew", "audio", "SEW: waveform convolutions, the sequence squeezed and upsampled around the encoder",
         _transformers("SEWConfig", "SEWForSequenceClassification", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4, squeeze_factor=2, layerdrop=0.0, num_labels=10), _waveform, _classes, class_loss, ADAMW, None, hf),
        ("mamba2", "state space", "Mamba-2: chunked state-space duality (the torch path)", _transformers("Mamba2Config", "Mamba2ForCausalLM",
         vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=8, n_groups=1, chunk_size=16),
         _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("recurrent_gemma", "state space", "RecurrentGemma: RG-LRU recurrent blocks and local attention", _transformers("RecurrentGemmaConfig",
         "RecurrentGemmaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
         num_key_value_heads=1, head_dim=16, lru_width=64, attention_window_size=16, block_types=("recurrent", "recurrent", "attention"),
         conv1d_width=4, pad_token_id=0), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("jamba", "mixture of experts", "Jamba: Mamba and attention layers, experts every other layer", _transformers("JambaConfig",
         "JambaForCausalLM", **llama_like, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
         attn_layer_offset=0, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2), _tokens, _token_targets, token_loss,
         ADAMW, None, hf),
        ("qwen2_moe", "mixture of experts", "Qwen2-MoE: routed experts and a gated shared expert", _transformers("Qwen2MoeConfig",
         "Qwen2MoeForCausalLM", **llama_like, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
         _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("hf_swin", "vision transformer", "transformers Swin: shifted windows, stochastic depth", _transformers("SwinConfig",
         "SwinForImageClassification", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10),
         _pixels(32), _classes, class_loss, ADAMW, None, hf),
    ]
    timm_more = {
        "vit_small_patch16_224": {"img_size": 64, "depth": 2, "drop_path_rate": 0.1}, "deit3_small_patch16_224": {"img_size": 64, "depth": 2},
        "volo_d1_224": {"img_size": 64}, "pit_ti_224": {"img_size": 64}, "mvitv2_tiny": {"img_size": 64}, "mixnet_s": {}, "rexnet_100": {},
        "lcnet_050": {}, "selecsls42b": {}, "dpn68": {}, "ese_vovnet19b_dw": {}, "tresnet_m": {}, "sequencer2d_s": {"img_size": 64},
        "gmlp_s16_224": {"img_size": 64}, "convmixer_768_32": {}, "inception_next_tiny": {}, "mambaout_femto": {}, "starnet_s1": {},
        "hgnetv2_b0": {}, "nest_tiny": {"img_size": 64}, "lambda_resnet26t": {"img_size": 64},
    }  # fmt: skip
    for name, settings in timm_more.items():
        entries.append((f"timm_{name}", "timm", f"timm {name}", _timm(name, **settings), _images(64), _classes, class_loss, ADAMW, None, tm))
    for name, side in {"swin_t": 64, "mobilenet_v3_large": 64, "regnet_y_400mf": 64, "shufflenet_v2_x0_5": 64}.items():
        entries.append((f"tv_{name}", "torchvision", f"torchvision {name}", _torchvision(name, num_classes=10), _images(side), _classes, class_loss,
                        SGD_MOMENTUM, None, tv))  # fmt: skip
    entries += [
        ("tv_r2plus1d_18", "torchvision", "torchvision R(2+1)D-18: factorised spatial and temporal convolutions", _torchvision("r2plus1d_18",
         num_classes=10), lambda size, batch: torch.randn(batch, 3, 8, 32, 32), _classes, class_loss, ADAMW, None, tv),
        ("segnet", "plain torch", "MaxPool2d(return_indices) and MaxUnpool2d, per-pixel loss", _plain(SegNetLite), _images(32),
         lambda size, batch: torch.randint(0, 5, (batch, 32, 32)), lambda output, labels: F.cross_entropy(output, labels), ADAMW, None, ()),
        ("spatial_transformer", "plain torch", "affine_grid and grid_sample from a predicted transform", _plain(SpatialTransformer), _images(32),
         _classes, class_loss, ADAMW, None, ()),
        ("fourier_operator", "plain torch", "rfft2, complex (cfloat) weights on the lowest modes, irfft2", _plain(FourierNeuralOperator),
         _images(32), _classes, class_loss, ADAMW, None, ()),
        ("vae", "plain torch", "reparameterised sampling (randn_like), reconstruction plus KL", _plain(VariationalAutoencoder),
         lambda size, batch: torch.rand(batch, 256), lambda size, batch: torch.rand(batch, 256), _vae_loss, ADAMW, None, ()),
        ("projected_lstm", "plain torch", "bidirectional 2-layer LSTM with proj_size", _plain(ProjectedLSTM),
         lambda size, batch: torch.randint(0, VOCAB, (batch, SEQ)), _token_targets, token_loss, SGD_MOMENTUM, None, ()),
        ("graph_attention", "plain torch", "attention over edges: scatter_reduce (amax), exp, index_add_", _plain(GraphAttention),
         lambda size, batch: torch.randn(batch, 64, 16), lambda size, batch: torch.randint(0, 4, (batch,)), class_loss, ADAMW, None, ()),
        ("linear_attention", "plain torch", "causal linear attention by cumsum of key-value products", _plain(CumulativeLinearAttention),
         lambda size, batch: torch.randint(0, VOCAB, (batch, SEQ)), _token_targets, token_loss, ADAMW, None, ()),
        ("metric_learning", "plain torch", "triplets: Bilinear, cdist, triplet margin loss", _plain(MetricLearning),
         lambda size, batch: torch.randn(batch, 3, 64), _classes, _triplet_loss, ADAMW, None, ()),
        ("volume_net", "plain torch", "Conv3d, InstanceNorm3d, ConvTranspose3d, trilinear interpolation", _plain(VolumeNet),
         lambda size, batch: torch.randn(batch, 1, 16, 16, 16), lambda size, batch: torch.randn(batch, 2, 16, 16, 16), _l1, ADAMW, None, ()),
        ("orthogonal_rnn", "plain torch", "an orthogonal parametrization (matrix exponential) recomputed at every step of a Python loop",
         _plain(OrthogonalRNNCell), lambda size, batch: torch.randint(0, VOCAB, (batch, SEQ)), _token_targets, token_loss, ADAMW, None, ()),
    ]
    seq2seq = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_ffn_dim=128, decoder_ffn_dim=128)
    entries += [  # a fourth probe: transformers and timm families none of the above has
        ("longformer", "encoder", "Longformer: sliding-window attention, global tokens found by reading a float mask back",
         _transformers("LongformerConfig", "LongformerForMaskedLM", **encoder, attention_window=16, pad_token_id=1), _tokens_and_mask,
         _token_targets, token_loss, ADAMW, None, hf),
        ("led", "encoder-decoder", "LED: Longformer's encoder under a BART-style decoder",
         _transformers("LEDConfig", "LEDForConditionalGeneration", **seq2seq, attention_window=16, max_encoder_position_embeddings=64,
                       max_decoder_position_embeddings=64), _seq2seq, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("mbart", "encoder-decoder", "mBART: pre-norm BART, layer norms on the embeddings",
         _transformers("MBartConfig", "MBartForConditionalGeneration", **seq2seq, max_position_embeddings=64), _seq2seq, _seq2seq_targets,
         token_loss, ADAMW, None, hf),
        ("switch_transformers", "mixture of experts", "Switch Transformers: top-1 routing, a router converted to fp32 in its forward",
         _transformers("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", vocab_size=VOCAB, d_model=64, d_kv=16,
                       d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1,
                       decoder_start_token_id=0),
         _seq2seq, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("gpt_neo", "decoder", "GPT-Neo: global and local attention alternating",
         _transformers("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                       attention_types=[[["global", "local"], 1]], window_size=16, max_position_embeddings=64), _tokens_and_mask, _token_targets,
         token_loss, ADAMW, None, hf),
        ("codegen", "decoder", "CodeGen: fused qkv split in model-parallel blocks, partial rotary",
         _transformers("CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                       n_ctx=64), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("xglm", "decoder", "XGLM: sinusoidal positions made in the forward", _transformers("XGLMConfig", "XGLMForCausalLM", vocab_size=VOCAB,
         d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=64), _tokens_and_mask, _token_targets, token_loss,
         ADAMW, None, hf),
        ("biogpt", "decoder", "BioGPT: scaled embeddings, learned positions offset by two", _transformers("BioGptConfig", "BioGptForCausalLM",
         **dict(encoder, max_position_embeddings=64)), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("deberta", "encoder", "DeBERTa (v1): disentangled attention, relative positions", _transformers("DebertaConfig", "DebertaForMaskedLM",
         **encoder, relative_attention=True, pos_att_type=["c2p", "p2c"]), _tokens_and_mask, _token_targets, token_loss, ADAMW, None, hf),
        ("vit_mae", "vision transformer", "ViT-MAE: random masking by argsort of noise, the kept patches gathered",
         _transformers("ViTMAEConfig", "ViTMAEForPreTraining", image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                       decoder_intermediate_size=64), _pixels(32), lambda size, batch: torch.zeros(batch), _mae_loss, ADAMW, None, hf),
    ]
    audio = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 4),
                 conv_kernel=(10, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32, layerdrop=0.0, mask_time_prob=0.0)
    waveform, frames = (lambda size, batch: {"input_values": torch.randn(batch, 4000)}), (lambda size, batch: torch.zeros(batch))
    video = lambda size, batch: {"pixel_values": torch.randn(batch, 4, 3, 32, 32)}  # noqa: E731
    entries += [  # a fifth probe: time series, reinforcement learning, video, dense prediction, super-resolution, speech
        ("patchtst", "time series", "PatchTST: patches per channel, batch norm over the transposed sequence",
         _transformers("PatchTSTConfig", "PatchTSTForPrediction", num_input_channels=3, context_length=64, patch_length=8, patch_stride=8,
                       prediction_length=16, d_model=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64),
         lambda size, batch: {"past_values": torch.randn(batch, 64, 3)}, frames, _main_output_loss, ADAMW, None, hf),
        ("decision_transformer", "reinforcement learning", "Decision Transformer: states, actions and returns interleaved for GPT-2",
         _transformers("DecisionTransformerConfig", "DecisionTransformerModel", state_dim=8, act_dim=3, hidden_size=64, n_layer=2, n_head=4,
                       max_ep_len=64, n_positions=128),
         lambda size, batch: {"states": torch.randn(batch, 16, 8), "actions": torch.randn(batch, 16, 3), "rewards": torch.randn(batch, 16, 1),
                              "returns_to_go": torch.randn(batch, 16, 1), "timesteps": torch.arange(16).repeat(batch, 1),
                              "attention_mask": torch.ones(batch, 16, dtype=torch.long)}, frames, _main_output_loss, ADAMW, None, hf),
        ("perceiver", "encoder", "Perceiver: cross-attention into latents, decoded by queries",
         _transformers("PerceiverConfig", "PerceiverForMaskedLM", vocab_size=VOCAB, d_model=64, d_latents=64, num_latents=16, num_blocks=1,
                       num_self_attends_per_block=2, num_self_attention_heads=4, num_cross_attention_heads=4, max_position_embeddings=64,
                       qk_channels=64, v_channels=64),
         lambda size, batch: {"inputs": torch.randint(1, VOCAB, (batch, 2 * SEQ)), "attention_mask": torch.ones(batch, 2 * SEQ, dtype=torch.long)},
         _long_token_targets, token_loss, ADAMW, None, hf),
        ("rwkv", "recurrent", "RWKV: time-mixing recurrence written in Python over the sequence",
         _transformers("RwkvConfig", "RwkvForCausalLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                       intermediate_size=128, context_length=64), _tokens, _token_targets, token_loss, ADAMW, None, hf),
        ("longt5", "encoder-decoder", "LongT5: transient-global attention over local blocks",
         _transformers("LongT5Config", "LongT5ForConditionalGeneration", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                       num_decoder_layers=2, num_heads=4, local_radius=8, encoder_attention_type="transient-global", decoder_start_token_id=0),
         _seq2seq, _seq2seq_targets, token_loss, ADAMW, None, hf),
        ("prophetnet", "encoder-decoder", "ProphetNet: n-gram streams in the decoder's self-attention",
         _transformers("ProphetNetConfig", "ProphetNetForConditionalGeneration", vocab_size=VOCAB, hidden_size=64, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, max_position_embeddings=64, ngram=2, num_buckets=8, relative_max_distance=16),
         _seq2seq, frames, _main_output_loss, ADAMW, None, hf),
        ("videomae", "video", "VideoMAE: tubelet embeddings, one attention over space and time",
         _transformers("VideoMAEConfig", "VideoMAEForVideoClassification", image_size=32, patch_size=8, num_frames=4, tubelet_size=2,
                       hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=10),
         video, _classes, class_loss, ADAMW, None, hf),
        ("timesformer", "video", "TimeSformer: divided attention, in time then in space",
         _transformers("TimesformerConfig", "TimesformerForVideoClassification", image_size=32, patch_size=8, num_frames=4, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=10), video, _classes, class_loss, ADAMW, None, hf),
        ("dpt", "dense prediction", "DPT: a ViT's tokens reassembled at four scales and fused into a depth map",
         _transformers("DPTConfig", "DPTForDepthEstimation", image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=128, neck_hidden_sizes=[16, 32, 64, 64], fusion_hidden_size=32,
                       backbone_out_indices=[0, 1, 2, 3]), _pixels(32), frames, _main_output_loss, ADAMW, None, hf),
        ("swin2sr", "super-resolution", "Swin2SR: shifted windows at full resolution, a pixel-shuffle upsampler",
         _transformers("Swin2SRConfig", "Swin2SRForImageSuperResolution", image_size=32, patch_size=1, embed_dim=32, depths=[2], num_heads=[4],
                       window_size=8, upscale=2), _pixels(32), frames, _main_output_loss, ADAMW, None, hf),
        ("wav2vec2_conformer", "audio", "Wav2Vec2-Conformer: relative positions, a convolution module with batch norm",
         _transformers("Wav2Vec2ConformerConfig", "Wav2Vec2ConformerModel", **audio, position_embeddings_type="relative",
                       conv_depthwise_kernel_size=7), waveform, frames, _main_output_loss, ADAMW, None, hf),
        ("hubert", "audio", "HuBERT: a waveform front end and an encoder, no quantizer",
         _transformers("HubertConfig", "HubertModel", **audio), waveform, frames, _main_output_loss, ADAMW, None, hf),
        ("layoutlm", "encoder", "LayoutLM: 2-D position embeddings from each token's box",
         _transformers("LayoutLMConfig", "LayoutLMForMaskedLM", **encoder),
         lambda size, batch: {**_tokens_and_mask(size, batch), "bbox": torch.randint(0, 500, (batch, SEQ, 4)).sort(-1).values},
         _token_targets, token_loss, ADAMW, None, hf),
        ("bit", "CNN", "BiT: weight-standardized convolutions, group norm",
         _transformers("BitConfig", "BitForImageClassification", hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], embedding_size=32,
                       num_groups=8, num_labels=10), _pixels(64), _classes, class_loss, SGD_MOMENTUM, None, hf),
    ]
    for name, settings in {"davit_tiny": {}, "focalnet_tiny_srf": {}, "mobilenetv4_conv_small": {}, "eva02_tiny_patch14_224": {"img_size": 64},
                           "tnt_s_patch16_224": {"img_size": 64}, "coat_tiny": {"img_size": 64}}.items():
        entries.append((f"timm_{name}", "timm", f"timm {name}", _timm(name, **settings), _images(64), _classes, class_loss, ADAMW, None, tm))
    #: routing by data (Switch Transformers' top-1 experts: ``nonzero`` of the experts the router chose) is refused, naming it
    refused = {"switch_transformers": "aten.nonzero"}
    return [
        ZooModel(name, family, exercises, build, inputs, targets, loss, optimizer, autocast, {"small": 2, "real": 2}, needs, refused.get(name))
        for name, family, exercises, build, inputs, targets, loss, optimizer, autocast, needs in entries
    ]


#: The sweep's models by name.
SWEEP: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}
