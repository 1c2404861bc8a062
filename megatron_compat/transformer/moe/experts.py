"""megatron-core 0.16's ``transformer.moe.experts`` names: ``GroupedMLP`` (one grouped GEMM,
``moe_grouped_gemm=True``) and ``SequentialMLP`` (a loop over the local experts); tpfuse's
``moe.experts.GroupedExperts`` computes both. ``experts_sharded_state_dict`` gives its weights in
Megatron's torch_dist layout (both expert modules write the same tensors)::

    <prefix>experts.experts.linear_fc1.weight   (num_layers, E, F1, h)   F1 = 2F gated: [gate; up]
    <prefix>experts.experts.linear_fc1.bias     (num_layers, E, F1)
    <prefix>experts.experts.linear_fc2.weight   (num_layers, E, h, F)
    <prefix>experts.experts.linear_fc2.bias     (num_layers, E, h)
    <prefix>experts.experts.linear_fc{1,2}._extra_state   objects on (num_layers, E)

tpfuse's stacked ``weight1 (L, h, F1/etp)`` / ``weight2 (L, F/etp, h)`` (L = E/ep local experts
from ep rank · L) are transposed to Megatron's (out, in) per expert. SequentialMLP stores every
expert as its own chunk (the expert axis prepended, size 1); GroupedMLP stores the L experts of
an ep rank as one chunk (the expert axis cut over ep) — the same global tensors, so either
loads into either. fc1 is cut over etp with stride 2 when gated (``strided_pieces``), fc2 by
its input columns; what etp does not cut is replicated over etp (replica id (0, etp rank, edp
rank)), the cut pieces over expert data parallel (0, 0, edp rank).
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
