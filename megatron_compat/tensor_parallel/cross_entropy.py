"""megatron-core 0.16's ``vocab_parallel_cross_entropy(vocab_parallel_logits, target,
label_smoothing=0.0)`` over the default tensor-parallel group.

Without smoothing it is tpfuse's fused vocab-parallel loss. With smoothing ε over V classes
(Megatron's rule: s = ε·V/(V − 1)) the loss is (1 − s)·CE − s·mean_v log p_v, i.e. with
lse = log Σ exp(x), x_t the target logit and x̄ the mean logit,

    loss = lse − (1 − s)·x_t − s·x̄

computed from three TP reductions (max, Σ exp, and the stacked Σ x / target logit).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.mappings import group_rank, group_size, reduce_from_region
from tpfuse.parallel.mappings import default_tensor_parallel_group as _tp
from tpfuse.tp_layers.loss import vocab_parallel_cross_entropy as _native


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token loss (target's shape, fp32) from ``(s, b, V/tp)`` logits and ``(s, b)`` ids."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    group = _tp()
    if label_smoothing == 0.0:
        return _native(vocab_parallel_logits, target, group=group)
    return _smoothed(vocab_parallel_logits.float(), target, label_smoothing, group)


def _smoothed(logits, target, label_smoothing, group):
    tp = group_size(group)
    local_vocab = logits.shape[-1]
    vocab = local_vocab * tp
    start = group_rank(group) * local_vocab
    row_max = logits.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max.unsqueeze(-1)                          # (s, b, V/tp)
    local = target - start
    inside = (local >= 0) & (local < local_vocab)
    picked = shifted.gather(-1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = picked * inside                                         # x_t − max on its owner
    stats = torch.stack([shifted.exp().sum(-1), picked, shifted.sum(-1)])
    stats = reduce_from_region(stats, group) if tp > 1 else stats    # forward sum, grad identity
    sum_exp, target_logit, logit_sum = stats
    smoothing = label_smoothing * vocab / (vocab - 1)
    return sum_exp.log() - (1.0 - smoothing) * target_logit - smoothing * logit_sum / vocab
