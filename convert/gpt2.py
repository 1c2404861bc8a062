"""GPT-2 (``GPT2LMHeadModel``) ↔ tpfuse GPTModel.

GPT-2 is tpfuse's default shape: pre-LayerNorm blocks, learned positions, biases everywhere, the
output layer tied to the word embedding (untied when ``tie_word_embeddings`` is false), GeLU in
its tanh approximation (``gelu_new``; ``activation="gelu_tanh"``, Megatron's ``--openai-gelu``).
Its linear layers are ``Conv1D``: weight ``(in, out)``, y = x·W + b, so every weight is
transposed to tpfuse's ``(out, in)``; ``c_attn`` holds ``[q; k; v]`` along its output columns,
re-laid into the grouped fused QKV (one group per head). Attention scores are scaled by 1/√d in
both. Checkpoints saved without the ``transformer.`` prefix (the original release) are read too;
the causal-mask buffers some of them carry (``attn.bias``, ``attn.masked_bias``) are skipped.
"""
from __future__ import annotations

import torch

from .common import TensorSet, fuse_qkv, split_qkv, take_output_layer

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_fast": "gelu_tanh", "gelu": "gelu"}
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
IGNORED = (".attn.bias", ".attn.masked_bias")
PREFIX = "transformer."


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"GPT-2 config.json lacks {key!r}")
    return hf[key]


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a GPT-2 config.json (ValueError for what tpfuse lacks)."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATION_FROM_HF:
        raise ValueError(f"GPT-2 activation_function={activation!r} is not supported (one of "
                         f"{sorted(ACTIVATION_FROM_HF)})")
    for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False)):
        if hf.get(key, supported) != supported:
            raise ValueError(f"GPT-2 {key}={hf[key]} is not supported (tpfuse: {supported})")
    hidden, positions = _require(hf, "n_embd"), _require(hf, "n_positions")
    return dict(
        num_layers=_require(hf, "n_layer"), hidden_size=hidden,
        num_attention_heads=_require(hf, "n_head"), ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        vocab_size=_require(hf, "vocab_size"), seq_length=positions,
        max_position_embeddings=positions, normalization="LayerNorm",
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        activation=ACTIVATION_FROM_HF[activation], position_embedding_type="learned_absolute",
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
        init_method_std=hf.get("initializer_range", 0.02))


def mismatches(config) -> list[str]:
    """Why ``config`` is not a GPT-2 (empty when it is)."""
    wanted = [("normalization", config.normalization == "LayerNorm", "LayerNorm"),
              ("activation", config.activation in ACTIVATION_TO_HF, "gelu or gelu_tanh"),
              ("position_embedding_type", config.position_embedding_type == "learned_absolute",
               "learned_absolute"),
              ("add_bias_linear", config.add_bias_linear, "True"),
              ("num_query_groups", config.num_query_groups == config.num_attention_heads,
               "= num_attention_heads"),
              ("num_moe_experts", config.num_moe_experts is None, "None: a dense MLP"),
              ("qk_layernorm", not config.qk_layernorm, "False: no q / k norms")]
    return [f"{name}={getattr(config, name)} (needs {need})" for name, ok, need in wanted if not ok]


def config_to_hf(config, eos_id: int | None) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
        "activation_function": ACTIVATION_TO_HF[config.activation],
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "use_cache": True,
    }


def _layer_names() -> list[tuple]:
    """(tpfuse suffix, HF suffix, HF Conv1D weight?) per tensor of block i (not attention QKV)."""
    return [("input_norm.weight", "ln_1.weight", False), ("input_norm.bias", "ln_1.bias", False),
            ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
            ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
            ("pre_mlp_norm.weight", "ln_2.weight", False),
            ("pre_mlp_norm.bias", "ln_2.bias", False),
            ("mlp.linear_fc1.weight", "mlp.c_fc.weight", True),
            ("mlp.linear_fc1.bias", "mlp.c_fc.bias", False),
            ("mlp.linear_fc2.weight", "mlp.c_proj.weight", True),
            ("mlp.linear_fc2.bias", "mlp.c_proj.bias", False)]


def _shapes(c) -> dict:
    """tpfuse shape of each per-layer tensor (HF Conv1D weights are the transpose)."""
    h, f = c.hidden_size, c.ffn_hidden_size
    return {"input_norm.weight": (h,), "input_norm.bias": (h,), "pre_mlp_norm.weight": (h,),
            "pre_mlp_norm.bias": (h,), "self_attention.linear_proj.weight": (h, h),
            "self_attention.linear_proj.bias": (h,), "mlp.linear_fc1.weight": (f, h),
            "mlp.linear_fc1.bias": (f,), "mlp.linear_fc2.weight": (h, f),
            "mlp.linear_fc2.bias": (h,)}


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor (vocabulary unpadded) from GPT-2's tensors."""
    prefix = PREFIX if any(name.startswith(PREFIX) for name in tensors) else ""
    source = TensorSet(tensors, where, IGNORED)
    c, h = config, config.hidden_size

    def take(name, shape):
        return source.take(prefix + name, shape)

    out = {"embedding.word_embeddings.weight": take("wte.weight", (c.vocab_size, h)),
           "embedding.position_embeddings.weight": take("wpe.weight",
                                                        (c.max_position_embeddings, h))}
    shapes = _shapes(c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"h.{i}."
        qkv_w = take(theirs + "attn.c_attn.weight", (h, 3 * h)).t()          # (3h, h): q; k; v
        qkv_b = take(theirs + "attn.c_attn.bias", (3 * h,))
        heads = c.num_attention_heads
        out[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv_w.split(h), heads)
        out[ours + "self_attention.linear_qkv.bias"] = fuse_qkv(*qkv_b.split(h), heads)
        for suffix, hf_suffix, conv1d in _layer_names():
            shape = shapes[suffix]
            tensor = take(theirs + hf_suffix, shape[::-1] if conv1d else shape)
            out[ours + suffix] = tensor.t().contiguous() if conv1d else tensor
    out["final_norm.weight"] = take("ln_f.weight", (h,))
    out["final_norm.bias"] = take("ln_f.bias", (h,))
    take_output_layer(source, out, c, prefix + "wte.weight")
    source.finish()
    return out


def tensors_to_hf(full: dict, config) -> dict:
    """GPT-2's tensor names (with the ``transformer.`` prefix) from tpfuse's single-process ones."""
    c, p = config, PREFIX
    out = {p + "wte.weight": full["embedding.word_embeddings.weight"],
           p + "wpe.weight": full["embedding.position_embeddings.weight"]}
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}h.{i}."
        heads = (c.num_attention_heads, c.num_query_groups, c.kv_channels)
        qkv_w = split_qkv(full[ours + "self_attention.linear_qkv.weight"], *heads)
        out[theirs + "attn.c_attn.weight"] = torch.cat(qkv_w).t().contiguous()   # (h, 3h)
        qkv_b = split_qkv(full[ours + "self_attention.linear_qkv.bias"], *heads)
        out[theirs + "attn.c_attn.bias"] = torch.cat(qkv_b)
        for suffix, hf_suffix, conv1d in _layer_names():
            tensor = full[ours + suffix]
            out[theirs + hf_suffix] = tensor.t().contiguous() if conv1d else tensor
    out[p + "ln_f.weight"] = full["final_norm.weight"]
    out[p + "ln_f.bias"] = full["final_norm.bias"]
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = full["output_layer.weight"]
    return out
