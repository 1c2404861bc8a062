"""Qwen3-MoE (``Qwen3MoeForCausalLM``) ↔ tpfuse GPTModel with MoE layers, no shared expert.

Attention is Qwen3's (``qwen3.py``: Llama's layout, no biases, q / k RMSNorm over the head dim
before rotary, an explicit ``head_dim`` → ``kv_channels``). A sparse layer's MLP, as Qwen2-MoE's
(``qwen2_moe.py``) without the shared expert:

    HF   mlp.gate.weight (E, h)                         → mlp.router.weight (E, h)  (no bias)
         mlp.experts.e.gate_proj / up_proj (F, h)       → mlp.experts.weight1[e]
                                                          = [gate; up]ᵀ (h, 2F)
         mlp.experts.e.down_proj (h, F)                 → mlp.experts.weight2[e] = downᵀ (F, h)

    y = Σ_{e ∈ top-k} p_e · expert_e(x)                                       (both sides)

Routing: HF takes the softmax over all E logits and its top-k; ``norm_topk_prob = False`` keeps
those k probabilities as they are — tpfuse's ``moe_router_pre_softmax = True``;
``norm_topk_prob = True`` (the released Qwen3-MoE models) renormalises them to sum 1, the softmax
of the k top logits — tpfuse's default router. Dropless, no top-k scaling;
``router_aux_loss_coef`` → ``moe_aux_loss_coeff`` (aux_loss balancing).

Which layers are sparse: layer i is an MoE layer when i ∉ ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0, the others a dense SwiGLU MLP of ``intermediate_size``
(``ffn_hidden_size``); tpfuse writes the pattern as ``moe_layer_freq`` (1 when every layer is
sparse, else one 0/1 per layer), the export as ``decoder_sparse_step = 1`` + ``mlp_only_layers``.
The expert count is ``num_experts`` (the released configs; transformers writes it back as
``num_local_experts``: either is read). Refused by name: what Qwen3 refuses, no experts or no
sparse layer; on export, a tpfuse MoE model with a shared expert, biases, capacity, group-limited
or sigmoid routing or a top-k scaling factor.
"""
from __future__ import annotations

import torch

from tpfuse.models.moe_config import moe_layer_pattern

from . import llama, qwen2_moe, qwen3
from .common import TensorSet, plain_topk_router_needs, unmet

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
FAMILY = "Qwen3-MoE"
# Qwen3MoeConfig's values for keys a config.json may leave out, where they differ from Llama's
DEFAULTS = {"num_key_value_heads": 4, "router_aux_loss_coef": 0.001}
PREFIX = llama.PREFIX


def expert_count(hf: dict) -> int:
    """``num_experts`` (or transformers' alias ``num_local_experts``; both must agree)."""
    given = {key: hf[key] for key in ("num_experts", "num_local_experts") if key in hf}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"{FAMILY} num_experts={given['num_experts']!r} disagrees with "
                         f"num_local_experts={given['num_local_experts']!r}")
    key = next(iter(given), "num_experts")
    return qwen2_moe.positive(hf, key, FAMILY)


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a Qwen3-MoE config.json (ValueError for what tpfuse lacks)."""
    hf = {**DEFAULTS, **hf}
    experts = expert_count(hf)
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        qwen2_moe.positive(hf, key, FAMILY)
    values = qwen3.attention_values(hf, FAMILY, {})
    pattern = qwen2_moe.sparse_pattern(hf, values["num_layers"], FAMILY)
    if not any(pattern):
        raise ValueError("Qwen3-MoE config.json has no sparse layer (decoder_sparse_step / "
                         "mlp_only_layers leave every layer dense): convert it as a Qwen3")
    values.update(num_moe_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["moe_intermediate_size"],
                  moe_layer_freq=1 if all(pattern) else pattern,
                  moe_router_score_function="softmax",
                  moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                  moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))
    return values


def mismatches(config) -> list[str]:
    """Why ``config`` is not a Qwen3-MoE (empty when it is)."""
    c = config
    if c.num_moe_experts is None:
        return ["num_moe_experts=None (needs experts)"]
    problems = [p for p in qwen3.attention_mismatches(c)
                if not p.startswith(("num_moe_experts", "add_bias_linear"))]
    wanted = [("moe_shared_expert_intermediate_size",
               c.moe_shared_expert_intermediate_size is None, "None: no shared expert")]
    return problems + unmet(c, wanted + plain_topk_router_needs(c))


def config_to_hf(config, eos_id: int | None) -> dict:
    c = config
    hf = qwen3.attention_to_hf(c, eos_id)
    dense = [i for i, sparse in enumerate(moe_layer_pattern(c)) if not sparse]
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
              moe_intermediate_size=c.moe_ffn_hidden_size, num_experts=c.num_moe_experts,
              num_experts_per_tok=c.moe_router_topk,
              norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=dense, router_aux_loss_coef=c.moe_aux_loss_coeff,
              output_router_logits=False)
    return hf


def _dense_mlp(c, ours: str, theirs: str):
    """(tpfuse fc1, fc2; HF gate, up, down) names of a dense layer's SwiGLU MLP."""
    return (ours + "mlp.linear_fc1.weight", ours + "mlp.linear_fc2.weight",
            theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight",
            theirs + "mlp.down_proj.weight")


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor from Qwen3-MoE's tensors."""
    source = TensorSet(tensors, where, llama.IGNORED)
    c, h, f = config, config.hidden_size, config.ffn_hidden_size
    out = llama.take_common(source, c)
    for i, sparse in enumerate(moe_layer_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        qwen3.attention_from_hf(source, c, ours, theirs, out)
        if sparse:
            qwen2_moe.take_experts(source, c, ours, theirs, out)
            continue
        fc1, fc2, gate, up, down = _dense_mlp(c, ours, theirs)
        out[fc1] = torch.cat([source.take(gate, (f, h)), source.take(up, (f, h))])
        out[fc2] = source.take(down, (h, f))
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """Qwen3-MoE's tensor names from tpfuse's single-process ones."""
    c = config
    out = {}
    for i, sparse in enumerate(moe_layer_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        qwen3.attention_to_hf_tensors(full, c, ours, theirs, out)
        if sparse:
            qwen2_moe.put_experts(full, c, ours, theirs, out)
            continue
        fc1, fc2, gate, up, down = _dense_mlp(c, ours, theirs)
        out[gate], out[up] = (t.contiguous() for t in full[fc1].chunk(2))
        out[down] = full[fc2]
    return llama.common_to_hf(full, c, out)
