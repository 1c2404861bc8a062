"""The compat TransformerConfig (+ GPTModel's arguments) as tpfuse's native
``tpfuse.models.TransformerConfig``: what the compat model pieces build the native engine from.

Fields with the same name in both configs are copied; Megatron's descriptions become tpfuse's
(``activation_func`` + ``gated_linear_unit`` → ``activation``, ``share_embeddings_and_output_
weights`` → ``untie_embeddings_and_output_weights``, ``num_layers_in_first/last_pipeline_stage``
→ ``decoder_first/last_pipeline_num_layers``). ``qk_layernorm`` is copied: the native layers
then hold ``self_attention.q_layernorm`` / ``k_layernorm`` (the layer spec's q / k norm slots
must say the same: ``models/gpt/gpt_model.py``). ``vocab_size`` is Megatron's (already padded)
size: the native model pads nothing more (``make_vocab_size_divisible_by = 1``), so it must be
a multiple of tp as Megatron's vocab-parallel embedding requires. The weights are drawn by
tpfuse's layout-independent initialisation, seeded with the seed given to
``model_parallel_cuda_manual_seed`` (tensor_parallel.random), N(0, init_method_std²) as
Megatron's default ``init_method``, the word and position embeddings N(0,
embedding_init_method_std²) (a user-supplied init function is refused). The parallel
sizes are those of parallel_state's groups (Megatron's layers read them there, so a config that
leaves ``tensor_model_parallel_size`` at 1 still builds a tp = 2 model under tp = 2 groups).

A Megatron model option tpfuse's engine does not implement, set to another value than its
default, is a ValueError naming it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from tpfuse.models.config import TransformerConfig as NativeConfig

# Megatron fields that change the model's computation, which tpfuse's GPT does not implement:
# each must keep its Megatron default (checked at model construction, not at config time).
NOT_IMPLEMENTED_MODEL_FIELDS = (
    "fp32_residual_connection", "apply_residual_connection_post_layernorm",
    "layernorm_zero_centered_gamma", "glu_linear_offset", "activation_func_clamp_value",
    "rotary_interleaved", "window_attn_skip_freq", "qk_l2_norm", "qk_clip",
    "attention_output_gate", "multi_latent_attention", "no_rope_freq",
    "experimental_attention_variant", "linear_attention_freq", "softmax_scale", "softmax_type",
    "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "heterogeneous_block_specs", "mrope_section",
    "is_hybrid_model", "moe_router_enable_expert_bias",
    "moe_router_force_load_balancing", "moe_input_jitter_eps", "moe_apply_probs_on_input",
    "moe_latent_size", "moe_router_topk_limited_devices", "moe_use_legacy_grouped_gemm",
    "moe_enable_routing_replay",
)
_RENAMED = {"num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
            "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
_SET_HERE = {"vocab_size", "make_vocab_size_divisible_by", "seq_length",
             "max_position_embeddings", "activation", "position_embedding_type", "rotary_base",
             "untie_embeddings_and_output_weights", "seed", "microbatch_group_size_per_vp_stage",
             "cp_comm_type", "pipeline_schedule", "p2p_recv_ahead",
             "num_layers_per_virtual_pipeline_stage"}


def _field_default(config, name):
    f = {f.name: f for f in dataclasses.fields(config)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_model_fields(config) -> None:
    for name in NOT_IMPLEMENTED_MODEL_FIELDS:
        value, default = getattr(config, name), _field_default(config, name)
        if value != default:
            raise ValueError(f"TransformerConfig.{name}={value!r} is not implemented by tpfuse's "
                             f"GPT engine; leave it at Megatron's default {default!r}")
    if config.add_qkv_bias and not config.add_bias_linear:
        raise ValueError("TransformerConfig.add_qkv_bias=True with add_bias_linear=False is not "
                         "implemented by tpfuse (its QKV bias follows add_bias_linear)")
    if config.kv_channels != config.hidden_size // config.num_attention_heads:
        raise ValueError(f"TransformerConfig.kv_channels={config.kv_channels}: tpfuse's attention "
                         "uses hidden_size / num_attention_heads "
                         f"({config.hidden_size // config.num_attention_heads})")


def activation_of(config) -> str:
    """Megatron's (activation_func, gated_linear_unit) as tpfuse's activation name."""
    func, gated = config.activation_func, config.gated_linear_unit
    if func is F.gelu and not gated:
        return "gelu"
    if func is F.silu and gated:
        return "swiglu"
    name = getattr(func, "__name__", repr(func))
    raise ValueError(f"TransformerConfig.activation_func={name} with gated_linear_unit={gated} "
                     "is not implemented by tpfuse (F.gelu ungated, or F.silu gated = swiglu)")


def _is_normal(init, std) -> bool:
    return (isinstance(init, functools.partial) and init.func is torch.nn.init.normal_
            and math.isclose(init.keywords.get("std", -1.0), std, rel_tol=1e-12)
            and init.keywords.get("mean", 0.0) == 0.0)


def check_init_methods(config) -> None:
    std = config.init_method_std
    if not _is_normal(config.init_method, std):
        raise ValueError("TransformerConfig.init_method: tpfuse draws N(0, init_method_std²) "
                         "(Megatron's default); a custom init_method is not supported")
    if not _is_normal(config.output_layer_init_method, std / math.sqrt(2.0 * config.num_layers)):
        raise ValueError("TransformerConfig.output_layer_init_method: tpfuse draws N(0, "
                         "init_method_std² / (2·num_layers)) (Megatron's default); a custom one "
                         "is not supported")
    if not _is_normal(config.embedding_init_method, config.embedding_init_method_std):
        raise ValueError("TransformerConfig.embedding_init_method: tpfuse draws the word and "
                         "position embeddings N(0, embedding_init_method_std²) (Megatron's "
                         "default); a custom one is not supported")


def model_seed() -> int:
    """The seed given to ``model_parallel_cuda_manual_seed`` (its data-parallel stream)."""
    from tpfuse.tp_layers.random import DATA_PARALLEL_RNG, get_rng_tracker

    seeds = get_rng_tracker().seeds_
    if DATA_PARALLEL_RNG not in seeds:
        raise ValueError("no seed: call tensor_parallel.model_parallel_cuda_manual_seed(seed) "
                         "before building the model (tpfuse draws the weights from that seed, "
                         "the same on every rank)")
    return seeds[DATA_PARALLEL_RNG]


def parallel_sizes(config) -> dict:
    """The parallel sizes of the process groups (as Megatron's layers read them from
    parallel_state, not from the config): the default ParallelState's, the config's in a plain
    single process."""
    from tpfuse.parallel.state import resolve_state_or_none

    state = resolve_state_or_none()
    if state is None:
        return {name: getattr(config, name) for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size")}
    return {"tensor_model_parallel_size": state.tp_size,
            "pipeline_model_parallel_size": state.pp_size,
            "virtual_pipeline_model_parallel_size": state.vpp_size,
            "context_parallel_size": state.cp_size,
            "expert_model_parallel_size": state.ep_size,
            "expert_tensor_parallel_size": state.etp_size}


def native_config(config, *, vocab_size: int, max_sequence_length: int,
                  position_embedding_type: str = "learned_absolute", rotary_base: int = 10000,
                  share_embeddings_and_output_weights: bool = False) -> NativeConfig:
    check_model_fields(config)
    check_init_methods(config)
    tp = parallel_sizes(config)["tensor_model_parallel_size"]
    if vocab_size % tp:
        raise ValueError(f"vocab_size={vocab_size} must be a multiple of "
                         f"tensor_model_parallel_size={tp} (Megatron passes the padded size)")
    if position_embedding_type not in ("learned_absolute", "rope"):
        raise ValueError(f"position_embedding_type={position_embedding_type!r} is not implemented "
                         "by tpfuse (learned_absolute or rope)")
    native_names = {f.name for f in dataclasses.fields(NativeConfig)} - _SET_HERE
    values = {name: getattr(config, name) for name in native_names if hasattr(config, name)}
    for megatron_name, native_name in _RENAMED.items():
        values[native_name] = getattr(config, megatron_name)
    values.update(parallel_sizes(config))
    pp = values["pipeline_model_parallel_size"]
    return NativeConfig(
        **values, vocab_size=vocab_size, make_vocab_size_divisible_by=1,
        seq_length=max_sequence_length, max_position_embeddings=max_sequence_length,
        activation=activation_of(config), position_embedding_type=position_embedding_type,
        rotary_base=rotary_base,
        untie_embeddings_and_output_weights=not share_embeddings_and_output_weights,
        seed=model_seed(), cp_comm_type=config.cp_comm_type or "p2p",
        microbatch_group_size_per_vp_stage=(
            None if config.microbatch_group_size_per_vp_stage in (None, pp)
            else config.microbatch_group_size_per_vp_stage))
