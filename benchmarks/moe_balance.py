"""Expert load balance over a short training run, with and without the load-balancing loss.

Trains the same small MoE GPT (4 layers, hidden 64, 8 experts, top-2, every layer MoE) on the
README's corpus (the standard library's Python sources, byte tokenizer) twice — once with
``--moe-aux-loss-coeff 0`` and once with ``1e-2`` — reading the trainer's ``tokens_per_expert``
metrics (tokens of each global batch routed to each expert, per layer). The imbalance of a layer
is max_e n_e / mean_e n_e (1 = perfectly balanced, 4 = one expert gets everything at top-2 of 8).

    python3 benchmarks/moe_balance.py [--iters 80] [--png benchmarks/moe_expert_balance.png]

Writes the PNG (imbalance per iteration, averaged over layers; and the share of tokens per expert
over the last 20 iterations, per layer) and prints the numbers RESULTS.md quotes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128",
         "--make-vocab-size-divisible-by", "64", "--micro-batch-size", "8",
         "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters",
         "5", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--eval-interval", "1000",
         "--eval-iters", "1", "--log-interval", "10", "--no-progress-bar", "--no-layout-table",
         "--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm",
         "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
         "--no-sequence-parallel"]
COEFFS = (0.0, 1e-2)


def _train(argv):
    from tpfuse.pretrain_gpt import (forward_step, model_provider,
                                     train_valid_test_datasets_provider)
    from tpfuse.training.pretrain import pretrain

    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)


def _imbalance(tokens_per_expert: dict) -> list[float]:
    return [max(counts) / statistics.mean(counts) for counts in tokens_per_expert.values()]


def run(iters: int, workdir: str) -> dict:
    from tpfuse.parallel.launch import spawn
    from tpfuse.training.presets import default_cache_dir, ensure_stdlib_corpus

    data = ["--data-path", ensure_stdlib_corpus(default_cache_dir()), "--tokenizer-type",
            "ByteTokenizer", "--split", "969,30,1"]
    records = {}
    for coeff in COEFFS:
        metrics = os.path.join(workdir, f"metrics_{coeff}.jsonl")
        flags = ["--train-iters", str(iters), "--lr-decay-iters", str(iters),
                 "--moe-aux-loss-coeff", str(coeff), "--metrics-file", metrics]
        spawn(_train, 1, MODEL + data + flags)
        with open(metrics) as handle:
            records[coeff] = [r for r in map(json.loads, handle) if "tokens_per_expert" in r]
    return records


def plot(records: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(records[COEFFS[0]][0]["tokens_per_expert"], key=int)
    fig, axes = plt.subplots(1, 1 + len(layers), figsize=(4 + 3 * len(layers), 3.6),
                             gridspec_kw={"width_ratios": [2] + [1] * len(layers)})
    for coeff, style in zip(COEFFS, ("-", "--")):
        curve = [statistics.mean(_imbalance(r["tokens_per_expert"])) for r in records[coeff]]
        axes[0].plot([r["iteration"] for r in records[coeff]], curve, style,
                     label=f"aux loss coeff {coeff:g}")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xlabel="iteration", ylabel="max / mean tokens per expert",
                title="expert load imbalance (mean over layers)")
    axes[0].legend()
    for ax, layer in zip(axes[1:], layers):
        for offset, coeff in zip((-0.2, 0.2), COEFFS):
            totals = [sum(r["tokens_per_expert"][layer][e] for r in records[coeff][-20:])
                      for e in range(8)]
            share = [t / sum(totals) for t in totals]
            ax.bar([e + offset for e in range(8)], share, width=0.4, label=f"coeff {coeff:g}")
        ax.axhline(1 / 8, color="grey", linewidth=0.8)
        ax.set(title=f"layer {layer}: token share", xlabel="expert", xticks=range(8))
    axes[1].set_ylabel("share of tokens (last 20 iterations)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(records: dict) -> str:
    lines = []
    for coeff in COEFFS:
        last = records[coeff][-20:]
        imbalance = statistics.mean(statistics.mean(_imbalance(r["tokens_per_expert"]))
                                    for r in last)
        worst = max(max(_imbalance(r["tokens_per_expert"])) for r in last)
        lines.append(f"coeff {coeff:g}: imbalance over the last 20 iterations mean "
                     f"{imbalance:.2f}, worst layer-iteration {worst:.2f}; final lm loss "
                     f"{records[coeff][-1]['loss']:.4f}; load_balancing_loss "
                     f"{records[coeff][-1].get('load_balancing_loss', float('nan')):.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=80)
    parser.add_argument("--png", default=os.path.join(os.path.dirname(__file__),
                                                      "moe_expert_balance.png"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        records = run(args.iters, workdir)
    plot(records, args.png)
    print(summary(records))
    print(f"plot written to {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
