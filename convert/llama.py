"""Llama (``LlamaForCausalLM``) ↔ tpfuse GPTModel.

Llama: pre-RMSNorm blocks, SwiGLU MLP ``down(silu(gate(x)) · up(x))`` (tpfuse fc1 master
``[gate; up]``, fc2 = down), rotary positions, grouped-query attention (``num_key_value_heads``;
query head i reads KV head i // (nh/ng) in both), no biases (``attention_bias`` / ``mlp_bias``
together map to ``add_bias_linear``), an untied output layer (``lm_head``) unless
``tie_word_embeddings``.

Rotary layout: HuggingFace's Llama rotates the halves of each head (``rotate_half``: pairs
(x_i, x_{i+d/2})), its q/k weights already permuted from Meta's interleaved-pair release at
conversion time; tpfuse's rope is the same rotate-half form (tp_layers/rope.py, Megatron's
non-interleaved default) with the same frequencies ``θ^(−2i/d)``. So q_proj / k_proj rows go
into the fused QKV unpermuted — the logits test against ``transformers`` checks exactly this.
Rotary scaling: Llama 3.x's (``rope_type: llama3`` with Llama 3's constants: original context
8192, low / high frequency factors 1 / 4) maps to ``use_rope_scaling`` + ``rope_scaling_factor``
(Megatron's flags); other kinds (linear, dynamic, yarn ...) and a head_dim other than
hidden/heads are not supported and say so.
"""
from __future__ import annotations

import torch

from .common import TensorSet, fuse_qkv, split_qkv, take_output_layer

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
IGNORED = (".rotary_emb.inv_freq",)
PREFIX = "model."


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"Llama config.json lacks {key!r}")
    return hf[key]


LLAMA3_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}


def rope_theta(hf: dict) -> float:
    """The rotary base (older ``rope_theta`` or newer ``rope_parameters``)."""
    parameters = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    return int(theta) if float(theta).is_integer() else float(theta)


def rope_scaling(hf: dict) -> dict:
    """``use_rope_scaling`` / ``rope_scaling_factor`` for the config's rotary scaling: none, or
    Llama 3's (rope_type 'llama3' with its constants); ValueError naming anything else."""
    parameters = dict(hf.get("rope_scaling") or {}, **(hf.get("rope_parameters") or {}))
    kind = parameters.get("rope_type") or parameters.get("type")
    if kind in (None, "default"):
        return {}
    if kind != "llama3":
        raise ValueError(f"rotary scaling rope_type={kind!r} is not supported (tpfuse has "
                         "'llama3' scaling only)")
    for key, value in LLAMA3_CONSTANTS.items():
        if float(parameters.get(key, value)) != value:
            raise ValueError(f"llama3 rotary scaling with {key}={parameters[key]} is not "
                             f"supported (tpfuse uses Llama 3's {key}={value})")
    return {"use_rope_scaling": True, "rope_scaling_factor": float(parameters["factor"])}


def rope_to_hf(config) -> dict:
    """config.json's rotary entries (both the older and the newer key)."""
    theta = config.rotary_base
    if not config.use_rope_scaling:
        return {"rope_theta": theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    scaling = dict(LLAMA3_CONSTANTS, rope_type="llama3", factor=config.rope_scaling_factor)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_parameters": dict(scaling, rope_theta=theta)}


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a Llama config.json (ValueError for what tpfuse lacks)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama hidden_act={hf['hidden_act']!r} is not supported (silu: SwiGLU)")
    hidden, heads = _require(hf, "hidden_size"), _require(hf, "num_attention_heads")
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"Llama head_dim={hf['head_dim']} != hidden_size / num_attention_heads "
                         f"= {hidden // heads} is not supported")
    bias = hf.get("attention_bias", False)
    if hf.get("mlp_bias", False) != bias:
        raise ValueError(f"Llama attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} is not "
                         "supported (tpfuse's add_bias_linear covers both)")
    positions = _require(hf, "max_position_embeddings")
    return dict(
        num_layers=_require(hf, "num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=_require(hf, "intermediate_size"), vocab_size=_require(hf, "vocab_size"),
        seq_length=positions, max_position_embeddings=positions, normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
        position_embedding_type="rope", rotary_base=rope_theta(hf), **rope_scaling(hf),
        add_bias_linear=bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02))


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Llama (empty when it is)."""
    wanted = [("normalization", config.normalization == "RMSNorm", "RMSNorm"),
              ("activation", config.activation == "swiglu", "swiglu"),
              ("position_embedding_type", config.position_embedding_type == "rope", "rope"),
              ("num_moe_experts", config.num_moe_experts is None, "None: a dense MLP"),
              ("window_size", config.window_size is None, "None"),
              ("add_qkv_bias", not config.add_qkv_bias or config.add_bias_linear,
               "False without add_bias_linear"),
              ("qk_layernorm", not config.qk_layernorm, "False: no q / k norms")]
    return [f"{name}={getattr(config, name)} (needs {need})" for name, ok, need in wanted if not ok]


def config_to_hf(config, eos_id: int | None) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, **rope_to_hf(config),
        "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std, "bos_token_id": eos_id,
        "eos_token_id": eos_id, "use_cache": True,
    }


def attention_tensors(c) -> list[tuple]:
    """(tpfuse suffix, HF suffix, shape) of the attention block's tensors taken as they are."""
    h = c.hidden_size
    names = [("input_norm.weight", "input_layernorm.weight", (h,)),
             ("pre_mlp_norm.weight", "post_attention_layernorm.weight", (h,)),
             ("self_attention.linear_proj.weight", "self_attn.o_proj.weight",
              (h, c.num_attention_heads * c.kv_channels))]
    if c.add_bias_linear:
        names.append(("self_attention.linear_proj.bias", "self_attn.o_proj.bias", (h,)))
    return names


