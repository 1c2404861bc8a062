"""The router's auxiliary losses and how their gradients enter the backward pass.

Over the T tokens of one micro-batch (B sequences of S tokens), E experts, top-k routing, with
``p(t, e)`` the router's scores (softmax over all experts, or sigmoid normalised per token) and
``n_e`` the tokens whose top-k of those scores holds e (before any capacity dropping):

    aux_loss      = coeff · E/(k·T²) · Σ_e (Σ_t p(t, e)) · n_e                  (Switch Transformer)
    seq_aux_loss  = coeff · (1/B) Σ_b Σ_e  E·n_{b,e}/(k·S) · (1/S) Σ_s p(b, s, e)     (per sequence)
    z_loss        = coeff · (1/T) Σ_t logsumexp_e(logit(t, e))²                  (ST-MoE)

The micro-batch's tokens may be split over the ranks of a *sequence partition group* (sequence
parallelism over tp, context parallelism over cp: the ``tp-cp`` group). Each rank then computes a
partial whose sum over the group is the loss above:

    aux partial_r  = coeff·E/(k·T²) · Σ_e (Σ_{t on r} p(t, e)) · n_e    n_e all-reduced (no grad)
    seq partial_r  = coeff/B · Σ_b Σ_e E·n^r_{b,e}/(k·S) · p̄(b, e)      p̄: the full-sequence mean,
                                                                       from all-gathered scores
    z partial_r    = coeff/T · Σ_{t on r} lse(t)²

and the gradients the ranks inject (d partial_r; for seq through the all-gather, whose backward
reduce-scatters) add up to the gradient of the full loss. Megatron-core computes the same
quantities (its z-loss divides the coefficient by the group size and averages locally: equal).

Backward injection (Megatron's MoEAuxLossAutoScaler): ``attach_loss(x, loss, tracker, name,
layer, coeff)`` returns x unchanged; in backward it hands ``loss`` the gradient
``tracker.backward_scale`` — the scale of the main loss: 1/m with m micro-batches (the pipeline
executor sets it through ``GPTModel.set_aux_loss_scale``) times the loss scaler's scale when there
is one (the trainer sets it through ``GPTModel.set_aux_loss_grad_scale``) — so the router loss
joins the step's gradient exactly like the language-model loss, wherever the pipeline schedule runs
the layer's backward. The loss is recorded for the log (``loss / coeff``) at that moment too: once
per micro-batch and layer whatever activation recompute does (a checkpoint that runs the forward
without a graph computes the loss only in its recompute; one that keeps the forward's graph
recomputes a loss nobody back-propagates).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.mappings import gather_from_sequence_parallel_region, group_size

LOSS_NAMES = ("load_balancing_loss", "z_loss")


def switch_load_balancing_loss(probs, tokens_per_expert, total_tokens: int, topk: int,
                               coeff: float):
    """``coeff·E/(k·T²)·Σ_e (Σ_t probs[t, e])·n_e``; probs (T_local, E) fp32, n (E,)."""
    num_experts = probs.shape[1]
    per_expert = probs.sum(dim=0)                                          # (E,)
    scale = num_experts * coeff / (topk * total_tokens * total_tokens)
    return (per_expert * tokens_per_expert.to(per_expert.dtype)).sum() * scale


def sequence_load_balancing_loss(probs_full, routing_map, batch_size: int, topk: int,
                                 coeff: float):
    """Per-sequence balance: ``probs_full (S, B, E)`` over the whole sequence, ``routing_map
    (S_local, B, E)`` this rank's tokens; the rank's partial (see the module docstring)."""
    seq, _, num_experts = probs_full.shape
    counts = routing_map.sum(dim=0, dtype=torch.float32)                   # (B, E)
    cost = counts * (num_experts / (topk * seq))
    return (cost * probs_full.mean(dim=0)).sum(dim=1).sum() * (coeff / batch_size)


def z_loss(logits, total_tokens: int, coeff: float):
    """``coeff/T · Σ_t lse(logits[t])²`` over this rank's rows (T: the micro-batch's tokens)."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return lse.square().sum() * (coeff / total_tokens)


