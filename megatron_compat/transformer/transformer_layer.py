"""megatron-core 0.16's ``transformer.transformer_layer``: ``TransformerLayer`` and
``TransformerLayerSubmodules``, over tpfuse's TransformerLayer.

A spec is checked against what tpfuse's layer computes (``check_layer_spec``): pre-norm
(``WrappedTorchNorm``), causal self-attention (column-parallel QKV, ``DotProductAttention``,
row-parallel projection, no q/k norm), bias-dropout-add, pre-MLP norm, an ``MLP`` (fc1, fc2) or
an ``MoELayer``. Any other module in a slot is a ValueError naming the slot.

The layer registers the tpfuse layer's parts under Megatron's names (``input_layernorm``,
``self_attention.linear_qkv`` / ``linear_proj``, ``pre_mlp_layernorm``, ``mlp.linear_fc1`` /
``linear_fc2``), so its state dict reads as Megatron's. ``forward(hidden_states,
attention_mask, ...)`` returns ``(output, context)`` (context None) as Megatron's does; the
attention is causal (a given mask must be the causal one: ``check_causal_mask``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import torch

from tpfuse.tp_layers import TransformerLayer as _NativeLayer

from .enums import AttnMaskType
from .identity_op import IdentityFuncOp, IdentityOp
from .module import MegatronModule
from .spec_utils import ModuleSpec, get_module


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: dict = field(default_factory=dict)


class BaseTransformerLayer:
    """Megatron's marker base class of transformer layers."""


def _require(slot: str, given, *expected) -> None:
    module = get_module(given) if given is not None else None
    if module not in expected:
        names = " or ".join(getattr(e, "__name__", repr(e)) for e in expected)
        raise ValueError(f"layer spec: {slot} is {getattr(module, '__name__', module)!r}; "
                         f"tpfuse's TransformerLayer computes {names} there "
                         "(use get_gpt_layer_local_spec())")


def check_layer_spec(spec, config) -> dict:
    """ValueError unless ``spec`` describes tpfuse's layer; ``{"moe": bool}`` otherwise."""
    from ..fusions.fused_bias_dropout import get_bias_dropout_add
    from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from .attention import SelfAttention
    from .dot_product_attention import DotProductAttention
    from .mlp import MLP
    from .moe.experts import GroupedMLP, SequentialMLP
    from .moe.moe_layer import MoELayer
    from .torch_norm import WrappedTorchNorm

    if not isinstance(spec, ModuleSpec) or get_module(spec) is not TransformerLayer:
        raise ValueError("transformer_layer_spec must be a ModuleSpec of TransformerLayer "
                         "(get_gpt_layer_local_spec()); per-layer block specs are not supported")
    sub = spec.submodules
    _require("input_layernorm", sub.input_layernorm, WrappedTorchNorm)
    _require("pre_mlp_layernorm", sub.pre_mlp_layernorm, WrappedTorchNorm)
    _require("self_attn_bda", sub.self_attn_bda, get_bias_dropout_add)
    _require("mlp_bda", sub.mlp_bda, get_bias_dropout_add)
    _require("cross_attention", sub.cross_attention, IdentityOp)
    attention = sub.self_attention
    _require("self_attention", attention, SelfAttention)
    mask = attention.params.get("attn_mask_type", AttnMaskType.padding)
    if mask is not AttnMaskType.causal:
        raise ValueError(f"layer spec: self_attention attn_mask_type={mask}; tpfuse's attention "
                         "is causal (AttnMaskType.causal)")
    a = attention.submodules
    _require("self_attention.linear_qkv", a.linear_qkv, ColumnParallelLinear)
    _require("self_attention.core_attention", a.core_attention, DotProductAttention)
    _require("self_attention.linear_proj", a.linear_proj, RowParallelLinear)
    _require("self_attention.q_layernorm", a.q_layernorm, IdentityOp)
    _require("self_attention.k_layernorm", a.k_layernorm, IdentityOp)
    moe = get_module(sub.mlp) is MoELayer
    if moe:
        experts = get_module(sub.mlp.submodules.experts)
        _require("mlp.experts", sub.mlp.submodules.experts, GroupedMLP, SequentialMLP)
        if (experts is GroupedMLP) != bool(config.moe_grouped_gemm):
            raise ValueError(f"layer spec: mlp.experts is {experts.__name__} but "
                             f"TransformerConfig.moe_grouped_gemm={config.moe_grouped_gemm}")
        if config.num_moe_experts is None:
            raise ValueError("layer spec has an MoELayer but TransformerConfig.num_moe_experts "
                             "is None")
    else:
        _require("mlp", sub.mlp, MLP)
        _require("mlp.linear_fc1", sub.mlp.submodules.linear_fc1, ColumnParallelLinear)
        _require("mlp.linear_fc2", sub.mlp.submodules.linear_fc2, RowParallelLinear)
        if config.num_moe_experts is not None:
            raise ValueError(f"TransformerConfig.num_moe_experts={config.num_moe_experts} but the "
                             "layer spec has a dense MLP: get_gpt_layer_local_spec(num_experts="
                             f"{config.num_moe_experts})")
    return {"moe": moe, "keys_map": dict(sub.sharded_state_dict_keys_map)}


