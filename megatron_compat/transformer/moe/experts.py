"""megatron-core 0.16's ``transformer.moe.experts`` names: ``GroupedMLP`` (one grouped GEMM,
``moe_grouped_gemm=True``) and ``SequentialMLP`` (a loop over the local experts); tpfuse's
``moe.experts.GroupedExperts`` computes both. ``experts_sharded_state_dict`` gives its weights in
Megatron's torch_dist layout, both expert modules writing the same tensors (the layout and how
tpfuse's stacked weights map onto it: ``checkpoint/dist/gpt_layout.py``).
"""
from tpfuse.checkpoint.dist.gpt_layout import (  # noqa: F401 (megatron-core's module of these)
    expert_coordinates, experts_extra_state_objects, experts_sharded_state_dict)

from ..attention import _BuiltByTheLayer


class GroupedMLP(_BuiltByTheLayer):
    pass


class TEGroupedMLP(_BuiltByTheLayer):
    def __init__(self, *args, **kwargs):
        raise ValueError("TEGroupedMLP needs Transformer Engine, which tpfuse does not use; use "
                         "get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=True)")


class SequentialMLP(_BuiltByTheLayer):
    pass
