"""Qwen2 (``Qwen2ForCausalLM``) ↔ tpfuse GPTModel: Llama's layout (``llama.py``) with biases on
the q / k / v projections only (``add_qkv_bias = True``, ``add_bias_linear = False``); the q, k, v
biases fuse into ``linear_qkv.bias`` in the same grouped order as the weights' rows.

Qwen2's optional sliding window (``use_sliding_window``, applied from layer
``max_window_layers`` on) is per layer, which tpfuse's one ``window_size`` cannot express: a
config with it on is refused by name.
"""
from __future__ import annotations

from . import llama
from .common import TensorSet

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"


def config_from_hf(hf: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise ValueError("Qwen2 use_sliding_window=true is not supported (a window on some "
                         "layers only; tpfuse's window_size applies to every layer)")
    values = llama.config_from_hf(dict(hf, attention_bias=False, mlp_bias=False))
    return dict(values, add_qkv_bias=True)


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Qwen2 (empty when it is)."""
    problems = [p for p in llama.mismatches(config) if not p.startswith("add_qkv_bias")]
    if not config.add_qkv_bias or config.add_bias_linear:
        problems.append(f"add_qkv_bias={config.add_qkv_bias} with add_bias_linear="
                        f"{config.add_bias_linear} (needs a QKV bias only)")
    return problems


def config_to_hf(config, eos_id: int | None) -> dict:
    hf = llama.config_to_hf(config, eos_id)
    for key in ("attention_bias", "mlp_bias"):
        hf.pop(key)
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, use_sliding_window=False,
              sliding_window=None, max_window_layers=config.num_layers)
    return hf


def _mlp_and_qkv(c):
    yield from llama.qkv_parts(c, qkv_bias=True)
    yield ("mlp.linear_fc1.weight", "weight",
           [("mlp.gate_proj.weight", c.ffn_hidden_size), ("mlp.up_proj.weight", c.ffn_hidden_size)])


def _plain(c) -> list[tuple]:
    h = c.hidden_size
    return llama.attention_tensors(c) + [("mlp.linear_fc2.weight", "mlp.down_proj.weight",
                                          (h, c.ffn_hidden_size))]


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    source = TensorSet(tensors, where, llama.IGNORED)
    c, p = config, llama.PREFIX
    out = llama.take_common(source, c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, shape in _plain(c):
            out[ours + suffix] = source.take(theirs + hf_suffix, shape)
        for fused, kind, parts in _mlp_and_qkv(c):
            out[ours + fused] = llama.take_fused(source, c, theirs, parts, kind)
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    c, p = config, llama.PREFIX
    out = {}
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, _ in _plain(c):
            out[theirs + hf_suffix] = full[ours + suffix]
        for fused, _, parts in _mlp_and_qkv(c):
            llama.put_fused(out, full[ours + fused], c, theirs, parts)
    return llama.common_to_hf(full, c, out)
