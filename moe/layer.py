"""MoELayer: the MLP block of a transformer layer as a mixture of experts (Megatron-core's MoELayer).

    hidden (s/tp, b, h) ─ router → probs, routing_map (T, E)          T = s/tp · b tokens here
                        ─ dispatcher.dispatch → rows of my local experts
                        ─ GroupedExperts → their outputs
                        ─ dispatcher.combine (weighted by probs) → (T, h)
                        [+ shared expert: a dense MLP every token goes through, optionally
                           gated by σ(x w_gᵀ) (``shared_experts.py``)]
                        (--moe-shared-expert-overlap, alltoall: the shared expert runs
                         between begin_dispatch and end_dispatch, while the all-to-all travels;
                         the same sum, so the same output)
                        → (s/tp, b, h), returned as ``(output, None)`` like ParallelMLP

Under tensor parallelism the layer requires sequence parallelism (as Megatron-core): each TP rank
routes its own s/tp tokens. The expert-parallel (ep), expert-tensor-parallel (etp) and sequence
partition (tp × cp) groups come from the ParallelState (``groups.py``).

Construction order of the master draws (under the caller's seeded generator): router weight,
experts' fc1, fc2, then the shared expert's fc1, fc2 and its gate.
"""
from __future__ import annotations

import math

from torch import nn

from .dispatcher import AllGatherDispatcher, AlltoAllDispatcher
from .experts import GroupedExperts
from .groups import MoEGroups
from .router import TopKRouter
from .shared_experts import SharedExpertMLP


def build_dispatcher(config, groups):
    if config.moe_token_dispatcher_type == "alltoall":
        return AlltoAllDispatcher(groups, config.num_moe_experts, config.moe_router_topk,
                                  config.moe_expert_capacity_factor,
                                  config.moe_pad_expert_input_to_capacity)
    return AllGatherDispatcher(groups, config.num_moe_experts, config.moe_router_topk)


class MoELayer(nn.Module):
    """``MoELayer(config, layer_number, tracker, state=None)``: ``config`` a TransformerConfig with
    ``num_moe_experts`` set; ``layer_number`` the global layer index (for the loss log);
    ``tracker`` the chunk's ``RouterLossTracker``."""

    def __init__(self, config, layer_number: int, tracker, state=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.groups = MoEGroups.from_state(state)
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.router = TopKRouter(config, self.groups, layer_number, tracker)
        self.experts = GroupedExperts(config, self.groups, output_layer_init_std=output_std,
                                      grouped=config.moe_grouped_gemm)
        self.dispatcher = build_dispatcher(config, self.groups)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, self.groups,
                                                  output_layer_init_std=output_std)
        self.overlap_shared_expert = (self.shared_experts is not None
                                      and config.moe_shared_expert_overlap)

    def forward(self, hidden):
        """``hidden (s_local, b, h)`` → ``(output (s_local, b, h), None)``."""
        probs, routing_map = self.router(hidden)                            # (T, E) each
        tokens = hidden.reshape(-1, hidden.shape[-1])                        # (T, h)
        shared = None
        if self.overlap_shared_expert:
            begun = self.dispatcher.begin_dispatch(tokens, probs, routing_map)
            shared = self.shared_experts(hidden)              # while the all-to-all travels
            rows, tokens_per_expert, plan = self.dispatcher.end_dispatch(begun)
        else:
            rows, tokens_per_expert, plan = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_rows = self.experts(rows, tokens_per_expert)
        output = self.dispatcher.combine(expert_rows, plan).view_as(hidden)
        if self.shared_experts is not None:
            output = output + (self.shared_experts(hidden) if shared is None else shared)
        return output, None
