"""GPU check of generation throughput: ``tpfuse.inference.generate`` (KV cache, greedy) on a
randomly initialised GPT, one process; the new tokens per second of a batch of prompts.

    python benchmarks/gpu_generation_check.py                # 24 layers, hidden 2048, bf16, one GPU
    python benchmarks/gpu_generation_check.py --cpu-dry-run  # tiny fp32 model on the CPU

Throughput needs no trained weights: the work per token is the same. The batch (8 prompts of 128
tokens, 128 new tokens each) runs once to compile and warm the caches, then once timed
(synchronised wall time): tokens/s = batch · new tokens / seconds, prefill included. Correctness:
the generated ids of the cached run equal those of ``use_cache=False`` (every step recomputes
the whole sequence) on the first prompt's first 8 tokens — a wrong KV cache breaks this. In fp32
(the dry run) a mismatch fails the check; in bf16 it is reported only (the two paths round
differently, and a random model's near-tied logits can then pick another argmax).
Prints one JSON line (``{"tokens_per_s": ..., ...}``); exit status 1 when the check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SHAPES = {  # layers, hidden, heads, batch, prompt length, new tokens, dtype
    "gpu": (24, 2048, 16, 8, 128, 128, torch.bfloat16),
    "dry": (2, 64, 4, 2, 8, 4, torch.float32),
}


def build_model(layers, hidden, heads, dtype, device):
    from tpfuse.models import GPTModel, TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=1024,
        max_position_embeddings=1024, vocab_size=50257, position_embedding_type="rope",
        activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16)
    return GPTModel(config).to(device).eval()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    from tpfuse.inference import generate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("no GPU: nothing to check (use --cpu-dry-run to exercise the script)")
        return 0
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    layers, hidden, heads, batch, prompt_len, new, dtype = SHAPES["dry" if args.cpu_dry_run
                                                                  else "gpu"]
    torch.manual_seed(0)
    model = build_model(layers, hidden, heads, dtype, device)
    prompts = torch.randint(0, 50257, (batch, prompt_len)).tolist()
    with torch.no_grad():
        generate(model, prompts, new, greedy=True)                  # compile, warm the caches
        synchronize(device)
        start = time.perf_counter()
        cached = generate(model, prompts, new, greedy=True)
        synchronize(device)
        seconds = time.perf_counter() - start
        check_len = min(8, new)
        uncached = generate(model, prompts[:1], check_len, greedy=True, use_cache=False)
    same = cached[0][:check_len] == uncached[0][:check_len]
    result = {"tokens_per_s": batch * new / seconds, "seconds": seconds, "batch": batch,
              "prompt_tokens": prompt_len, "new_tokens": new, "layers": layers,
              "hidden": hidden, "cache_matches_recompute": same}
    print(json.dumps(result))
    return 0 if same or dtype != torch.float32 else 1


if __name__ == "__main__":
    sys.exit(main())
