"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) ↔ tpfuse GPTModel with multi-latent attention, the
first ``first_k_dense_replace`` layers dense and the rest fine-grained MoE with shared experts.

Attention (``tp_layers/mla.py``; HF ``DeepseekV3Attention``), per layer, taken as they are:

    HF self_attn.q_proj (n·d_q, h)                → self_attention.linear_q_proj (no q_lora_rank)
       self_attn.q_a_proj (r_q, h)                → self_attention.linear_q_down_proj
       self_attn.q_a_layernorm (r_q,)             → self_attention.q_layernorm
       self_attn.q_b_proj (n·d_q, r_q)            → self_attention.linear_q_up_proj
       self_attn.kv_a_proj_with_mqa (r + d_pe, h) → self_attention.linear_kv_down_proj
       self_attn.kv_a_layernorm (r,)              → self_attention.kv_layernorm
       self_attn.kv_b_proj (n·(d_n + d_v), r)     → self_attention.linear_kv_up_proj
       self_attn.o_proj (h, n·d_v)                → self_attention.linear_proj

Both sides lay a query head out as [nope (d_n), rope (d_pe)], the latent as [c_kv (r), k_pe
(d_pe)] and a kv_b head as [k_nope (d_n), v (d_v)], and rotate the rope part in interleaved pairs
(``rope_interleave``, HF's default; tpfuse's MLA rope is the interleaved one, Megatron's), so no
tensor is permuted. Sizes: ``qk_nope_head_dim`` → ``qk_head_dim``, ``qk_rope_head_dim`` →
``qk_pos_emb_head_dim``; the latent norms exist in DeepSeek's checkpoints → ``qk_layernorm``.
Rotary: none → ``rope_type = rope``; YaRN (``rope_parameters.rope_type = yarn``) → ``rope_type
= yarn`` with its factor, original context, β fast / slow, mscale and mscale_all_dim (the
softmax scale g(factor, mscale_all_dim)² / √d_q on both sides).

The MLP: layer i < ``first_k_dense_replace`` is a dense SwiGLU MLP of ``intermediate_size``, the
others an MoE block (``moe_layer_freq`` one 0/1 per layer):

    HF mlp.gate.weight (E, h)                      → mlp.router.weight
       mlp.gate.e_score_correction_bias (E,)       → mlp.router.expert_bias (aux-loss-free)
       mlp.experts.e.gate_proj / up_proj (F, h)    → mlp.experts.weight1[e] = [gate; up]ᵀ
       mlp.experts.e.down_proj (h, F)              → mlp.experts.weight2[e] = downᵀ (F, h)
       mlp.shared_experts.gate_proj / up_proj      → mlp.shared_experts.linear_fc1 = [gate; up]
       mlp.shared_experts.down_proj                → mlp.shared_experts.linear_fc2

Routing (HF ``DeepseekV3TopkRouter``): sigmoid scores; the choice by score + bias, limited to the
``topk_group`` best of ``n_group`` groups (ranked by the sum of each group's two best biased
scores; Megatron's, tpfuse's, by its top-k / ``topk_group`` best: a grouped config converts when
that is 2, as in DeepSeek-V3's 8 / 4); the weights the unbiased scores of the chosen experts
renormalised to sum 1 (``norm_topk_prob``), times ``routed_scaling_factor`` — tpfuse's sigmoid
router with ``moe_router_enable_expert_bias``, ``moe_router_num_groups`` /
``moe_router_group_topk`` and ``moe_router_topk_scaling_factor``, in fp32
(``moe_router_dtype``), dropless. The shared experts (``n_shared_experts`` ×
``moe_intermediate_size`` wide) are ungated.

Multi-token prediction: ``DeepseekV3ForCausalLM`` has no MTP module, so an import makes a model
without one (``mtp_num_layers`` None; DeepSeek's own release stores its MTP layer as
``model.layers.{num_hidden_layers}`` — those tensors are refused by name, not silently
dropped), and an export of a model trained with MTP writes the main model only: its MTP block has
no HF counterpart and is left out (a note says so); the logits, which MTP does not touch, are
what the certificate compares.

Refused by name: ``rope_interleave`` false, attention biases, ``norm_topk_prob`` false (tpfuse's
sigmoid router always renormalises), a top-k of 1 (HF's renormalised single weight is 1), yarn
``mscale`` without ``mscale_all_dim`` (HF ignores that mscale), a hidden_act other than silu.
"""
from __future__ import annotations

import sys

import torch

from . import llama, qwen2_moe
from .common import TensorSet, unmet

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
PREFIX = llama.PREFIX
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"DeepSeek-V3 config.json lacks {key!r}")
    return hf[key]


def _refuse(hf: dict, key: str, bad, why: str) -> None:
    if hf.get(key) == bad:
        raise ValueError(f"DeepSeek-V3 {key}={hf.get(key)!r} is not supported ({why})")


def _rotary(hf: dict) -> dict:
    """``rope_type`` and YaRN's fields from ``rope_parameters`` (or the older ``rope_scaling``)."""
    parameters = dict(hf.get("rope_scaling") or {}, **(hf.get("rope_parameters") or {}))
    kind = parameters.get("rope_type") or parameters.get("type") or "default"
    values = {"rotary_base": llama.rope_theta(hf)}
    if kind == "default":
        return dict(values, rope_type="rope")
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V3 rotary scaling rope_type={kind!r} is not supported "
                         "(tpfuse's MLA has rope and yarn)")
    yarn = {key: float(parameters.get(key) if parameters.get(key) is not None else default)
            for key, default in YARN_DEFAULTS.items()}
    if yarn["mscale"] != 1.0 and not yarn["mscale_all_dim"]:
        raise ValueError(f"DeepSeek-V3 yarn mscale={yarn['mscale']} without mscale_all_dim is "
                         "not supported (HF then ignores mscale)")
    original = parameters.get("original_max_position_embeddings") or \
        _require(hf, "max_position_embeddings")
    return dict(values, rope_type="yarn", rotary_scaling_factor=float(parameters["factor"]),
                original_max_position_embeddings=int(original), **yarn)


def _moe(hf: dict, num_layers: int) -> dict:
    experts, first_dense = _require(hf, "n_routed_experts"), hf.get("first_k_dense_replace") or 0
    if first_dense >= num_layers:
        raise ValueError(f"DeepSeek-V3 first_k_dense_replace={first_dense} leaves no MoE layer "
                         f"of {num_layers}")
    topk = _require(hf, "num_experts_per_tok")
    if topk == 1:
        raise ValueError("DeepSeek-V3 num_experts_per_tok=1 is not supported (HF renormalises "
                         "the single weight to 1, tpfuse's sigmoid router keeps the score)")
    groups = hf.get("n_group") or 1
    if groups > 1 and topk // (hf.get("topk_group") or 1) != 2:
        raise ValueError(f"DeepSeek-V3 n_group={groups} with num_experts_per_tok={topk} and "
                         f"topk_group={hf.get('topk_group')} is not supported (HF ranks a group "
                         "by its two best scores, tpfuse as Megatron by its top-k / topk_group "
                         "best: they agree when that is 2)")
    shared = hf.get("n_shared_experts") or 0
    pattern = [0] * first_dense + [1] * (num_layers - first_dense)
    return dict(
        num_moe_experts=experts, moe_router_topk=topk,
        moe_ffn_hidden_size=_require(hf, "moe_intermediate_size"),
        moe_layer_freq=1 if first_dense == 0 else pattern,
        moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"] or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=hf.get("topk_group") if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def config_from_hf(hf: dict) -> dict:
    """TransformerConfig values for a DeepSeek-V3 config.json (ValueError for what tpfuse lacks)."""
    _refuse(hf, "rope_interleave", False, "tpfuse's MLA rotates interleaved pairs")
    _refuse(hf, "attention_bias", True, "MLA's projections have no bias")
    _refuse(hf, "norm_topk_prob", False, "tpfuse's sigmoid router renormalises the top-k")
    heads = _require(hf, "num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ValueError(f"DeepSeek-V3 num_key_value_heads={hf['num_key_value_heads']} != "
                         f"num_attention_heads={heads} is not supported (MLA has no groups)")
    plain = {key: value for key, value in hf.items() if key not in ("rope_scaling",
                                                                     "rope_parameters")}
    values = llama.config_from_hf(dict(plain, head_dim=None, attention_bias=False,
                                       mlp_bias=False))        # its rotary: _rotary's below
    values.update(
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=_require(hf, "kv_lora_rank"), qk_head_dim=_require(hf, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_require(hf, "qk_rope_head_dim"),
        v_head_dim=_require(hf, "v_head_dim"), **_rotary(hf),
        **_moe(hf, values["num_layers"]))
    return values


def mismatches(config) -> list[str]:
    """Why ``config`` is not a DeepSeek-V3 (empty when it is)."""
    c = config
    if not c.multi_latent_attention:
        return ["multi_latent_attention=False (needs MLA)"]
    wanted = [("normalization", c.normalization == "RMSNorm", "RMSNorm"),
              ("activation", c.activation == "swiglu", "swiglu"),
              ("qk_layernorm", c.qk_layernorm, "True: the latent norms"),
              ("add_bias_linear", not c.add_bias_linear, "False"),
              ("window_size", c.window_size is None, "None"),
              ("num_moe_experts", c.num_moe_experts is not None, "experts")]
    if c.num_moe_experts is not None:
        wanted += [
            ("moe_router_score_function", c.moe_router_score_function == "sigmoid", "sigmoid"),
            ("moe_router_enable_expert_bias", c.moe_router_enable_expert_bias, "True"),
            ("moe_expert_capacity_factor", c.moe_expert_capacity_factor is None, "None"),
            ("moe_shared_expert_gate", not c.moe_shared_expert_gate, "False"),
            ("moe_router_topk", c.moe_router_topk > 1, "> 1"),
            ("moe_layer_freq", _first_k_dense(c) is not None, "k dense layers, then MoE"),
            ("moe_router_group_topk", not c.moe_router_num_groups
             or c.moe_router_topk // c.moe_router_group_topk == 2,
             "moe_router_topk / 2: HF ranks groups by their two best scores")]
        shared = c.moe_shared_expert_intermediate_size
        wanted.append(("moe_shared_expert_intermediate_size",
                       shared is None or shared % c.moe_ffn_hidden_size == 0,
                       "a multiple of moe_ffn_hidden_size"))
    return unmet(c, wanted)


def _pattern(config) -> list[bool]:
    from tpfuse.models.moe_config import moe_layer_pattern

    return [bool(p) for p in moe_layer_pattern(config)]


def _first_k_dense(config) -> int | None:
    """k when the layers are k dense then MoE to the end, else None."""
    pattern = _pattern(config)
    k = pattern.index(True) if True in pattern else len(pattern)
    return k if all(pattern[k:]) else None


def _yarn_to_hf(c) -> dict:
    if (c.rope_type or "yarn") == "rope":
        return {"rope_type": "default", "rope_theta": c.rotary_base}
    return {"rope_type": "yarn", "rope_theta": c.rotary_base, "factor": c.rotary_scaling_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings,
            "beta_fast": c.beta_fast, "beta_slow": c.beta_slow, "mscale": c.mscale,
            "mscale_all_dim": c.mscale_all_dim}


def config_to_hf(config, eos_id: int | None) -> dict:
    c = config
    hf = llama.config_to_hf(c, eos_id)
    for key in ("head_dim", "mlp_bias", "rope_scaling"):
        hf.pop(key)
    shared = c.moe_shared_expert_intermediate_size
    hf.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
              num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
              kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
              qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
              rope_parameters=_yarn_to_hf(c), rope_interleave=True, attention_bias=False,
              n_routed_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
              moe_intermediate_size=c.moe_ffn_hidden_size,
              n_shared_experts=0 if shared is None else shared // c.moe_ffn_hidden_size,
              first_k_dense_replace=_first_k_dense(c),
              n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1,
              routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
              norm_topk_prob=True, num_nextn_predict_layers=0)
    hf["rope_theta"] = c.rotary_base
    return hf


def _attention_tensors(c) -> list[tuple]:
    """(tpfuse suffix, HF suffix, shape) of one MLA block's tensors (and the two layer norms)."""
    h, n = c.hidden_size, c.num_attention_heads
    d_q, r, d_pe = c.qk_head_dim + c.qk_pos_emb_head_dim, c.kv_lora_rank, c.qk_pos_emb_head_dim
    a, ours = "self_attn.", "self_attention."
    names = [("input_norm.weight", "input_layernorm.weight", (h,)),
             ("pre_mlp_norm.weight", "post_attention_layernorm.weight", (h,)),
             (ours + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight", (r + d_pe, h)),
             (ours + "kv_layernorm.weight", a + "kv_a_layernorm.weight", (r,)),
             (ours + "linear_kv_up_proj.weight", a + "kv_b_proj.weight",
              (n * (c.qk_head_dim + c.v_head_dim), r)),
             (ours + "linear_proj.weight", a + "o_proj.weight", (h, n * c.v_head_dim))]
    if c.q_lora_rank is None:
        return names + [(ours + "linear_q_proj.weight", a + "q_proj.weight", (n * d_q, h))]
    r_q = c.q_lora_rank
    return names + [(ours + "linear_q_down_proj.weight", a + "q_a_proj.weight", (r_q, h)),
                    (ours + "q_layernorm.weight", a + "q_a_layernorm.weight", (r_q,)),
                    (ours + "linear_q_up_proj.weight", a + "q_b_proj.weight", (n * d_q, r_q))]


def _swiglu_mlps(c, ours: str, theirs: str, sparse: bool) -> list[tuple]:
    """(tpfuse fc1, fc2, HF gate, up, down, rows) of the layer's dense MLP or shared experts."""
    if sparse:
        if c.moe_shared_expert_intermediate_size is None:
            return []
        ours, theirs, rows = (ours + "mlp.shared_experts.", theirs + "mlp.shared_experts.",
                              c.moe_shared_expert_intermediate_size)
    else:
        ours, theirs, rows = ours + "mlp.", theirs + "mlp.", c.ffn_hidden_size
    return [(ours + "linear_fc1.weight", ours + "linear_fc2.weight", theirs + "gate_proj.weight",
             theirs + "up_proj.weight", theirs + "down_proj.weight", rows)]


def _experts_from_hf(source, c, ours: str, theirs: str, out: dict) -> None:
    """Qwen2-MoE's router and per-expert layout (``qwen2_moe.take_experts``) plus the bias."""
    qwen2_moe.take_experts(source, c, ours, theirs, out)
    out[ours + "mlp.router.expert_bias"] = source.take(
        theirs + "mlp.gate.e_score_correction_bias", (c.num_moe_experts,)).float()


def _refuse_mtp_layers(source, c) -> None:
    extra = sorted(n for n in source.tensors if n.startswith(f"{PREFIX}layers.{c.num_layers}."))
    if extra:
        raise ValueError(f"{source.where}: {len(extra)} tensors of layer {c.num_layers} (e.g. "
                         f"{extra[0]!r}): DeepSeek's multi-token-prediction layer, which "
                         "DeepseekV3ForCausalLM does not load either; remove them to convert "
                         "the main model")


def tensors_from_hf(tensors: dict, config, where: str) -> dict:
    """tpfuse single-process name → tensor from DeepSeek-V3's tensors."""
    source = TensorSet(tensors, where, llama.IGNORED)
    c, h = config, config.hidden_size
    _refuse_mtp_layers(source, c)
    out = llama.take_common(source, c)
    for i, sparse in enumerate(_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        for suffix, hf_suffix, shape in _attention_tensors(c):
            out[ours + suffix] = source.take(theirs + hf_suffix, shape)
        if sparse:
            _experts_from_hf(source, c, ours, theirs, out)
        for fc1, fc2, gate, up, down, rows in _swiglu_mlps(c, ours, theirs, sparse):
            out[fc1] = torch.cat([source.take(gate, (rows, h)), source.take(up, (rows, h))])
            out[fc2] = source.take(down, (h, rows))
    return llama.finish_common(source, out, c)


def tensors_to_hf(full: dict, config) -> dict:
    """DeepSeek-V3's tensor names from tpfuse's single-process ones (an MTP block left out)."""
    c = config
    mtp = sorted(name for name in full if name.startswith("mtp"))
    if mtp:
        print(f"> note: {len(mtp)} multi-token-prediction tensors have no place in "
              f"{ARCHITECTURE} and are not exported", file=sys.stderr, flush=True)
    out = {}
    for i, sparse in enumerate(_pattern(c)):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        for suffix, hf_suffix, _ in _attention_tensors(c):
            out[theirs + hf_suffix] = full[ours + suffix]
        if sparse:
            qwen2_moe.put_experts(full, c, ours, theirs, out)
            out[theirs + "mlp.gate.e_score_correction_bias"] = full[ours + "mlp.router.expert_bias"]
        for fc1, fc2, gate, up, down, _ in _swiglu_mlps(c, ours, theirs, sparse):
            out[gate], out[up] = (t.contiguous() for t in full[fc1].chunk(2))
            out[down] = full[fc2]
    return llama.common_to_hf(full, c, out)
