"""Mixture of experts: the MoE layer, its router and losses, token dispatch across expert-parallel
ranks, and the grouped experts (Megatron-core's ``transformer/moe`` rebuilt on tpfuse's layers and
kernels).
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "MoELayer": "layer",
    "TopKRouter": "router",
    "GroupedExperts": "experts",
    "SharedExpertMLP": "shared_experts",
    "AllGatherDispatcher": "dispatcher",
    "AlltoAllDispatcher": "dispatcher",
    "RouterLossTracker": "aux_losses",
    "MoEGroups": "groups",
    "topk_routing": "routing",
    "apply_capacity": "routing",
    "update_expert_biases": "expert_bias",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
