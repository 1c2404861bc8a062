"""Qwen2-MoE (``Qwen2MoeForCausalLM``) ↔ tpfuse GPTModel with MoE layers and a gated shared
expert.

Attention is Qwen2's (``qwen2.py``: Llama's layout with biases on q / k / v when ``qkv_bias``).
A sparse layer's MLP:

    HF   mlp.gate.weight (E, h)                         → mlp.router.weight (E, h)
         mlp.experts.e.gate_proj / up_proj (F, h)       → mlp.experts.weight1[e]
                                                          = [gate; up]ᵀ (h, 2F)
         mlp.experts.e.down_proj (h, F)                 → mlp.experts.weight2[e] = downᵀ (F, h)
         mlp.shared_expert.gate_proj / up_proj (F_s, h) → mlp.shared_experts.linear_fc1.weight
                                                          = [gate; up] (2F_s, h)
         mlp.shared_expert.down_proj (h, F_s)           → mlp.shared_experts.linear_fc2.weight
         mlp.shared_expert_gate.weight (1, h)           → mlp.shared_experts.gate_weight (1, h)

    y = Σ_{e ∈ top-k} p_e · expert_e(x) + σ(x w_gᵀ) · shared(x)        (both sides)

Routing: HF takes the softmax over all E logits and its top-k; ``norm_topk_prob = False`` (the
default) keeps those k probabilities as they are — tpfuse's ``moe_router_pre_softmax = True``
(softmax before the top-k, not renormalised); ``norm_topk_prob = True`` renormalises them to sum
1, which is the softmax of the k top logits — tpfuse's default router. Dropless, no top-k scaling.

Which layers are sparse: HF's layer i is an MoE layer when i ∉ ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0, the others a dense SwiGLU MLP of ``intermediate_size``;
tpfuse writes that pattern as ``moe_layer_freq`` (1 when every layer is sparse, else one 0/1 per
layer) and exports any pattern as ``decoder_sparse_step = 1`` + ``mlp_only_layers``. Refused by
name: a sliding window (``use_sliding_window`` / sliding ``layer_types``: per layer in Qwen2, one
window for all layers in tpfuse), no experts, no shared expert, router jitter; on export, a tpfuse
MoE model without a gated shared expert, with biases on the linears, capacity, group-limited or
sigmoid routing or a top-k scaling factor.
"""
from __future__ import annotations

import torch

from tpfuse.parallel.checks import is_int

from . import llama, qwen2
from .common import TensorSet, plain_topk_router_needs, unmet

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"
PREFIX = llama.PREFIX


def positive(hf: dict, key: str, family: str = "Qwen2-MoE") -> int:
    value = hf.get(key)
    if not is_int(value) or value < 1:
        raise ValueError(f"{family} {key}={value!r} is not supported (needs a positive int)")
    return value


def sparse_pattern(hf: dict, num_layers: int, family: str = "Qwen2-MoE") -> list[int]:
    """One 0/1 per layer: 1 where HF builds a sparse MoE block."""
    step = positive(hf, "decoder_sparse_step", family) if "decoder_sparse_step" in hf else 1
    dense = set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def _check_window(hf: dict) -> None:
    kinds = set(hf.get("layer_types") or [])
    if hf.get("use_sliding_window") or kinds - {"full_attention"}:
        raise ValueError("Qwen2-MoE use_sliding_window=true (or sliding layer_types) is not "
                         "supported (a window on some layers only; tpfuse's window_size applies "
                         "to every layer)")


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a Qwen2-MoE config.json (ValueError for what tpfuse lacks)."""
    _check_window(hf)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        positive(hf, key)
    if hf.get("router_jitter_noise"):
        raise ValueError(f"Qwen2-MoE router_jitter_noise={hf['router_jitter_noise']} is not "
                         "supported (tpfuse's router has no input jitter)")
    values = llama.config_from_hf(dict(hf, attention_bias=False, mlp_bias=False))
    pattern = sparse_pattern(hf, values["num_layers"])
    if not any(pattern):
        raise ValueError("Qwen2-MoE config.json has no sparse layer (decoder_sparse_step / "
                         "mlp_only_layers leave every layer dense): convert it as a Qwen2")
    values.update(add_qkv_bias=bool(hf.get("qkv_bias", True)),
                  num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["moe_intermediate_size"],
                  moe_layer_freq=1 if all(pattern) else pattern,
                  moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                  moe_shared_expert_gate=True, moe_router_score_function="softmax",
                  moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                  moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))
    return values


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Qwen2-MoE (empty when it is)."""
    c = config
    if c.num_moe_experts is None:
        return ["num_moe_experts=None (needs experts)"]
    problems = [p for p in llama.mismatches(c)
                if not p.startswith(("num_moe_experts", "add_qkv_bias"))]
    wanted = [("moe_shared_expert_intermediate_size",
               c.moe_shared_expert_intermediate_size is not None, "a shared expert"),
              ("moe_shared_expert_gate", c.moe_shared_expert_gate, "True")]
    return problems + unmet(c, wanted + plain_topk_router_needs(c))


def _pattern(config) -> list[bool]:
    from tpfuse.models.moe_config import moe_layer_pattern

    return list(moe_layer_pattern(config))


