"""Model FLOPs of a GPT and the utilisation they give: the one formula the trainer's
``--log-throughput``, the plain-PyTorch peer (``benchmarks/plain_gpt_peer.py``) and the GPU session
count MFU with.

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
of one device (the dense peak in the training precision; ``H200_BF16_DENSE_TFLOPS`` is the
datasheet's for an H200 / H100 SXM in bf16).
"""
from __future__ import annotations

from .moe_config import moe_layer_pattern

H200_BF16_DENSE_TFLOPS = 989.4      # datasheet dense bf16 peak of one H100 / H200 SXM


def dense_gpt_forward_flops_per_token(*, hidden_size: int, num_layers: int, seq_length: int,
                                      ffn_hidden_size: int, kv_width: int, vocab_size: int,
                                      swiglu: bool) -> float:
    """Forward FLOPs of one token of a dense GPT given its dimensions (``kv_width`` = g · d, the
    width of K and of V; ``vocab_size`` the padded vocabulary the output layer multiplies by)."""
    h = hidden_size
    attention = 2 * h * (h + 2 * kv_width) + 2 * 2 * seq_length * h + 2 * h * h
    mlp = 2 * h * ffn_hidden_size * (3 if swiglu else 2)
    return num_layers * (attention + mlp) + 2 * h * vocab_size


def forward_flops_per_token(config) -> float:
    """Model FLOPs of one token's forward pass of a TransformerConfig's GPT (dense or MoE)."""
    h, layers = config.hidden_size, config.num_layers
    swiglu = config.activation == "swiglu"
    moe_layers = sum(moe_layer_pattern(config))
    dense = dense_gpt_forward_flops_per_token(
        hidden_size=h, num_layers=layers - moe_layers, seq_length=config.seq_length,
        ffn_hidden_size=config.ffn_hidden_size,
        kv_width=config.num_query_groups * config.kv_channels,
        vocab_size=config.padded_vocab_size, swiglu=swiglu)
    if not moe_layers:
        return dense
    attention_only = dense_gpt_forward_flops_per_token(
        hidden_size=h, num_layers=moe_layers, seq_length=config.seq_length, ffn_hidden_size=0,
        kv_width=config.num_query_groups * config.kv_channels, vocab_size=0, swiglu=swiglu)
    hidden = (config.moe_router_topk * config.moe_ffn_hidden_size
              + (config.moe_shared_expert_intermediate_size or 0))
    moe_mlp = 2 * h * config.num_moe_experts + 2 * h * hidden * (3 if swiglu else 2)
    return dense + attention_only + moe_layers * moe_mlp


def flops_per_iteration(config, global_batch_size: int) -> float:
    """Model FLOPs of one optimizer step over ``global_batch_size`` samples (forward + backward,
    plus one forward more under full recompute)."""
    passes = 3 + (1 if config.recompute_granularity == "full" else 0)
    return passes * global_batch_size * config.seq_length * forward_flops_per_token(config)


def utilisation(flops: float, seconds: float, world_size: int = 1,
                peak_tflops: float | None = None) -> dict:
    """``{"tflops_per_rank": ..., "mfu": ... (only with a peak)}`` of ``flops`` done in
    ``seconds`` by ``world_size`` devices."""
    tflops = flops / (seconds * world_size) / 1e12
    result = {"tflops_per_rank": tflops}
    if peak_tflops:
        result["mfu"] = tflops / peak_tflops
    return result
