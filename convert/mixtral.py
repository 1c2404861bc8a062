"""Mixtral (``MixtralForCausalLM``) ↔ tpfuse GPTModel with an MoE layer in every block.

The attention block is Llama's (``llama.py``: pre-RMSNorm, rotary, grouped-query attention, no
biases); an optional ``sliding_window`` S maps to ``window_size = (S − 1, 0)`` (HF's window holds
the query itself and the S − 1 keys before it). The MLP is a sparse MoE block:

    HF   block_sparse_moe.gate.weight (E, h)              → mlp.router.weight (E, h)
         block_sparse_moe.experts.e.w1 (F, h) [gate]      ┐
         block_sparse_moe.experts.e.w3 (F, h) [up]        ┘→ mlp.experts.weight1[e] = [w1; w3]ᵀ (h, 2F)
         block_sparse_moe.experts.e.w2 (h, F) [down]      → mlp.experts.weight2[e] = w2ᵀ (F, h)

Routing: HF takes softmax over the E logits, the top-k, and renormalises the k weights to sum 1;
tpfuse's default router (``moe_router_pre_softmax = False``, score softmax) takes the top-k logits
and a softmax over those k — the same probabilities (softmax restricted to a subset, renormalised).
Dropless (no capacity), no shared expert, no top-k scaling. A tpfuse MoE model that differs
(capacity, grouped routing, sigmoid scores, pre-softmax, shared experts, biases, some dense layers)
has no Mixtral counterpart and ``mismatches`` names the setting.
"""
from __future__ import annotations

import torch

from . import llama
from .common import TensorSet, plain_topk_router_needs, unmet

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
PREFIX = llama.PREFIX
MOE = "block_sparse_moe."


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a Mixtral config.json (ValueError for what tpfuse lacks)."""
    for key in ("num_local_experts", "num_experts_per_tok"):
        if not hf.get(key):
            raise ValueError(f"Mixtral config.json lacks {key!r}")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"Mixtral router_jitter_noise={hf['router_jitter_noise']} is not "
                         "supported (tpfuse's router has no input jitter)")
    values = llama.config_from_hf(dict(hf, attention_bias=False, mlp_bias=False))
    window = hf.get("sliding_window")
    values.update(num_moe_experts=hf["num_local_experts"],
                  moe_router_topk=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False,
                  moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0),
                  window_size=None if window is None else (int(window) - 1, 0))
    return values


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Mixtral (empty when it is)."""
    c = config
    if c.num_moe_experts is None:
        return ["num_moe_experts=None (needs experts)"]
    dense_checks = [p for p in llama.mismatches(c) if not p.startswith(("num_moe_experts", "window_size"))]
    wanted = [("moe_layer_freq", c.moe_layer_freq == 1 or all(c.moe_layer_freq), "1"),
              ("moe_shared_expert_intermediate_size",
               c.moe_shared_expert_intermediate_size is None, "None"),
              ("moe_router_pre_softmax", not c.moe_router_pre_softmax, "False")]
    return dense_checks + unmet(c, wanted + plain_topk_router_needs(c))


def config_to_hf(config, eos_id: int | None) -> dict:
    c = config
    hf = llama.config_to_hf(c, eos_id)
    for key in ("attention_bias", "mlp_bias"):
        hf.pop(key)
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
              intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_moe_experts,
              num_experts_per_tok=c.moe_router_topk, router_aux_loss_coef=c.moe_aux_loss_coeff,
              router_jitter_noise=0.0, output_router_logits=False,
              sliding_window=None if c.window_size is None else c.window_size[0] + 1)
    return hf


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor from Mixtral's tensors."""
    source = TensorSet(tensors, where, llama.IGNORED)
    c, p, h, f = config, PREFIX, config.hidden_size, config.moe_ffn_hidden_size
    out = llama.take_common(source, c)
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, shape in llama.attention_tensors(c):
            out[ours + suffix] = source.take(theirs + hf_suffix, shape)
        for fused, kind, parts in llama.qkv_parts(c):
            out[ours + fused] = llama.take_fused(source, c, theirs, parts, kind)
        moe = theirs + MOE
        out[ours + "mlp.router.weight"] = source.take(moe + "gate.weight", (c.num_moe_experts, h))
        fc1, fc2 = [], []
        for e in range(c.num_moe_experts):
            expert = f"{moe}experts.{e}."
            gate, up = (source.take(expert + w, (f, h)) for w in ("w1.weight", "w3.weight"))
            fc1.append(torch.cat([gate, up]).t())                                # (h, 2F)
            fc2.append(source.take(expert + "w2.weight", (h, f)).t())           # (F, h)
        out[ours + "mlp.experts.weight1"] = torch.stack(fc1).contiguous()
        out[ours + "mlp.experts.weight2"] = torch.stack(fc2).contiguous()
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """Mixtral's tensor names from tpfuse's single-process ones."""
    c, p = config, PREFIX
    out = {}
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"{p}layers.{i}."
        for suffix, hf_suffix, _ in llama.attention_tensors(c):
            out[theirs + hf_suffix] = full[ours + suffix]
        for fused, _, parts in llama.qkv_parts(c):
            llama.put_fused(out, full[ours + fused], c, theirs, parts)
        moe = theirs + MOE
        out[moe + "gate.weight"] = full[ours + "mlp.router.weight"]
        for e in range(c.num_moe_experts):
            expert = f"{moe}experts.{e}."
            gate, up = full[ours + "mlp.experts.weight1"][e].t().chunk(2)       # (F, h) each
            out[expert + "w1.weight"] = gate.contiguous()
            out[expert + "w3.weight"] = up.contiguous()
            out[expert + "w2.weight"] = full[ours + "mlp.experts.weight2"][e].t().contiguous()
    return llama.common_to_hf(full, c, out)
