"""``TransformerConfig``: megatron-core 0.16's transformer config — every field of
``ModelParallelConfig`` plus Megatron's model fields, with Megatron's names and defaults
(``_fields`` says which drive tpfuse, which are free descriptions, which must stay default).

Derived at construction, as in Megatron: ``ffn_hidden_size`` (4·h), ``kv_channels`` (h / heads),
``num_query_groups`` (heads), ``init_method`` (N(0, init_method_std²)),
``output_layer_init_method`` (N(0, init_method_std² / (2·num_layers)); multiplier 1 for hybrid
models), ``embedding_init_method`` / ``embedding_init_method_std``, ``moe_ffn_hidden_size``;
``apply_query_key_layer_scaling`` forces ``attention_softmax_in_fp32``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .._fields import _free, _only, _used
from ..model_parallel_config import ModelParallelConfig


def init_method_normal(sigma: float):
    """``init_method`` drawing N(0, sigma²) in place (Megatron's name)."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, (sigma / sqrt(multiplier · num_layers))²): Megatron's residual-output init."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


@dataclass
class TransformerConfig(ModelParallelConfig):
    num_layers: int = _used(0)
    mtp_num_layers: Optional[int] = _only(None)
    mtp_loss_scaling_factor: Optional[float] = _free(0.1)
    num_layers_in_first_pipeline_stage: Optional[int] = _free(None)
    num_layers_in_last_pipeline_stage: Optional[int] = _free(None)
    pipeline_model_parallel_layout: object = _free(None)
    account_for_embedding_in_pipeline_split: bool = _free(False)
    account_for_loss_in_pipeline_split: bool = _free(False)
    hidden_size: int = _used(0)
    num_attention_heads: int = _used(0)
    attention_backend: str = _free('auto')
    softmax_scale: Optional[float] = _free(None)
    softmax_type: str = _free('vanilla')
    num_query_groups: Optional[int] = _used(None)
    ffn_hidden_size: Optional[int] = _used(None)
    kv_channels: Optional[int] = _used(None)
    hidden_dropout: float = _free(0.1)
    attention_dropout: float = _free(0.1)
    fp32_residual_connection: bool = _free(False)
    apply_residual_connection_post_layernorm: bool = _free(False)
    layernorm_epsilon: float = _free(1e-05)
    layernorm_zero_centered_gamma: bool = _free(False)
    add_bias_linear: bool = _free(True)
    add_qkv_bias: bool = _free(False)
    gated_linear_unit: bool = _free(False)
    activation_func: Callable = _free(F.gelu)
    activation_func_fp8_input_store: bool = _only(False)
    glu_linear_offset: float = _free(0.0)
    activation_func_clamp_value: Optional[float] = _free(None)
    num_moe_experts: Optional[int] = _free(None)
    rotary_interleaved: bool = _free(False)
    window_size: Optional[Tuple[int, int]] = _free(None)
    window_attn_skip_freq: Optional[Union[int, List[int]]] = _free(None)
    normalization: str = _free('LayerNorm')
    qk_layernorm: bool = _used(False)
    qk_l2_norm: bool = _free(False)
    qk_clip: bool = _free(False)
    qk_clip_alpha: float = _free(0.5)
    qk_clip_threshold: float = _free(100)
    log_max_attention_logit: bool = _free(False)
    attention_output_gate: bool = _free(False)
    test_mode: bool = _free(False)
    calculate_per_token_loss: bool = _used(False)
    multi_latent_attention: bool = _free(False)
    no_rope_freq: Optional[Union[int, List[int]]] = _free(None)
    experimental_attention_variant: Optional[str] = _free(None)
    dsa_indexer_n_heads: Optional[int] = _free(None)
    dsa_indexer_head_dim: Optional[int] = _free(None)
    dsa_indexer_topk: Optional[int] = _free(None)
    dsa_indexer_loss_coeff: Optional[float] = _free(None)
    dsa_indexer_use_sparse_loss: bool = _free(False)
    linear_attention_freq: Optional[Union[int, List[int]]] = _free(None)
    linear_conv_kernel_dim: Optional[int] = _free(4)
    linear_key_head_dim: Optional[int] = _free(128)
    linear_value_head_dim: Optional[int] = _free(128)
    linear_num_key_heads: Optional[int] = _free(16)
    linear_num_value_heads: Optional[int] = _free(32)
    init_method: Optional[Callable] = _used(None)
    output_layer_init_method: Optional[Callable] = _used(None)
    init_method_std: float = _used(0.02)
    embedding_init_method: Optional[Callable] = _used(None)
    embedding_init_method_std: Optional[float] = _used(None)
    init_model_with_meta_device: bool = _only(False)
    apply_query_key_layer_scaling: bool = _free(False)
    attention_softmax_in_fp32: bool = _free(True)
    disable_bf16_reduced_precision_matmul: bool = _only(False)
    bias_activation_fusion: bool = _free(False)
    masked_softmax_fusion: bool = _free(False)
    persist_layer_norm: bool = _free(False)
    memory_efficient_layer_norm: bool = _free(False)
    bias_dropout_fusion: bool = _free(False)
    apply_rope_fusion: bool = _free(False)
    use_fused_weighted_squared_relu: bool = _free(False)
    fused_single_qkv_rope: bool = _free(False)
    recompute_granularity: Optional[str] = _free(None)
    recompute_method: Optional[str] = _free(None)
    recompute_num_layers: Optional[int] = _free(None)
    distribute_saved_activations: Optional[bool] = _only(False)
    recompute_modules: Optional[List[str]] = _free(None)
    fp8: Optional[str] = _only(None)
    fp8_recipe: Optional[str] = _free('delayed')
    fp8_param: bool = _only(False)
    fp8_quantizer_factory: Optional[str] = _free(None)
    fp8_margin: int = _free(0)
    fp8_interval: int = _free(1)
    fp8_amax_history_len: int = _free(1)
    fp8_amax_compute_algo: str = _free('most_recent')
    fp8_wgrad: bool = _free(True)
    fp8_dot_product_attention: bool = _only(False)
    fp8_multi_head_attention: bool = _only(False)
    tp_only_amax_red: bool = _free(False)
    first_last_layers_bf16: bool = _only(False)
    num_layers_at_start_in_bf16: int = _free(1)
    num_layers_at_end_in_bf16: int = _free(1)
    use_kitchen: bool = _only(False)
    use_kitchen_attention: bool = _only(False)
    kitchen_attention_backend: str = _free('sdpa')
    fp4: Optional[str] = _only(None)
    fp4_recipe: Optional[str] = _free('nvfp4')
    fp4_param: bool = _only(False)
    fp4_quantizer_factory: Optional[str] = _free(None)
    moe_shared_expert_intermediate_size: Optional[int] = _free(None)
    moe_shared_expert_gate: bool = _free(False)
    moe_shared_expert_overlap: bool = _free(False)
    moe_layer_freq: Union[int, List[int]] = _free(1)
    moe_ffn_hidden_size: Optional[int] = _free(None)
    moe_router_load_balancing_type: Union[str, List[str]] = _free('aux_loss')
    moe_router_topk: int = _free(2)
    moe_enable_routing_replay: bool = _free(False)
    moe_router_topk_limited_devices: Optional[int] = _free(None)
    moe_router_padding_for_quantization: Optional[bool] = _free(False)
    moe_router_padding_for_fp8: Optional[bool] = _free(False)
    moe_router_num_groups: Optional[int] = _free(None)
    moe_router_group_topk: Optional[int] = _free(None)
    moe_router_pre_softmax: bool = _free(False)
    moe_router_topk_scaling_factor: Optional[float] = _free(None)
    moe_router_score_function: str = _free('softmax')
    moe_router_dtype: Optional[str] = _free(None)
    moe_router_enable_expert_bias: bool = _free(False)
    moe_router_bias_update_rate: float = _free(0.001)
    moe_router_force_load_balancing: bool = _free(False)
    moe_grouped_gemm: bool = _free(False)
    moe_use_legacy_grouped_gemm: bool = _free(False)
    moe_aux_loss_coeff: Union[float, List[float]] = _free(0.0)
    moe_z_loss_coeff: Optional[float] = _free(None)
    moe_input_jitter_eps: Optional[float] = _free(None)
    moe_token_dropping: bool = _free(False)
    moe_token_dispatcher_type: str = _free('allgather')
    moe_enable_deepep: bool = _only(False)
    moe_flex_dispatcher_backend: str = _free('deepep')
    moe_per_layer_logging: bool = _free(False)
    moe_expert_capacity_factor: Optional[float] = _free(None)
    moe_pad_expert_input_to_capacity: bool = _free(False)
    moe_token_drop_policy: str = _free('probs')
    moe_layer_recompute: bool = _free(False)
    moe_permute_fusion: bool = _free(False)
    moe_router_fusion: bool = _free(False)
    moe_apply_probs_on_input: bool = _free(False)
    moe_latent_size: Optional[int] = _free(None)
    moe_deepep_num_sms: int = _free(20)
    moe_hybridep_num_sms: int = _free(16)
    cp_comm_type: Optional[Union[str, List[str]]] = _free(None)
    enable_cuda_graph: bool = _only(False)
    cuda_graph_use_single_mempool: bool = _free(False)
    cuda_graph_retain_backward_graph: bool = _free(False)
    cuda_graph_warmup_steps: int = _free(3)
    external_cuda_graph: bool = _only(False)
    cuda_graph_impl: str = _only('none')
    cuda_graph_scope: object = _free('full')
    clone_scatter_output_in_embedding: bool = _free(True)
    disable_parameter_transpose_cache: bool = _free(False)
    config_logger_dir: str = _only('')
    flash_decode: bool = _only(False)
    batch_invariant_mode: bool = _only(False)
    use_te_activation_func: bool = _only(False)
    inference_rng_tracker: bool = _only(False)
    inference_sampling_seed: int = _free(42)
    symmetric_ar_type: Optional[str] = _only(None)
    use_inference_optimized_layers: bool = _only(False)
    inference_fuse_tp_communication: bool = _only(False)
    mrope_section: Optional[List[int]] = _free(None)
    is_hybrid_model: bool = _used(False)
    mamba_state_dim: int = _free(128)
    mamba_head_dim: int = _free(64)
    mamba_num_groups: int = _free(8)
    mamba_num_heads: Optional[int] = _free(None)
    use_mamba_mem_eff_path: bool = _free(True)
    mlp_chunks_for_prefill: int = _free(1)
    heterogeneous_block_specs: bool = _free(False)
    hetereogenous_dist_checkpoint: bool = _only(False)
    quant_recipe: object = _only(None)
    transformer_impl: str = _free('transformer_engine')
    fine_grained_activation_offloading: bool = _only(False)
    offload_modules: Optional[list[str]] = _free(factory=list)
    min_offloaded_tensor_size: int = _free(1024 * 1024)

    def __post_init__(self):
        super().__post_init__()
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple "
                             f"of tensor_model_parallel_size={tp}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        groups = self.num_query_groups
        if groups and groups % tp and tp % groups:
            raise ValueError(f"num_query_groups={groups} must be a multiple or a divisor of "
                             f"tensor_model_parallel_size={tp}")
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.expert_model_parallel_size > 1 and self.num_moe_experts is None:
            raise ValueError(f"expert_model_parallel_size={self.expert_model_parallel_size} "
                             "needs num_moe_experts")
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self._derive_init_methods()

    def _derive_init_methods(self):
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            if self.init_method is None or self.embedding_init_method_std != self.init_method_std:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
            else:
                self.embedding_init_method = self.init_method
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None and self.num_layers:
            multiplier = 1.0 if self.is_hybrid_model else 2.0
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers, multiplier)
