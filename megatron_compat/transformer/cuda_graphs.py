"""megatron-core 0.16's ``transformer.cuda_graphs``: the names user code imports. tpfuse does
not capture CUDA graphs; the schedule-order helpers raise, naming the feature."""
from __future__ import annotations


def _not_implemented(name):
    def helper(*args, **kwargs):
        raise ValueError(f"transformer.cuda_graphs.{name}: CUDA-graph capture is not "
                         "implemented by tpfuse")
    helper.__name__ = name
    return helper


convert_schedule_table_to_order = _not_implemented("convert_schedule_table_to_order")
get_overlap_moe_expert_parallel_comm_order = _not_implemented(
    "get_overlap_moe_expert_parallel_comm_order")
