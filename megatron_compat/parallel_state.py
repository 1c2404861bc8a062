"""megatron-core 0.16's ``parallel_state`` module: tpfuse's facade
(``tpfuse.parallel.parallel_state``) with Megatron's ``initialize_model_parallel`` signature —
every argument positional in Megatron's order — returning None as Megatron does.
"""
from __future__ import annotations

from tpfuse.parallel import parallel_state as _facade
from tpfuse.parallel.parallel_state import *  # noqa: F401,F403  (Megatron's names)
from tpfuse.parallel.parallel_state import (  # noqa: F401  (names * does not export)
    GlobalMemoryBuffer, ModelParallelNotInitializedError, RankGenerator)


def initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_comm_backend=None,
        use_sharp=False, context_parallel_size=1, hierarchical_context_parallel_sizes=None,
        hybrid_context_parallel=False, expert_model_parallel_size=1,
        num_distributed_optimizer_instances=1, expert_tensor_parallel_size=None,
        nccl_communicator_config_path=None, distributed_timeout_minutes=30,
        order="tp-cp-ep-dp-pp", get_embedding_ranks=None, get_position_embedding_ranks=None,
        create_gloo_process_groups=True, high_priority_stream_groups=None,
        sharp_enabled_group=None, create_all_gather_group=False) -> None:
    """Build every group and make it the default ParallelState (see the tpfuse facade)."""
    _facade.initialize_model_parallel(
        tensor_model_parallel_size, pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp, context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        hybrid_context_parallel=hybrid_context_parallel,
        expert_model_parallel_size=expert_model_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        nccl_communicator_config_path=nccl_communicator_config_path,
        distributed_timeout_minutes=distributed_timeout_minutes, order=order,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=create_gloo_process_groups,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group, create_all_gather_group=create_all_gather_group)
