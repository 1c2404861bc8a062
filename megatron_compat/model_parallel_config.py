"""``ModelParallelConfig``: megatron-core 0.16's base config of the parallel layers and schedules,
every field with Megatron's name and default (see ``_fields`` for what each field does here).

Derived at construction, as in Megatron: ``expert_tensor_parallel_size`` (= tp),
``autocast_dtype`` (= params_dtype), ``microbatch_group_size_per_vp_stage`` (= pp); pipeline
parallelism needs ``pipeline_dtype``; sequence parallelism needs tp > 1. Errors are ValueErrors
naming the fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._fields import _free, _only, _used, check_default_only


@dataclass
class ModelParallelConfig:
    tensor_model_parallel_size: int = _used(1)
    pipeline_model_parallel_comm_backend: Optional[str] = _only(None)
    pipeline_model_parallel_size: int = _used(1)
    virtual_pipeline_model_parallel_size: Optional[int] = _used(None)
    sequence_parallel: bool = _used(False)
    context_parallel_size: int = _used(1)
    hierarchical_context_parallel_sizes: Optional[list[int]] = _free(None)
    max_seqlen_per_dp_cp_rank: Optional[int] = _free(None)
    hybrid_context_parallel: bool = _only(False)
    expert_model_parallel_size: int = _used(1)
    expert_tensor_parallel_size: Optional[int] = _used(None)
    moe_extended_tp: bool = _only(False)
    perform_initialization: bool = _used(True)
    use_cpu_initialization: bool = _free(False)
    fp16: bool = _used(False)
    bf16: bool = _used(False)
    params_dtype: torch.dtype = _used(torch.float32)
    timers: Optional[Callable] = _used(None)
    finalize_model_grads_func: Optional[Callable] = _used(None)
    grad_scale_func: Optional[Callable] = _used(None)
    no_sync_func: Optional[Callable] = _used(None)
    grad_sync_func: Optional[Callable] = _used(None)
    param_sync_func: Optional[Callable] = _used(None)
    deterministic_mode: bool = _only(False)
    enable_autocast: bool = _used(False)
    autocast_dtype: Optional[torch.dtype] = _used(None)
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = _only(None)
    gradient_accumulation_fusion: bool = _free(False)
    async_tensor_model_parallel_allreduce: bool = _free(True)
    use_te_rng_tracker: bool = _only(False)
    tp_comm_overlap: bool = _only(False)
    tp_comm_bulk_wgrad: bool = _free(True)
    tp_comm_bulk_dgrad: bool = _free(True)
    tp_comm_overlap_ag: bool = _free(True)
    tp_comm_overlap_rs: bool = _free(True)
    tp_comm_overlap_rs_dgrad: bool = _free(False)
    tp_comm_split_ag: bool = _free(True)
    tp_comm_atomic_ag: bool = _free(False)
    tp_comm_split_rs: bool = _free(True)
    tp_comm_atomic_rs: bool = _free(False)
    cross_entropy_loss_fusion: bool = _free(False)
    cross_entropy_fusion_impl: str = _only('native')
    tp_comm_overlap_disable_qkv: bool = _free(False)
    tp_comm_overlap_disable_fc1: bool = _free(False)
    tp_comm_bootstrap_backend: str = _free('nccl')
    overlap_moe_expert_parallel_comm: bool = _only(False)
    delay_wgrad_compute: bool = _only(False)
    ep_overlap_early_attn_memory_release: bool = _free(False)
    pipeline_dtype: Optional[torch.dtype] = _used(None)
    variable_seq_lengths: bool = _only(False)
    overlap_p2p_comm: bool = _only(False)
    batch_p2p_comm: bool = _free(True)
    batch_p2p_sync: bool = _free(True)
    use_ring_exchange_p2p: bool = _only(False)
    deallocate_pipeline_outputs: bool = _free(False)
    defer_embedding_wgrad_compute: bool = _only(False)
    wgrad_deferral_limit: int = _free(0)
    overlap_p2p_comm_warmup_flush: bool = _only(False)
    microbatch_group_size_per_vp_stage: Optional[int] = _used(None)
    mtp_standalone: bool = _only(False)
    cpu_offloading: bool = _only(False)
    cpu_offloading_num_layers: int = _free(0)
    _cpu_offloading_context: object = _only(None)
    cpu_offloading_activations: bool = _free(True)
    cpu_offloading_weights: bool = _free(False)
    cpu_offloading_double_buffering: bool = _free(False)
    barrier_with_L1_time: bool = _free(True)

    def __post_init__(self):
        check_default_only(self)
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1 "
                             f"(got {self.tensor_model_parallel_size})")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}"
                             " needs pipeline_dtype (the dtype of activations between stages)")
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True are mutually exclusive")
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
