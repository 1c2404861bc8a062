"""Model FLOPs per iteration, achieved TFLOP/s per rank, and model FLOPs utilisation (MFU).

Counting convention (Megatron's and PaLM's): only matrix multiplications, 2 FLOPs per
multiply-add, attention over the full s × s square (the causal half is not discounted), backward =
2 × forward, full activation recompute = one more forward. Per token and transformer layer, with
h hidden, g query groups of head dim d = h / heads, f = ffn hidden size, s sequence length::

    qkv          2 · h · (h + 2·g·d)
    attention    2 · 2 · s · h                  (Q·Kᵀ and P·V)
    projection   2 · h · h
    mlp          2 · h · f · (3 if swiglu else 2)           (dense layers)
    MoE layer    2 · h · E (router) + 2 · h · (k · f_e + f_s) · (3 if swiglu else 2)
                 (k experts per token of hidden f_e = moe_ffn_hidden_size, f_s the shared expert's)

plus the output layer 2 · h · V_padded per token. One iteration of B samples::

    FLOPs = (3 + recompute) · B · s · (L · per-layer + 2 · h · V_padded)

TFLOP/s per rank = FLOPs / (seconds · world size) / 10¹²; MFU = TFLOP/s per rank / peak TFLOP/s
of one device (``--peak-tflops``: the dense peak in the training precision).
"""
from __future__ import annotations

from tpfuse.models.moe_config import moe_layer_pattern


def forward_flops_per_token(config) -> float:
    """Model FLOPs of one token's forward pass (see the module docstring)."""
    h, s, layers = config.hidden_size, config.seq_length, config.num_layers
    kv = config.num_query_groups * config.kv_channels
    mlp_matrices = 3 if config.activation == "swiglu" else 2
    attention = 2 * h * (h + 2 * kv) + 2 * 2 * s * h + 2 * h * h
    dense_mlp = 2 * h * config.ffn_hidden_size * mlp_matrices
    moe_layers = sum(moe_layer_pattern(config))
    moe_mlp = 0
    if moe_layers:
        hidden = (config.moe_router_topk * config.moe_ffn_hidden_size
                  + (config.moe_shared_expert_intermediate_size or 0))
        moe_mlp = 2 * h * config.num_moe_experts + 2 * h * hidden * mlp_matrices
    return (layers * attention + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
            + 2 * h * config.padded_vocab_size)


def flops_per_iteration(config, global_batch_size: int) -> float:
    """Model FLOPs of one optimizer step over ``global_batch_size`` samples (forward + backward,
    plus one forward more under full recompute)."""
    passes = 3 + (1 if config.recompute_granularity == "full" else 0)
    return passes * global_batch_size * config.seq_length * forward_flops_per_token(config)


def throughput(config, global_batch_size: int, seconds: float, world_size: int,
               peak_tflops: float | None = None) -> dict:
    """``{"tflops_per_rank": ..., "mfu": ... (only with a peak)}`` for one iteration."""
    tflops = flops_per_iteration(config, global_batch_size) / (seconds * world_size) / 1e12
    result = {"tflops_per_rank": tflops}
    if peak_tflops:
        result["mfu"] = tflops / peak_tflops
    return result