def all_reduce_counts(tokens_per_expert, group):
    """n_e summed over the sequence partition group (a forward-only collective)."""
    if group_size(group) > 1:
        tokens_per_expert = tokens_per_expert.clone()
        dist.all_reduce(tokens_per_expert, group=group)
    return tokens_per_expert


def gather_sequence(probs, group, options=None):
    """(S_local, B, E) → (S, B, E) over the sequence partition group; backward reduce-scatters
    (as ``options`` says)."""
    return gather_from_sequence_parallel_region(probs, group, options=options)


# ----------------------------------------------------------------------------- backward injection

class _AttachLoss(torch.autograd.Function):
    """forward: x (the loss only rides along); backward: dx, d loss = tracker.backward_scale,
    and the loss recorded."""

    @staticmethod
    def forward(ctx, x, loss, tracker, name, layer, coeff):
        ctx.tracker, ctx.name, ctx.layer = tracker, name, layer
        ctx.value = loss.detach() / coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        ctx.tracker.record(ctx.name, ctx.layer, ctx.value)
        scale = torch.full((), ctx.tracker.backward_scale, dtype=torch.float32, device=dx.device)
        return dx, scale, None, None, None, None


def attach_loss(x, loss, tracker, name: str, layer: int, coeff: float):
    """``x``, with ``loss`` differentiated (scaled by ``tracker.backward_scale``) in x's backward,
    where ``loss / coeff`` is also recorded as ``tracker.values[name][layer]``."""
    return _AttachLoss.apply(x, loss, tracker, name, layer, coeff)


# ----------------------------------------------------------------------------- tracking

def in_backward() -> bool:
    """True while autograd runs a backward pass (activation recompute re-runs forwards there)."""
    return torch._C._current_graph_task_id() != -1


class RouterLossTracker:
    """One per model chunk, shared by its MoE layers: the backward scale of the router losses
    (``backward_scale`` = ``loss_scale``, 1/m, × ``grad_scale``, the loss scaler's, ×
    ``context_parallel_size``) and, for logging, summed over the micro-batches of the step and kept
    per global layer (detached): each loss's partial divided by its coefficient
    (``values[name][layer]``) and the tokens this rank routed to each expert after any capacity
    dropping (``tokens_per_expert[layer]``, (E,)).

    The cp factor matches the trainer's main loss under context parallelism: each cp rank
    back-propagates cp · (its share of the sequence's loss) and the gradients are averaged over
    dp·cp, so a loss whose partials over the cp ranks sum to L must be back-propagated as cp ·
    partial to reach ∇L (Megatron scales its aux losses by the cp size likewise)."""

    def __init__(self, context_parallel_size: int = 1):
        self.loss_scale = 1.0
        self.grad_scale = 1.0
        self.context_parallel_size = context_parallel_size
        self.values: dict[str, dict[int, torch.Tensor]] = {}
        self.tokens_per_expert: dict[int, torch.Tensor] = {}

    def set_loss_scale(self, scale: float) -> None:
        self.loss_scale = float(scale)

    def set_grad_scale(self, scale: float) -> None:
        self.grad_scale = float(scale)

    @property
    def backward_scale(self) -> float:
        return self.loss_scale * self.grad_scale * self.context_parallel_size

    def record(self, name: str, layer: int, value: torch.Tensor) -> None:
        per_layer = self.values.setdefault(name, {})
        value = value.detach().float()
        per_layer[layer] = per_layer[layer] + value if layer in per_layer else value

    def record_tokens(self, layer: int, counts: torch.Tensor) -> None:
        if in_backward():
            return        # a forward re-run by activation recompute: counted already
        counts = counts.detach().float()
        previous = self.tokens_per_expert.get(layer)
        self.tokens_per_expert[layer] = counts if previous is None else previous + counts

    def clear(self) -> None:
        self.values = {}
        self.tokens_per_expert = {}
