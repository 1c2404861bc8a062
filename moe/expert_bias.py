"""Aux-loss-free load balancing: the step's update of the routers' expert bias (DeepSeek-V3;
Megatron-core's ``_update_router_expert_bias`` in ``finalize_model_grads``).

For every MoE layer, with ``n_e`` the tokens routed to expert e over the whole global batch — every
micro-batch of the step on every rank of the pipeline stage: tp (each rank its s/tp tokens under
sequence parallelism) × cp × dp (expert parallelism lies inside dp) —

    bias_e ← bias_e + rate · sign(mean_e' n_e' − n_e)

so an under-loaded expert gains ``rate``, an over-loaded one loses it, one at the mean keeps its
bias. The per-rank counts of all the stage's MoE layers (``TopKRouter.local_tokens_per_expert``)
are stacked and all-reduced once over the stage's ``tp-dp-cp`` group; every rank then applies the
same step to the same bias, so it stays equal on every rank and in every layout. The counts are
zeroed for the next step. Counts are fp32 integers: exact below 2²⁴ tokens per expert and step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.mappings import group_size

from .router import TopKRouter


def biased_routers(model_chunks) -> list[TopKRouter]:
    """The routers of the chunks that carry an expert bias, in module order."""
    return [module for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, TopKRouter) and module.expert_bias is not None]


def bias_step(tokens_per_expert, rate: float):
    """``rate · sign(mean(n) − n)`` along the last (expert) dim."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return torch.sign(mean - tokens_per_expert) * rate


@torch.no_grad()
def update_expert_biases(model_chunks, rate: float, group=None) -> None:
    """One step of every biased router of ``model_chunks`` from its global counts (a collective
    over ``group``, the stage's tp-dp-cp ranks, when it has more than one; none on a stage
    without biased routers, as every rank of a stage holds the same layers)."""
    routers = biased_routers(model_chunks)
    if not routers:
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])   # (layers, E)
    if group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    step = bias_step(counts, rate)
    for router, layer_step in zip(routers, step):
        router.expert_bias.add_(layer_step)
        router.local_tokens_per_expert.zero_()
