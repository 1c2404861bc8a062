"""megatron-core 0.16's ``models.gpt.gpt_layer_specs``: the local spec (Megatron-core modules
only, what tpfuse builds) and the Transformer Engine spec, which is refused.

``get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, ...)``
returns Megatron's ModuleSpec tree: TransformerLayer(input_layernorm=WrappedTorchNorm,
self_attention=SelfAttention(causal; ColumnParallelLinear, DotProductAttention,
RowParallelLinear, q/k norms: WrappedTorchNorm with ``qk_layernorm``, else IdentityOp),
bias-dropout-add, pre_mlp_layernorm, MLP or
MoELayer(GroupedMLP / SequentialMLP experts)) with Megatron's ``sharded_state_dict_keys_map``
(the norms saved under the TE spec's names). Options tpfuse's layer does not compute raise,
naming the option.
"""
from __future__ import annotations

from ...fusions.fused_bias_dropout import get_bias_dropout_add
from ...tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ...transformer.attention import SelfAttention, SelfAttentionSubmodules
from ...transformer.dot_product_attention import DotProductAttention
from ...transformer.enums import AttnMaskType
from ...transformer.identity_op import IdentityOp
from ...transformer.mlp import MLP, MLPSubmodules
from ...transformer.moe.experts import GroupedMLP, SequentialMLP
from ...transformer.moe.moe_layer import MoELayer, MoESubmodules
from ...transformer.spec_utils import ModuleSpec
from ...transformer.torch_norm import WrappedTorchNorm
from ...transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

_NO_TE = ("Transformer Engine is not used by tpfuse (its layers are tpfuse's own kernels); "
          "use get_gpt_layer_local_spec(...) instead")


def _refuse(**options) -> None:
    for name, value in options.items():
        if value:
            raise ValueError(f"get_gpt_layer_local_spec({name}={value!r}) is not implemented by "
                             "tpfuse's TransformerLayer")


def get_mlp_module_spec(use_te=True, num_experts=None, moe_grouped_gemm=False, fp8=None,
                        moe_use_legacy_grouped_gemm=False, use_te_op_fuser=False):
    """The MLP (dense) or MoE block spec; ``use_te=True`` is refused (no Transformer Engine)."""
    if use_te:
        raise ValueError(f"get_mlp_module_spec(use_te=True): {_NO_TE}")
    _refuse(moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
            use_te_op_fuser=use_te_op_fuser)
    if num_experts is None:
        return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                               linear_fc2=RowParallelLinear))
    experts = (ModuleSpec(module=GroupedMLP) if moe_grouped_gemm else
               ModuleSpec(module=SequentialMLP,
                          submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                   linear_fc2=RowParallelLinear)))
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts,
                                                                shared_experts=None))


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                             multi_latent_attention=False, fp8=None,
                             moe_use_legacy_grouped_gemm=False, normalization=None,
                             qk_l2_norm=False, use_kitchen=False, use_kitchen_attention=False,
                             kitchen_attention_backend="sdpa") -> ModuleSpec:
    """Megatron's local GPT layer spec (``normalization`` is read from the config: both
    LayerNorm and RMSNorm are tpfuse's Norm)."""
    _refuse(multi_latent_attention=multi_latent_attention,
            qk_l2_norm=qk_l2_norm, use_kitchen=use_kitchen,
            use_kitchen_attention=use_kitchen_attention)
    if normalization not in (None, "LayerNorm", "RMSNorm"):
        raise ValueError(f"get_gpt_layer_local_spec(normalization={normalization!r}): LayerNorm "
                         "or RMSNorm")
    qk_norm = WrappedTorchNorm if qk_layernorm else IdentityOp
    mlp = get_mlp_module_spec(use_te=False, num_experts=num_experts,
                              moe_grouped_gemm=moe_grouped_gemm,
                              moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear, q_layernorm=qk_norm,
                    k_layernorm=qk_norm)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))


def get_gpt_layer_with_transformer_engine_spec(*args, **kwargs):
    """Refused: tpfuse does not use Transformer Engine."""
    raise ValueError(f"get_gpt_layer_with_transformer_engine_spec: {_NO_TE}")


def get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs):
    """Megatron's per-layer block spec: tpfuse takes the one layer spec for every layer."""
    if use_transformer_engine:
        raise ValueError(f"get_gpt_decoder_block_spec(use_transformer_engine=True): {_NO_TE}")
    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                    moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization)
