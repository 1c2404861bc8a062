"""What a multi-latent-attention layer (``tp_layers/mla.py``) saves for backward, for tpfuse-plan.

Per micro-batch on one rank, with ``activations.py``'s s, b, t, t', e, and n_l = heads/t heads,
d_q = qk_head_dim + qk_pos_emb_head_dim, d_v = v_head_dim, D = max(d_q, d_v) (the padded core
attention head dim), r / r_q the kv / q latent ranks, d_pe the rope dim, rows = s·b/t'::

    norm output (x)           rows · h · e        "qkv input": the q and kv down projections'
                                                   input (one storage)
    q latent (q_lora_rank)    rows · r_q · e      q_up's input; with --qk-layernorm also the
                                                   q norm's input (LayerNorm 16-bit: fp32) and
                                                   its statistics
    kv latent                 rows · (r + d_pe) · e    the down projection's output, which
                                                   kv_up (no norm) or the kv RMSNorm reads through
                                                   a view (LayerNorm 16-bit: an fp32 copy of the r
                                                   columns), + its statistics; with the norm also
                                                   kv_up's input rows · r · e
    16-bit LayerNorm latent norms  2 · (r + r_q) · 4   their fp32 weight and bias
    q, k (rope applied)       2 · b·n_l·s·D · e
    v                         s·b·n_l·(d_n + d_v) · e when d_v = D (a view of kv_up's output),
                              else the padded b·n_l·s·D · e
    attention out, lse        b·n_l·s·D · e,  b·n_l·s · 4
    linear_proj input         s·b·n_l·d_v · e

The rope itself keeps only the (cos, sin) tables, shared by the chunk's layers: 2·b·s·d_pe · 4
(under full recompute the layers' checkpoints hold them by reference, not as saved tensors).
Selective recompute: ``core_attn`` keeps q, k (unpadded, d_q) and kv_up's output instead of q,
k, v, out and lse; ``mla_up_proj`` keeps only the up projections' inputs (counted above) and the
rope key: a view of the kv latent (already counted unless a 16-bit LayerNorm copied it) or,
under sequence parallelism, its all-gathered (s, b, d_pe) copy. Measured exact against the saved
tensors (tests/training/test_plan_mla.py).
"""
from __future__ import annotations


def mla_attention_bytes(config, s, b, t, t_sp, e, recompute_modules) -> float:
    """The attention block's saved bytes past the norm output (the table above)."""
    heads = config.num_attention_heads // t
    rope, r, rq = config.qk_pos_emb_head_dim, config.kv_lora_rank, config.q_lora_rank
    dq, dv = config.qk_head_dim + rope, config.v_head_dim
    width = max(dq, dv)
    rows = s * b / t_sp
    layer_norm = config.normalization == "LayerNorm"
    stats = (2 if layer_norm else 1) * rows * 4
    fp32_copy = layer_norm and e != 4            # a 16-bit LayerNorm normalises an fp32 copy
    total = 0.0
    if config.qk_layernorm and fp32_copy:      # the latent norms' fp32 weight and bias
        total += 2 * (r + (rq or 0)) * 4
    if rq is not None:
        total += rows * rq * e                                        # q_up input
        if config.qk_layernorm:
            total += rows * rq * (4 if fp32_copy else e) + stats      # q norm input, stats
    latent = rows * (r + rope) * e                                    # the down projection
    latent_kept = not (config.qk_layernorm and fp32_copy)
    if config.qk_layernorm:
        total += (latent if latent_kept else rows * r * 4) + stats + rows * r * e
    else:
        total += latent
    expanded = s * b * heads * (config.qk_head_dim + dv) * e          # kv_up output
    if "mla_up_proj" in recompute_modules:
        if t_sp > 1:
            return total + s * b * rope * e + s * b * heads * dv * e  # gathered rope key
        return total + (0.0 if latent_kept else latent) + s * b * heads * dv * e
    if "core_attn" in recompute_modules:
        total += 2 * b * heads * s * dq * e + expanded
    else:
        padded = b * heads * s * width * e
        total += 3 * padded + (expanded if dv == width else padded) + b * heads * s * 4
    return total + s * b * heads * dv * e                             # linear_proj input


def mla_rope_table_bytes(config, micro_batch_size: int) -> float:
    """The chunk's (cos, sin) tables of the rope part (fp32, per sample)."""
    s = config.seq_length // config.context_parallel_size
    return 2 * micro_batch_size * s * config.qk_pos_emb_head_dim * 4
