"""TopKRouter: the gate of an MoE layer — a linear map to expert logits, top-k routing, the
optional capacity, and the router losses (see ``routing.py`` and ``aux_losses.py``).

    hidden (s/tp, b, h) ─ logits = x Wᵀ (T, E) ─┬ z-loss (attached to the logits)
                                                ├ top-k routing [→ capacity]  → probs, routing_map
                                                └ load-balancing loss (attached to the probs)

``W (E, h)`` is replicated. Under sequence parallelism each TP rank routes its own tokens, so W
enters through ``copy_to_region`` (its gradient is all-reduced over TP inside autograd; marked
``sequence_parallel = True``, like the norm weights). The losses are computed only in training
with gradients enabled, as Megatron-core does, and logged when their gradient is injected; they
see the micro-batch's tokens across the sequence partition group (``tp-cp``).

Aux-loss-free balancing (``moe_router_enable_expert_bias``, sigmoid scores): ``expert_bias (E,)``,
a persistent fp32 buffer (saved in checkpoints, never seen by the optimizer), is added to the
scores for the choice of the top-k only; ``local_tokens_per_expert (E,)`` (not saved) adds up the
tokens this rank routed to each expert (after any capacity dropping) over the training forwards of
a step, once per micro-batch whatever recompute re-runs. ``expert_bias.update_expert_biases``
turns the step's global counts into the bias step and zeroes them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.parallel.mappings import copy_to_region
from tpfuse.tp_layers.init import draw_master_weight, normal_init

from . import aux_losses
from .routing import apply_capacity, scores_for_aux_loss, topk_routing

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(nn.Module):
    def __init__(self, config, groups, layer_number: int, tracker):
        super().__init__()
        self.config, self.groups = config, groups
        self.layer_number, self.tracker = layer_number, tracker
        self.topk = config.moe_router_topk
        master = draw_master_weight(config.num_moe_experts, config.hidden_size,
                                    normal_init(config.init_method_std), config.params_dtype)
        self.weight = nn.Parameter(master)                                    # (E, h)
        self.weight.tensor_model_parallel = False
        self.weight.partition_dim, self.weight.partition_stride = None, 1
        self.weight.sequence_parallel = config.sequence_parallel
        if config.moe_router_enable_expert_bias:
            experts = config.num_moe_experts
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    def gating(self, tokens):
        """Router logits (T, E) in the router dtype (default: the tokens' dtype)."""
        weight = self.weight
        if self.config.sequence_parallel and self.groups.tp_size > 1:
            weight = copy_to_region(weight, self.groups.tp)     # backward: all-reduce over TP
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, tokens.dtype)
        return F.linear(tokens.to(dtype), weight.to(dtype))

    def forward(self, hidden):
        """``hidden (s_local, b, h)`` → ``probs (T, E)``, ``routing_map (T, E)`` bool."""
        seq_local, batch, _ = hidden.shape
        logits = self.gating(hidden.reshape(seq_local * batch, -1))           # (T, E)
        losses_on = self.training and torch.is_grad_enabled()
        c = self.config
        if losses_on and c.moe_z_loss_coeff:
            logits = self._z_loss(logits)
        probs, routing_map = topk_routing(
            logits, self.topk, c.moe_router_score_function, c.moe_router_pre_softmax,
            c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
            self.expert_bias)
        if losses_on and c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff:
            probs = self._load_balancing_loss(logits, probs, batch)
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map, _ = apply_capacity(probs, routing_map, self.topk,
                                                   c.moe_expert_capacity_factor,
                                                   c.moe_token_drop_policy)
        if self.training:
            self.tracker.record_tokens(self.layer_number, routing_map.sum(dim=0))
            self._count_for_expert_bias(routing_map)
        return probs, routing_map

    @torch.no_grad()
    def _count_for_expert_bias(self, routing_map):
        """local_tokens_per_expert += this micro-batch's routed tokens (not for a forward that
        activation recompute re-runs in backward: counted already)."""
        if self.local_tokens_per_expert is not None and not aux_losses.in_backward():
            self.local_tokens_per_expert += routing_map.sum(dim=0)

    # ---------------------------------------------------------------- the losses
    def _total_tokens(self, local_tokens: int) -> int:
        return local_tokens * self.groups.seq_partition_size

    def _z_loss(self, logits):
        coeff = self.config.moe_z_loss_coeff
        loss = aux_losses.z_loss(logits, self._total_tokens(logits.shape[0]), coeff)
        return aux_losses.attach_loss(logits, loss, self.tracker, "z_loss", self.layer_number,
                                      coeff)

    def _load_balancing_loss(self, logits, probs, batch: int):
        c = self.config
        coeff = c.moe_aux_loss_coeff
        scores, topk_map = scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)
        group = self.groups.seq_partition
        if c.moe_router_load_balancing_type == "aux_loss":
            counts = aux_losses.all_reduce_counts(topk_map.sum(dim=0), group)
            loss = aux_losses.switch_load_balancing_loss(
                scores, counts, self._total_tokens(scores.shape[0]), self.topk, coeff)
        else:  # seq_aux_loss
            scores_full = aux_losses.gather_sequence(scores.view(-1, batch, scores.shape[1]),
                                                     group, self.groups.options)
            loss = aux_losses.sequence_load_balancing_loss(
                scores_full, topk_map.view(-1, batch, scores.shape[1]), batch, self.topk, coeff)
        return aux_losses.attach_loss(probs, loss, self.tracker, "load_balancing_loss",
                                      self.layer_number, coeff)
