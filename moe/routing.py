"""Top-k routing as pure functions of the router logits (Megatron-core's semantics).

``logits (T, E)`` → ``probs (T, E)`` (0 outside each token's chosen experts) and ``routing_map
(T, E)`` bool:

  softmax, default        top-k of the logits, then a softmax over those k
  softmax, pre_softmax    softmax over all E, then its top-k (probabilities not renormalised)
  sigmoid                 σ(logits), top-k, renormalised to sum 1 when k > 1
  sigmoid + expert_bias   the top-k (and the groups) chosen by σ(logits) + bias (E,), the
                          weights the unbiased σ of the chosen experts, renormalised as above
                          (aux-loss-free balancing; DeepSeek-V3's e_score_correction_bias)
  group-limited           experts in ``num_groups`` equal groups; a group's score is the sum of
                          its top k/group_topk scores; only the best ``group_topk`` groups compete
  scaling_factor          multiplies the chosen probabilities

Capacity (``capacity_factor``): each expert keeps at most C = ⌈T·k/E · factor⌉ of the tokens
routed to it — those with the highest probability (``"probs"``) or the first ones (``"position"``);
the others lose that expert (their probability there becomes 0). With C ≥ T nothing is dropped. The
capacity is per rank, over the rank's own tokens (as in Megatron-core).
"""
from __future__ import annotations

import math

import torch


def _compute_dtype(logits):
    """fp32 at least (fp64 router logits stay fp64)."""
    return torch.promote_types(logits.dtype, torch.float32)


def scores_of(logits, score_function: str):
    """Scores over all experts in fp32 or wider: softmax, or σ (unnormalised)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=_compute_dtype(logits))
    return torch.sigmoid(logits.to(_compute_dtype(logits)))


def _group_limited_topk(scores, topk: int, num_groups: int, group_topk: int):
    """Top-k restricted to each token's best ``group_topk`` expert groups."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)     # (T, groups)
    best = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    allowed = allowed[:, :, None].expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return _group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def topk_routing(logits, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias=None):
    """``(probs (T, E), routing_map (T, E) bool)``; probs in the logits' dtype (see above).
    ``expert_bias`` (E,) fp32: sigmoid scores only (the config refuses it elsewhere)."""
    if score_function == "softmax" and not pre_softmax:
        top_logits, indices = _topk(logits, topk, num_groups, group_topk)
        chosen = torch.softmax(top_logits, dim=-1, dtype=_compute_dtype(logits))   # (T, k)
    else:
        scores = scores_of(logits, score_function)
        if expert_bias is None:
            chosen, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            _, indices = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups,
                               group_topk)
            chosen = scores.gather(1, indices)
        if score_function == "sigmoid" and topk > 1:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        chosen = chosen * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, chosen.to(logits.dtype))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def scores_for_aux_loss(logits, topk: int, score_function: str):
    """The load-balancing loss's view: ``(scores (T, E) fp32, topk_map (T, E) bool)`` with
    softmax scores, or sigmoid scores normalised per token; the map is their plain top-k."""
    scores = scores_of(logits, score_function)
    if score_function == "sigmoid":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """C = ⌈tokens·k / experts · factor⌉."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(probs, routing_map, topk: int, capacity_factor: float,
                   drop_policy: str = "probs"):
    """Drop the tokens over each expert's capacity: ``(probs, routing_map, capacity)``."""
    num_tokens, num_experts = routing_map.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity >= num_tokens:
        return probs, routing_map, capacity
    if drop_policy == "probs":
        order = probs.detach().float().masked_fill(~routing_map, -1.0)
        keep = order.topk(capacity, dim=0).indices                              # (C, E)
        within = torch.zeros_like(routing_map).scatter(0, keep, True)
    else:  # "position": the first C routed tokens in token order
        within = routing_map.long().cumsum(dim=0) <= capacity
    kept = routing_map & within
    return probs * kept, kept, capacity
