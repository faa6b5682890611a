"""Time and host memory of estimating a 7-billion-parameter Llama for FSDP2 across 8 ranks.

Builds transformers' ``LlamaForCausalLM`` (Llama-2-7B's configuration) inside the fake
mode, so no weight is ever allocated, and estimates one rank's step of 8 (batch 1 per
rank, 4096 tokens, AdamW, bf16 mixed precision). Prints seconds, the process's peak RSS
(``resource.getrusage``) and the estimate::

    python benchmarks/parallel_estimate_7b.py --seq 4096 --world-size 8
"""

from __future__ import annotations

import argparse
import resource
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from pytorch_mem_profiler.estimate import estimate_memory
    from pytorch_mem_profiler.estimate.parallel import FSDP2

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=args.seq,
    )  # fmt: skip
    started = time.perf_counter()
    est = estimate_memory(
        lambda: LlamaForCausalLM(config),
        lambda b: {"input_ids": torch.zeros(b, args.seq, dtype=torch.long)},
        batch_size=1,
        loss_fn=lambda out: out.logits.float().sum(),
        optimizer=torch.optim.AdamW,
        device="cuda",
        fit=False,
        parallel=FSDP2(mixed_precision="bf16"),
        world_size=args.world_size,
    )
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    params = est.weights * args.world_size
    print(est)
    print(f"parameters (sum of shards x ranks): {params / 4 / 1e9:.2f} billion float32")
    print(f"seconds: {seconds:.1f}; peak RSS: {rss / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