def config_to_hf(config, eos_id: int | None) -> dict:
    c = config
    hf = qwen2.config_to_hf(c, eos_id)
    dense = [i for i, sparse in enumerate(_pattern(c)) if not sparse]
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, qkv_bias=c.add_qkv_bias,
              moe_intermediate_size=c.moe_ffn_hidden_size, num_experts=c.num_moe_experts,
              num_experts_per_tok=c.moe_router_topk,
              shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
              norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=dense, router_aux_loss_coef=c.moe_aux_loss_coeff,
              output_router_logits=False)
    return hf


def _mlp_pair(ours: str, theirs: str, rows: int):
    """(tpfuse fused fc1, fc2; HF gate, up, down) names of one SwiGLU MLP with ``rows`` rows."""
    return (ours + "linear_fc1.weight", ours + "linear_fc2.weight",
            theirs + "gate_proj.weight", theirs + "up_proj.weight", theirs + "down_proj.weight",
            rows)


def _dense_mlps(c, ours: str, theirs: str, sparse: bool):
    """The SwiGLU MLPs of layer (prefixes ``ours`` / ``theirs``): the dense MLP, or the shared
    expert of a sparse layer."""
    if sparse:
        return [_mlp_pair(ours + "mlp.shared_experts.", theirs + "mlp.shared_expert.",
                          c.moe_shared_expert_intermediate_size)]
    return [_mlp_pair(ours + "mlp.", theirs + "mlp.", c.ffn_hidden_size)]


def _attention_from_hf(source, c, ours, theirs, out):
    for suffix, hf_suffix, shape in llama.attention_tensors(c):
        out[ours + suffix] = source.take(theirs + hf_suffix, shape)
    for fused, kind, parts in llama.qkv_parts(c, qkv_bias=c.add_qkv_bias):
        out[ours + fused] = llama.take_fused(source, c, theirs, parts, kind)


def _experts_from_hf(source, c, ours, theirs, out):
    take_experts(source, c, ours, theirs, out)
    out[ours + "mlp.shared_experts.gate_weight"] = source.take(
        theirs + "mlp.shared_expert_gate.weight", (1, c.hidden_size))


def take_experts(source, c, ours: str, theirs: str, out: dict) -> None:
    """The router ``mlp.gate`` and the experts ``mlp.experts.e.{gate,up,down}_proj`` of layer
    (prefixes ``ours`` / ``theirs``) into tpfuse's router and stacked expert weights."""
    h, f, moe = c.hidden_size, c.moe_ffn_hidden_size, theirs + "mlp."
    out[ours + "mlp.router.weight"] = source.take(moe + "gate.weight", (c.num_moe_experts, h))
    fc1, fc2 = [], []
    for e in range(c.num_moe_experts):
        expert = f"{moe}experts.{e}."
        gate, up = (source.take(expert + w, (f, h)) for w in ("gate_proj.weight",
                                                               "up_proj.weight"))
        fc1.append(torch.cat([gate, up]).t())                                    # (h, 2F)
        fc2.append(source.take(expert + "down_proj.weight", (h, f)).t())        # (F, h)
    out[ours + "mlp.experts.weight1"] = torch.stack(fc1).contiguous()
    out[ours + "mlp.experts.weight2"] = torch.stack(fc2).contiguous()


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor from Qwen2-MoE's tensors."""
    source = TensorSet(tensors, where, llama.IGNORED)
    c, h = config, config.hidden_size
    out = llama.take_common(source, c)
    for i, sparse in enumerate(_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        _attention_from_hf(source, c, ours, theirs, out)
        if sparse:
            _experts_from_hf(source, c, ours, theirs, out)
        for fc1, fc2, gate, up, down, rows in _dense_mlps(c, ours, theirs, sparse):
            out[fc1] = torch.cat([source.take(gate, (rows, h)), source.take(up, (rows, h))])
            out[fc2] = source.take(down, (h, rows))
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """Qwen2-MoE's tensor names from tpfuse's single-process ones."""
    c = config
    out = {}
    for i, sparse in enumerate(_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        for suffix, hf_suffix, _ in llama.attention_tensors(c):
            out[theirs + hf_suffix] = full[ours + suffix]
        for fused, _, parts in llama.qkv_parts(c, qkv_bias=c.add_qkv_bias):
            llama.put_fused(out, full[ours + fused], c, theirs, parts)
        if sparse:
            put_experts(full, c, ours, theirs, out)
            out[theirs + "mlp.shared_expert_gate.weight"] = (
                full[ours + "mlp.shared_experts.gate_weight"])
        for fc1, fc2, gate, up, down, _ in _dense_mlps(c, ours, theirs, sparse):
            out[gate], out[up] = (t.contiguous() for t in full[fc1].chunk(2))
            out[down] = full[fc2]
    return llama.common_to_hf(full, c, out)


def put_experts(full: dict, c, ours: str, theirs: str, out: dict) -> None:
    """The inverse of ``take_experts``: HF's router and per-expert weights into ``out``."""
    moe = theirs + "mlp."
    out[moe + "gate.weight"] = full[ours + "mlp.router.weight"]
    for e in range(c.num_moe_experts):
        expert = f"{moe}experts.{e}."
        gate, up = full[ours + "mlp.experts.weight1"][e].t().chunk(2)           # (F, h) each
        out[expert + "gate_proj.weight"] = gate.contiguous()
        out[expert + "up_proj.weight"] = up.contiguous()
        out[expert + "down_proj.weight"] = full[ours + "mlp.experts.weight2"][e].t().contiguous()
