"""Qwen3 (``Qwen3ForCausalLM``) ↔ tpfuse GPTModel: Llama's layout (``llama.py``) with a q / k norm
and an explicit head dim.

    HF   self_attn.q_norm.weight (d,)   → self_attention.q_layernorm.weight (d,)
         self_attn.k_norm.weight (d,)   → self_attention.k_layernorm.weight (d,)
         head_dim d                     → kv_channels (may differ from hidden / heads;
                                          Qwen3Config's 128 when config.json has none)

Order and constants (both sides): q = q_proj(x) viewed as heads of d, then RMSNorm over d with
``rms_norm_eps`` and one weight shared by the heads (HF's ``q_norm``; tpfuse's ``qk_layernorm``
with ``normalization = RMSNorm`` and ``layernorm_epsilon`` = the same ``rms_norm_eps`` as every
other norm), then rotary; k the same with ``k_norm`` (per KV head under GQA); v untouched. The
attention scale is d^(-1/2) on both sides.

No biases (``attention_bias`` puts biases on q / k / v and o but not on the MLP, which tpfuse's
one ``add_bias_linear`` cannot express: refused by name). Refused as well: a sliding window
(``use_sliding_window`` / sliding ``layer_types``: applied from ``max_window_layers`` on, per
layer), a rotary scaling other than Llama 3's (``rope_scaling``), another ``hidden_act``.
"""
from __future__ import annotations

from tpfuse.parallel.checks import is_int

from . import llama
from .common import TensorSet

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
# Qwen3Config's values for keys a config.json may leave out, where they differ from Llama's
DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32}


def check_window(hf: dict, family: str) -> None:
    kinds = set(hf.get("layer_types") or [])
    if hf.get("use_sliding_window") or kinds - {"full_attention"}:
        raise ValueError(f"{family} use_sliding_window=true (or sliding layer_types) is not "
                         "supported (a window from max_window_layers on; tpfuse's window_size "
                         "applies to every layer)")


def attention_values(hf: dict, family: str, defaults: dict) -> dict:
    """TransformerConfig values of a Qwen3 / Qwen3-MoE config.json shared by both: Llama's with
    the q / k norm and the head dim (``head_dim``, else hidden / heads), the keys it leaves out
    taken from ``defaults`` (the transformers config class's); ValueError naming a field tpfuse
    cannot express."""
    hf = {**defaults, **hf}
    check_window(hf, family)
    if hf.get("attention_bias", False):
        raise ValueError(f"{family} attention_bias=true is not supported (biases on q / k / v / o "
                         "but not on the MLP; tpfuse's add_bias_linear covers every linear)")
    head_dim = hf.get("head_dim")
    if "head_dim" in hf and not (is_int(head_dim) and head_dim > 0):
        raise ValueError(f"{family} head_dim={head_dim!r} is not supported (needs a positive int)")
    values = llama.config_from_hf(dict(hf, head_dim=None, attention_bias=False, mlp_bias=False))
    if head_dim is not None:
        values["kv_channels"] = head_dim
    return dict(values, qk_layernorm=True)


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a Qwen3 config.json (ValueError for what tpfuse lacks)."""
    return attention_values(hf, "Qwen3", DEFAULTS)


def attention_mismatches(config) -> list[str]:
    """Llama's checks with the q / k norm required and no linear biases at all."""
    c = config
    problems = [p for p in llama.mismatches(c) if not p.startswith("qk_layernorm")]
    if not c.qk_layernorm:
        problems.append("qk_layernorm=False (needs True: q / k norms)")
    if c.add_bias_linear:
        problems.append("add_bias_linear=True (needs False)")
    return problems


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Qwen3 (empty when it is)."""
    return attention_mismatches(config)


def attention_to_hf(config, eos_id: int | None) -> dict:
    """config.json entries Qwen3 and Qwen3-MoE share (Llama's, no biases, no window)."""
    hf = llama.config_to_hf(config, eos_id)
    hf.pop("mlp_bias")
    hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
              max_window_layers=config.num_layers,
              layer_types=["full_attention"] * config.num_layers)
    return hf


def config_to_hf(config, eos_id: int | None) -> dict:
    hf = attention_to_hf(config, eos_id)
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE)
    return hf


def qk_norm_tensors(c) -> list[tuple]:
    """(tpfuse suffix, HF suffix, shape) of the q / k norm weights."""
    d = (c.kv_channels,)
    return [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", d),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", d)]


def attention_tensors(c) -> list[tuple]:
    """(tpfuse suffix, HF suffix, shape) of a layer's tensors other than QKV and the MLP."""
    return llama.attention_tensors(c) + qk_norm_tensors(c)


def attention_from_hf(source, c, ours: str, theirs: str, out: dict) -> None:
    for suffix, hf_suffix, shape in attention_tensors(c):
        out[ours + suffix] = source.take(theirs + hf_suffix, shape)
    for fused, kind, parts in llama.qkv_parts(c, qkv_bias=False):
        out[ours + fused] = llama.take_fused(source, c, theirs, parts, kind)


def attention_to_hf_tensors(full: dict, c, ours: str, theirs: str, out: dict) -> None:
    for suffix, hf_suffix, _ in attention_tensors(c):
        out[theirs + hf_suffix] = full[ours + suffix]
    for fused, _, parts in llama.qkv_parts(c, qkv_bias=False):
        llama.put_fused(out, full[ours + fused], c, theirs, parts)


def _mlp(c):
    """(tpfuse fused fc1, kind, [(HF part, rows)]) and the fc2 pair of the dense SwiGLU MLP."""
    f = c.ffn_hidden_size
    return (("mlp.linear_fc1.weight", "weight",
             [("mlp.gate_proj.weight", f), ("mlp.up_proj.weight", f)]),
            ("mlp.linear_fc2.weight", "mlp.down_proj.weight", (c.hidden_size, f)))


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor (vocabulary unpadded) from Qwen3's tensors."""
    source = TensorSet(tensors, where, llama.IGNORED)
    c, p = config, llama.PREFIX
    out = llama.take_common(source, c)
    (fc1, kind, parts), (fc2, down, shape) = _mlp(c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        attention_from_hf(source, c, ours, theirs, out)
        out[ours + fc1] = llama.take_fused(source, c, theirs, parts, kind)
        out[ours + fc2] = source.take(theirs + down, shape)
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """Qwen3's tensor names from tpfuse's single-process ones."""
    c, p = config, llama.PREFIX
    out = {}
    (fc1, _, parts), (fc2, down, _) = _mlp(c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        attention_to_hf_tensors(full, c, ours, theirs, out)
        llama.put_fused(out, full[ours + fc1], c, theirs, parts)
        out[theirs + down] = full[ours + fc2]
    return llama.common_to_hf(full, c, out)
