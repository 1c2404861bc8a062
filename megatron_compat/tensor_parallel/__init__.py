"""megatron-core 0.16's ``tensor_parallel`` package on tpfuse (see each module)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     copy_tensor_model_parallel_attributes,
                     linear_with_frozen_weight,
                     linear_with_grad_accumulation_and_async_allreduce,
                     param_is_not_tensor_parallel_duplicate,
                     set_defaults_if_not_set_tensor_model_parallel_attributes,
                     set_tensor_model_parallel_attributes)
from .mappings import (all_gather_last_dim_from_tensor_parallel_region, all_to_all,
                       all_to_all_hp2sp, all_to_all_sp2hp, copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_scatter_last_dim_to_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .random import (CheckpointWithoutOutput, CudaRNGStatesTracker, checkpoint,
                     convert_cuda_rng_state,
                     get_cuda_rng_tracker, get_data_parallel_rng_tracker_name,
                     get_expert_parallel_rng_tracker_name, is_graph_safe_cuda_rng_tracker,
                     model_parallel_cuda_manual_seed)
from .utils import (VocabUtility, gather_split_1d_tensor, split_tensor_along_last_dim,
                    split_tensor_into_1d_equal_chunks)

__all__ = [
    "vocab_parallel_cross_entropy", "broadcast_data", "ColumnParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate",
    "linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region", "all_to_all", "all_to_all_sp2hp",
    "all_to_all_hp2sp", "checkpoint", "convert_cuda_rng_state", "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed", "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name", "is_graph_safe_cuda_rng_tracker",
    "CudaRNGStatesTracker", "CheckpointWithoutOutput", "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
    "gather_split_1d_tensor", "VocabUtility",
]
