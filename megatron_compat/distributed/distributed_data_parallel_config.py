"""megatron-core 0.16's ``DistributedDataParallelConfig``: every field with Megatron's name and
default, and what tpfuse's gradient buffers (``tpfuse.training.data_parallel``) do with it
(``_fields``: used / free / default-only).

``overlap_grad_reduce`` is accepted and met without overlap: the buckets are reduced at
``finish_grad_sync`` after the backward passes (the same sums). ``average_in_collective`` is
free: tpfuse always scales by 1/dp before a sum, the same average.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._fields import _free, _only, _used, check_default_only


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = _used(False)
    overlap_grad_reduce: bool = _free(False)
    overlap_param_gather: bool = _used(False)
    align_param_gather: bool = _free(False)
    use_distributed_optimizer: bool = _used(False)
    num_distributed_optimizer_instances: int = _only(1)
    check_for_nan_in_grad: bool = _only(False)
    check_for_large_grads: bool = _only(False)
    bucket_size: Optional[int] = _used(None)
    pad_buckets_for_high_nccl_busbw: bool = _free(False)
    reduce_scatter_with_fp32_accumulation: bool = _only(False)
    average_in_collective: bool = _free(False)
    fp8_param_gather: bool = _only(False)
    reuse_grad_buf_for_mxfp8_param_ag: bool = _only(False)
    use_megatron_fsdp: bool = _only(False)
    use_custom_fsdp: bool = _only(False)
    data_parallel_sharding_strategy: str = _only('no_shard')
    gradient_reduce_div_fusion: bool = _free(True)
    suggested_communication_unit_size: int = _free(None)
    preserve_fp32_weights: bool = _free(True)
    keep_fp8_transpose_cache: bool = _free(False)
    nccl_ub: bool = _only(False)
    fsdp_double_buffer: bool = _only(False)
    outer_dp_sharding_strategy: str = _only('no_shard')
    disable_symmetric_registration: bool = _free(False)
    fsdp_manual_registration: bool = _only(False)
    delay_wgrad_compute: bool = _only(False)

    def __post_init__(self):
        check_default_only(self)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 elements, got {self.bucket_size}")

    def to_native(self):
        """tpfuse's DistributedDataParallelConfig (training.data_parallel)."""
        from tpfuse.training.data_parallel import DistributedDataParallelConfig as Native

        return Native(grad_reduce_in_fp32=self.grad_reduce_in_fp32, overlap_grad_reduce=False,
                      overlap_param_gather=self.overlap_param_gather,
                      use_distributed_optimizer=self.use_distributed_optimizer,
                      bucket_size=self.bucket_size)
