"""The efficient attention kernel's backward: the blocks it takes beside the three gradients
(``estimate.scratch.efficient_attention_backward_scratch``), against the H200's allocator history
(``benchmarks/attention_backward_rules.py``), and in a CUDA estimate's step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.scratch import efficient_attention_backward_scratch

#: What ``benchmarks/attention_backward_rules.py`` recorded inside each call on an H200 (torch 2.11,
#: 2026-11-29): the blocks after the three gradients, in order, each given back before the call
#: returned. Every shape up to a head dim of 128 ran with query, key and value packed in one tensor, apart, and contiguous,
#: unmasked, masked (a key padding mask expanded) and causal: the blocks were the same in all of
#: them (141 calls; bf16 at 500 positions with a mask is refused by the kernel, its bias unaligned).
MEASURED: dict[tuple[tuple[int, int, int, int], str], tuple[int, ...]] = {
    ((8, 12, 512, 64), "float32"): (12582912, 196608, 196608, 12595200),
    ((8, 12, 512, 64), "bfloat16"): (196608, 12595200),
    ((32, 12, 512, 64), "float32"): (50331648, 786432, 786432, 50380800),
    ((32, 12, 512, 64), "bfloat16"): (786432, 50380800),
    ((112, 12, 512, 64), "float32"): (176160768, 2752512, 2752512, 176332800),
    ((112, 12, 512, 64), "bfloat16"): (2752512, 176332800),
    ((16, 4, 128, 64), "float32"): (2097152, 32768, 32768, 2099200),
    ((16, 4, 128, 64), "bfloat16"): (32768, 2099200),
    ((8, 8, 1024, 64), "float32"): (16777216, 262144, 262144, 16793600),
    ((8, 8, 1024, 64), "bfloat16"): (262144, 16793600),
    ((8, 12, 512, 128), "float32"): (25165824, 196608, 196608, 25178112),
    ((8, 12, 512, 128), "bfloat16"): (196608, 25171968),
    ((8, 12, 500, 80), "float32"): (15360000, 192000, 192000, 25178112),
    ((8, 12, 500, 80), "bfloat16"): (192000, 25171968),
    ((64, 16, 256, 32), "float32"): (33554432, 1048576, 1048576, 67174400),
    ((64, 16, 256, 32), "bfloat16"): (1048576, 67174400),
    # head dims above 128 (the kernel built for any head dim; the same H200, 2026-11-29), contiguous,
    # unmasked, masked and causal alike: tiles of 128 positions by 64 columns, and in bf16 the key's
    # and value's gradients staged per split of the keys
    ((8, 4, 128, 160), "float32"): (2621440, 16384, 16384, 3147264),
    ((8, 4, 128, 160), "bfloat16"): (16384, 11535872),
    ((8, 4, 128, 192), "float32"): (3145728, 16384, 16384, 3147264),
    ((8, 4, 128, 192), "bfloat16"): (16384, 11535872),
    ((8, 4, 128, 256), "float32"): (4194304, 16384, 16384, 4196352),
    ((8, 4, 128, 256), "bfloat16"): (16384, 12584960),
    ((8, 4, 128, 512), "float32"): (8388608, 16384, 16384, 8392704),
    ((8, 4, 128, 512), "bfloat16"): (16384, 25169920),
    ((8, 4, 512, 160), "float32"): (10485760, 65536, 65536, 12589056),
    ((8, 4, 512, 160), "bfloat16"): (65536, 37754880),
    ((8, 4, 512, 192), "float32"): (12582912, 65536, 65536, 12589056),
    ((8, 4, 512, 192), "bfloat16"): (65536, 37754880),
    ((8, 4, 512, 256), "float32"): (16777216, 65536, 65536, 16785408),
    ((8, 4, 512, 256), "bfloat16"): (65536, 41951232),
    ((8, 4, 512, 512), "float32"): (33554432, 65536, 65536, 33570816),
    ((8, 4, 512, 512), "bfloat16"): (65536, 83902464),
    ((8, 8, 128, 160), "float32"): (5242880, 32768, 32768, 6294528),
    ((8, 8, 128, 160), "bfloat16"): (32768, 23071744),
    ((8, 8, 128, 192), "float32"): (6291456, 32768, 32768, 6294528),
    ((8, 8, 128, 192), "bfloat16"): (32768, 23071744),
    ((8, 8, 128, 256), "float32"): (8388608, 32768, 32768, 8392704),
    ((8, 8, 128, 256), "bfloat16"): (32768, 25169920),
    ((8, 8, 128, 512), "float32"): (16777216, 32768, 32768, 16785408),
    ((8, 8, 128, 512), "bfloat16"): (32768, 50339840),
    ((8, 8, 512, 160), "float32"): (20971520, 131072, 131072, 25178112),
    ((8, 8, 512, 160), "bfloat16"): (131072, 50343936),
    ((8, 8, 512, 192), "float32"): (25165824, 131072, 131072, 25178112),
    ((8, 8, 512, 192), "bfloat16"): (131072, 50343936),
    ((8, 8, 512, 256), "float32"): (33554432, 131072, 131072, 33570816),
    ((8, 8, 512, 256), "bfloat16"): (131072, 58736640),
    ((8, 8, 512, 512), "float32"): (67108864, 131072, 131072, 67141632),
    ((8, 8, 512, 512), "bfloat16"): (131072, 117473280),
}


@pytest.mark.parametrize("shape, dtype", list(MEASURED))
def test_the_rule_gives_the_blocks_the_h200_recorded(shape, dtype):
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    assert efficient_attention_backward_scratch(shape, itemsize) == MEASURED[(shape, dtype)]


class Encoder(nn.Module):
    """An ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``: the output's gradient comes back
    positions first), or with ``heads_last`` attention written as transformers writes it (the
    output transposed back and reshaped: its gradient comes back laid out as the kernel's output)."""

    def __init__(self, heads_last: bool = False) -> None:
        super().__init__()
        self.heads_last = heads_last
        self.embed = nn.Embedding(100, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.qkv = nn.Linear(64, 3 * 64)
        self.head = nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.heads_last:
            batch, length, _ = x.shape
            q, k, v = (t.view(batch, length, 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, 64)
        else:
            x = self.layer(x)
        return self.head(x[:, 0])


def _backward_requests(heads_last: bool, batch: int, length: int) -> list[int]:
    ids = torch.randint(1, 100, (batch, length))
    estimate = estimate_memory(Encoder(heads_last), ids, targets=torch.zeros(batch, dtype=torch.long), loss_fn=F.cross_entropy,
                               device="cuda", fit=False)  # fmt: skip
    events = estimate.step_events
    made = []
    for index, (key, nbytes) in enumerate(events.events):
        source = events.sources.get(key, "")
        if nbytes > 0 and events.phase_at(index) == (1, "backward") and source.startswith("aten._scaled_dot_product_efficient_attention_backward"):
            made.append(nbytes)
    return made


@pytest.mark.parametrize("heads_last", [False, True])
def test_a_cuda_estimate_takes_the_blocks_around_the_gradients_in_its_step(heads_last):
    """A float32 attention trained (the efficient kernel, emulated where there is no GPU): the
    backward asks for a copy of the output's gradient first where ``nn.MultiheadAttention`` hands it
    back positions first (ATen's ``grad_out_.contiguous()``), none where it comes back laid out as the
    kernel's output; then the three gradients and the rule's blocks."""
    batch, length = 8, 128
    gradient = batch * 4 * length * 16 * 4
    rule = list(efficient_attention_backward_scratch((batch, 4, length, 16), 4))
    copy = [] if heads_last else [gradient]
    assert _backward_requests(heads_last, batch, length) == copy + [gradient] * 3 + rule


class WideSelfAttention(nn.Module):
    """Self-attention whose query and key heads are ``head`` wide and value heads ``value_head``."""

    def __init__(self, head: int, value_head: int, heads: int = 4, width: int = 64) -> None:
        super().__init__()
        self.heads, self.head, self.value_head = heads, head, value_head
        self.qk = nn.Linear(width, 2 * heads * head, bias=False)
        self.v = nn.Linear(width, heads * value_head, bias=False)
        self.out = nn.Linear(heads * value_head, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k = self.qk(x).view(b, n, 2, self.heads, self.head).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, n, self.heads, self.value_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize(
    "head, value_head, autocast",
    [(320, 320, torch.bfloat16), (128, 192, torch.float16), (160, 64, torch.bfloat16), (320, 320, None), (96, 128, torch.bfloat16)],
)
def test_a_cuda_estimates_forward_takes_the_float32_accumulator_above_a_head_dim_of_128(head, value_head, autocast):
    """In half precision, with the query's or the value's head dim above 128, each forward of the
    efficient kernel takes a float32 block of its output's elements beside the outputs and gives it
    back (ATen's ``output_accum``, on the H200's history: ``tests/test_estimate_attention_backward_cuda.py``);
    in float32, or up to 128, none. (Head dims apart or above 256: flash attention, which takes equal
    head dims up to 256 unmasked in half precision, does not run them.)"""
    batch, length, heads = 4, 64, 4
    estimate = estimate_memory(WideSelfAttention(head, value_head, heads), torch.zeros(batch, length, 64), autocast=autocast,
                               device="cuda", fit=False)  # fmt: skip
    events = estimate.step_events
    taken, given = [], []
    for index, (key, nbytes) in enumerate(events.events):
        if events.sources.get(key, "").startswith("aten._scaled_dot_product_efficient_attention.default; forward; other"):
            (taken if nbytes > 0 else given).append(nbytes)
    assert any(source.startswith("aten._scaled_dot_product_efficient_attention.default") for source in events.sources.values())
    wide = autocast is not None and max(head, value_head) > 128
    accumulator = 4 * batch * length * heads * value_head
    assert taken == ([accumulator] * 2 if wide else [])  # one in each of the estimate's two steps
    assert given == [-nbytes for nbytes in taken]