def _per_layer(c) -> list[tuple]:
    """(tpfuse suffix, HF suffix, shape) of the tensors taken as they are."""
    h, f = c.hidden_size, c.ffn_hidden_size
    names = attention_tensors(c) + [("mlp.linear_fc2.weight", "mlp.down_proj.weight", (h, f))]
    if c.add_bias_linear:
        names.append(("mlp.linear_fc2.bias", "mlp.down_proj.bias", (h,)))
    return names


def qkv_parts(c, qkv_bias: bool | None = None):
    """(tpfuse fused name, kind, [(HF part suffix, rows)]) of the fused QKV (weight, bias)."""
    d, heads, groups = c.kv_channels, c.num_attention_heads, c.num_query_groups
    bias = c.add_bias_linear if qkv_bias is None else qkv_bias
    for kind in ["weight"] + (["bias"] if bias else []):
        yield (f"self_attention.linear_qkv.{kind}", kind,
               [(f"self_attn.q_proj.{kind}", heads * d), (f"self_attn.k_proj.{kind}", groups * d),
                (f"self_attn.v_proj.{kind}", groups * d)])


def _fused_parts(c):
    """(tpfuse fused name, kind, [(HF part suffix, rows)]) for QKV and [gate; up]."""
    yield from qkv_parts(c)
    for kind in ["weight"] + (["bias"] if c.add_bias_linear else []):
        yield (f"mlp.linear_fc1.{kind}", kind,
               [(f"mlp.gate_proj.{kind}", c.ffn_hidden_size),
                (f"mlp.up_proj.{kind}", c.ffn_hidden_size)])


def take_fused(source, c, theirs: str, parts, kind: str) -> torch.Tensor:
    """The HF parts of one fused tensor taken and fused (QKV grouped; [gate; up] stacked)."""
    h = c.hidden_size
    pieces = [source.take(theirs + name, (rows, h) if kind == "weight" else (rows,))
              for name, rows in parts]
    return fuse_qkv(*pieces, c.num_query_groups) if len(parts) == 3 else torch.cat(pieces)


def put_fused(out: dict, fused_tensor, c, theirs: str, parts) -> None:
    """The inverse of ``take_fused``: the HF parts of one fused tensor into ``out``."""
    if len(parts) == 3:
        pieces = split_qkv(fused_tensor, c.num_attention_heads, c.num_query_groups, c.kv_channels)
    else:
        pieces = [t.contiguous() for t in fused_tensor.chunk(2)]
    for (name, _), piece in zip(parts, pieces):
        out[theirs + name] = piece


def take_common(source, c, p: str = PREFIX) -> dict:
    """The embedding (the layers follow; ``finish_common`` adds the rest)."""
    return {"embedding.word_embeddings.weight": source.take(p + "embed_tokens.weight",
                                                            (c.vocab_size, c.hidden_size))}


def finish_common(source, out: dict, c, p: str = PREFIX) -> dict:
    out["final_norm.weight"] = source.take(p + "norm.weight", (c.hidden_size,))
    take_output_layer(source, out, c, p + "embed_tokens.weight")
    source.finish()
    return out


def common_to_hf(full: dict, c, out: dict, p: str = PREFIX) -> dict:
    out[p + "embed_tokens.weight"] = full["embedding.word_embeddings.weight"]
    out[p + "norm.weight"] = full["final_norm.weight"]
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = full["output_layer.weight"]
    return out


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor (vocabulary unpadded) from Llama's tensors."""
    source = TensorSet(tensors, where, IGNORED)
    c, p = config, PREFIX
    out = take_common(source, c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, shape in _per_layer(c):
            out[ours + suffix] = source.take(theirs + hf_suffix, shape)
        for fused, kind, parts in _fused_parts(c):
            out[ours + fused] = take_fused(source, c, theirs, parts, kind)
    return finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """Llama's tensor names from tpfuse's single-process ones."""
    c, p = config, PREFIX
    out = {}
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, _ in _per_layer(c):
            out[theirs + hf_suffix] = full[ours + suffix]
        for fused, _, parts in _fused_parts(c):
            put_fused(out, full[ours + fused], c, theirs, parts)
    return common_to_hf(full, c, out)