def check_causal_mask(attention_mask) -> None:
    """A Megatron mask (True = masked) must be the causal one over the last two dims."""
    if attention_mask is None:
        return
    s_q, s_k = attention_mask.shape[-2:]
    causal = torch.ones(s_q, s_k, dtype=torch.bool, device=attention_mask.device).triu(1)
    if attention_mask.dtype != torch.bool or not torch.equal(
            attention_mask.expand(*attention_mask.shape[:-2], s_q, s_k),
            causal.expand(*attention_mask.shape[:-2], s_q, s_k)):
        raise ValueError("attention_mask: tpfuse's attention is causal; pass None or the causal "
                         "mask (bool, True above the diagonal). Packed documents: build the "
                         "native tpfuse GPTModel and pass document_ids")


def reject(**options) -> None:
    """ValueError naming the first Megatron forward argument given that tpfuse does not
    implement."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{name} is not supported by tpfuse's TransformerLayer/GPTModel")


def adopt_layer(target, native) -> None:
    """Register ``native``'s parts on ``target`` under Megatron's names."""
    target.input_layernorm = native.input_norm
    target.self_attention = native.self_attention
    target.pre_mlp_layernorm = native.pre_mlp_norm
    target.mlp = native.mlp
    object.__setattr__(target, "_native", native)


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """Megatron's layer signature; a dense tpfuse TransformerLayer does the work."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout=None, pg_collection=None, vp_stage=None):
        super().__init__(config=config, pg_collection=pg_collection)
        from ._native import check_model_fields, model_seed

        check_layer_spec(ModuleSpec(module=TransformerLayer, submodules=submodules), config)
        check_model_fields(config)
        if config.num_moe_experts is not None:
            raise ValueError("a standalone MoE TransformerLayer is not supported: build the "
                             "GPTModel (its layers hold the MoE blocks)")
        self.submodules_config, self.layer_number = submodules, layer_number
        from tpfuse.models.gpt import LAYER_SEED_OFFSET, seeded

        from ._native import activation_of
        c = config
        with seeded(model_seed() + LAYER_SEED_OFFSET + layer_number - 1):
            native = _NativeLayer(
                c.hidden_size, c.num_attention_heads, c.ffn_hidden_size,
                num_query_groups=c.num_query_groups, normalization=c.normalization,
                layernorm_epsilon=c.layernorm_epsilon, activation=activation_of(c),
                add_bias_linear=c.add_bias_linear,
                hidden_dropout=c.hidden_dropout if hidden_dropout is None else hidden_dropout,
                attention_dropout=c.attention_dropout, sequence_parallel=c.sequence_parallel,
                init_method_std=c.init_method_std,
                output_layer_init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers),
                params_dtype=c.params_dtype)
        adopt_layer(self, native)

    def train(self, mode: bool = True):
        super().train(mode)
        self._native.train(mode)
        return self

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                attention_bias=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        check_causal_mask(attention_mask)
        reject(context=context, context_mask=context_mask, rotary_pos_emb=rotary_pos_emb,
               rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
               attention_bias=attention_bias, inference_context=inference_context,
               packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
               inference_params=inference_params)
        return self._native(hidden_states), None          # (s[/tp], b, h), context


_UNSUPPORTED_SPLIT_FIELDS = ("pipeline_model_parallel_layout",
                             "account_for_embedding_in_pipeline_split",
                             "account_for_loss_in_pipeline_split")


def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
    """Global index of the first decoder layer of chunk ``vp_stage`` of pipeline rank ``pp_rank``
    (default: parallel_state's rank), megatron-core 0.16's function over tpfuse's own assignment
    (``tpfuse.models.layer_assignment.layer_offset``). 0 without a pipeline; an even split puts
    ``L/(pp·vpp)`` layers in each chunk, chunk c of rank r starting at ``(c·pp + r)·L/(pp·vpp)``;
    ``num_layers_in_first/last_pipeline_stage`` give the end stages their counts, the other
    stages sharing the rest evenly, every count split evenly over the virtual chunks. A split
    tpfuse does not build (a pipeline layout, the embedding / loss counted as a layer, counts
    that do not divide) is a ValueError naming the field."""
    from types import SimpleNamespace

    from tpfuse.models.layer_assignment import layer_offset

    if pp_rank is None:
        from .. import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if config.pipeline_model_parallel_size <= 1:
        return 0
    for name in _UNSUPPORTED_SPLIT_FIELDS:
        if getattr(config, name):
            raise ValueError(f"TransformerConfig.{name}={getattr(config, name)!r} is not "
                             "implemented by tpfuse's layer assignment; leave it unset")
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is not None:
        assert vp_stage is not None, \
            "vp_stage must be provided if virtual pipeline model parallel size is set"
    assignment = SimpleNamespace(
        num_layers=config.num_layers,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        decoder_first_pipeline_num_layers=config.num_layers_in_first_pipeline_stage,
        decoder_last_pipeline_num_layers=config.num_layers_in_last_pipeline_stage)
    return layer_offset(assignment, pp_rank, vp_stage if vpp is not None else None)
