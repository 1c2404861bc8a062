"""The multi-latent-attention part of TransformerConfig: validation and the layer's rope settings.

Megatron-LM's flags and defaults (``_add_mla_args``): ``--multi-latent-attention``,
``--q-lora-rank`` (None: no q compression), ``--kv-lora-rank`` 32, ``--qk-head-dim`` 128,
``--qk-pos-emb-head-dim`` 64, ``--v-head-dim`` 128, ``--rotary-scaling-factor`` 1.0, ``--mscale``
1.0, ``--mscale-all-dim`` 0.0, ``--rope-type`` (None: yarn for MLA; other attention only takes
rope); MLATransformerConfig's ``original_max_position_embeddings`` 4096, ``beta_fast`` 32,
``beta_slow`` 1. With MLA the q / kv latent norms exist under ``--qk-layernorm`` (Megatron's specs),
and rotary is always applied to the decoupled rope part (whatever ``position_embedding_type``).

What MLA cannot be combined with raises one ValueError naming the flags, at config construction:
grouped-query attention (Megatron: mutually exclusive), ``--add-qkv-bias`` (MLA's projections have
no bias), ``--use-rope-scaling`` (Llama 3's scaling; MLA scales with YaRN).
"""
from __future__ import annotations

import math

from tpfuse.parallel.checks import is_real, require_positive, require_positive_or_none
from tpfuse.tp_layers.mla_rope import ROPE_TYPES, MLARotary

MLA_RECOMPUTE_MODULES = ("mla_up_proj",)


def mla_rope_type(config) -> str:
    """Megatron: ``--rope-type`` None means yarn for MLA."""
    return config.rope_type or "yarn"


def mla_rotary(config) -> MLARotary:
    return MLARotary(
        rope_type=mla_rope_type(config), rotary_base=float(config.rotary_base),
        rotary_scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim)


def validate_mla(config) -> None:
    if config.rope_type is not None and config.rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={config.rope_type!r} must be one of {list(ROPE_TYPES)}")
    if not config.multi_latent_attention:
        if config.rope_type not in (None, "rope"):
            raise ValueError(f"rope_type={config.rope_type!r} (--rope-type) needs "
                             "--multi-latent-attention: other attention only supports 'rope'")
        return
    unsupported = []
    if config.num_query_groups != config.num_attention_heads:
        unsupported.append(f"--num-query-groups {config.num_query_groups} (grouped-query "
                           "attention is mutually exclusive with multi-latent attention)")
    if config.add_qkv_bias:
        unsupported.append("--add-qkv-bias (MLA's q / kv projections have no bias)")
    if config.use_rope_scaling:
        unsupported.append("--use-rope-scaling (MLA scales rope with YaRN: --rope-type yarn "
                           "--rotary-scaling-factor)")
    if unsupported:
        raise ValueError("--multi-latent-attention cannot be combined with: "
                         + "; ".join(unsupported))
    require_positive(config, "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "original_max_position_embeddings")
    require_positive_or_none(config, "q_lora_rank")
    if config.qk_pos_emb_head_dim % 2:
        raise ValueError(f"qk_pos_emb_head_dim={config.qk_pos_emb_head_dim} must be even "
                         "(rope rotates pairs)")
    for name in ("rotary_scaling_factor", "beta_fast", "beta_slow"):
        value = getattr(config, name)
        if not is_real(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive finite number")
    for name in ("mscale", "mscale_all_dim"):
        value = getattr(config, name)
        if not is_real(value) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")


def mla_builder(config, index: int, recompute_modules, state):
    """A ``self_attention_builder`` for global layer ``index`` (None without MLA)."""
    if not config.multi_latent_attention:
        return None
    from tpfuse.tp_layers.mla import MultiLatentAttention

    c = config

    def build():
        return MultiLatentAttention(
            c.hidden_size, c.num_attention_heads, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_head_dim,
            qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
            rotary=mla_rotary(c), add_bias_linear=c.add_bias_linear,
            attention_dropout=c.attention_dropout, sequence_parallel=c.sequence_parallel,
            init_method_std=c.init_method_std,
            output_layer_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
            params_dtype=c.params_dtype,
            recompute_core_attention="core_attn" in recompute_modules,
            recompute_up_proj="mla_up_proj" in recompute_modules, state=state,
            window_size=c.attention_window, cp_comm_type=c.cp_comm_type,
            layer_number=index + 1,
            qk_layernorm=c.qk_layernorm, normalization=c.normalization,
            layernorm_epsilon=c.layernorm_epsilon)
    return build
