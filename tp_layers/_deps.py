"""The shared pieces tp_layers is built on: communication mappings and kernels.

One import site, so every layer calls exactly the collectives of ``tpfuse.parallel.mappings`` and
the ops of ``tpfuse.kernels`` (no copies of either live in tp_layers).
"""
from tpfuse.kernels.ag_matmul import all_gather_matmul
from tpfuse.kernels.bias_dropout_add import bias_dropout_add
from tpfuse.kernels.cross_entropy import (cross_entropy, cross_entropy_loss_from_stats,
                                          cross_entropy_shard_grad, cross_entropy_shard_stats)
from tpfuse.kernels.flash_attention import (MAX_HEAD_DIM, MIN_HEAD_DIM, attention_backward,
                                           attention_forward, flash_attention, merge_attention)
from tpfuse.kernels.flash_attention_mask import AttentionMask
from tpfuse.kernels.flash_attention_reference import (explicit_backward, explicit_forward,
                                                     explicit_probs, repeat_kv)
from tpfuse.kernels.layer_norm import layer_norm
from tpfuse.kernels.matmul import matmul
from tpfuse.kernels.matmul_rs import matmul_reduce_scatter
from tpfuse.kernels.philox import (AttentionDropout, RowCoordinates, attention_keep_mask,
                                   dropout_key, hidden_keep_mask)
from tpfuse.kernels.rms_norm import rms_norm
from tpfuse.kernels.wgrad import linear_with_grad_accumulation
from tpfuse.parallel.mappings import (copy_many_to_region, copy_to_region, gather_from_region,
                                      gather_from_sequence_parallel_region, reduce_from_region,
                                      reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_region, scatter_to_sequence_parallel_region)

__all__ = [
    "all_gather_matmul", "AttentionMask", "attention_backward", "explicit_backward",
    "explicit_forward", "explicit_probs", "repeat_kv", "attention_forward", "bias_dropout_add",
    "cross_entropy", "cross_entropy_loss_from_stats", "cross_entropy_shard_grad",
    "cross_entropy_shard_stats", "MAX_HEAD_DIM", "MIN_HEAD_DIM", "flash_attention", "layer_norm",
    "merge_attention", "AttentionDropout", "RowCoordinates", "attention_keep_mask", "dropout_key", "hidden_keep_mask",
    "linear_with_grad_accumulation", "matmul", "matmul_reduce_scatter", "rms_norm", "copy_to_region", "copy_many_to_region", "gather_from_region",
    "gather_from_sequence_parallel_region", "reduce_from_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_region",
    "scatter_to_sequence_parallel_region",
]
