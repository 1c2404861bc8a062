"""Cross-entropy over vocab-parallel logits, without ever gathering the full vocabulary.

Rank r holds the logits' columns ``[r·V/tp, (r+1)·V/tp)`` (the output of a column-parallel output
layer). Per token, with M the row max, S = Σ exp(x − M) and x_t the target logit:

  forward   local (M_r, S_r, x_t,r) from ``kernels.cross_entropy_shard_stats``;
            M = all-reduce MAX(M_r); S_r ← S_r · exp(M_r − M);
            (S, x_t) = one all-reduce SUM of the stacked pair (only one shard holds x_t);
            loss = log S + M − x_t   (0 where target == ignore_index)
  backward  dx_r = g · (exp(x_r − M) / S − onehot_r(t))  from ``kernels.cross_entropy_shard_grad``
            (shard-local, no communication)

The two all-reduces are on ``(N,)``-sized statistics, not on logits; they are the only collectives
here and ``tpfuse.parallel.mappings`` has no MAX reduction, so they are issued directly.

Padded vocabulary (``vocab_size``): the output layer has ``V_padded`` ≥ ``vocab_size`` columns
(Megatron pads to a multiple of make_vocab_size_divisible_by × tp). Columns ``≥ vocab_size`` are
masked out of the softmax — rank r uses only its real columns ``[0, clamp(vocab_size − r·V/tp, 0,
V/tp))`` (M_r = −∞, S_r = 0 for a shard that is all padding) and their gradient is 0 — so the loss
is the same at every tp for the same model. Megatron lets the padded logits into the softmax; this
is a deliberate difference.

One rank (tp = 1) holds the whole vocabulary and there is nothing to combine: the loss is the
single-device ``kernels.cross_entropy`` (``F.cross_entropy`` on CPU, the fused Triton kernel on a
GPU) of the real columns ``logits[..., :vocab_size]`` (a view; the padded columns get a zero
gradient through it). It also rejects a target outside ``[0, vocab_size)`` that is not
``ignore_index`` (``TargetOutOfRangeError``, a ValueError).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _deps
from ._group import resolve_tp_group


def _real_width(width: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many of a shard's ``width`` columns are real vocabulary (the rest is padding)."""
    return width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))


def _shard_stats(real, target, vocab_start):
    """(M_r, S_r, x_t,r) of the real columns; (−∞, 0, 0) for a shard that is all padding."""
    if real.shape[-1] > 0:
        return _deps.cross_entropy_shard_stats(real, target, vocab_start)
    zeros = torch.zeros(target.shape, dtype=torch.float32, device=real.device)
    return torch.full_like(zeros, float("-inf")), zeros, zeros.clone()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, ignore_index, tp, vocab_size):
        vocab_start = tp.rank * logits_shard.shape[-1]
        real = logits_shard[..., :_real_width(logits_shard.shape[-1], vocab_start, vocab_size)]
        row_max, sum_exp, target_logit = _shard_stats(real, target, vocab_start)  # target.shape
        if tp.size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp.group)
            stacked = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp.group)
            sum_exp, target_logit = stacked[0], stacked[1]
        else:
            global_max = row_max
        loss = _deps.cross_entropy_loss_from_stats(global_max, sum_exp, target_logit, target,
                                                   ignore_index)
        ctx.save_for_backward(logits_shard, target, global_max, sum_exp)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        ctx.real_width = real.shape[-1]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits_shard, target, global_max, sum_exp = ctx.saved_tensors
        if ctx.real_width == logits_shard.shape[-1]:
            dlogits = _deps.cross_entropy_shard_grad(
                logits_shard, target, ctx.vocab_start, global_max, sum_exp,
                grad_loss.contiguous(), ctx.ignore_index)
            return dlogits, None, None, None, None
        dlogits = torch.zeros_like(logits_shard)                   # padded columns: no gradient
        if ctx.real_width:
            dlogits[..., :ctx.real_width] = _deps.cross_entropy_shard_grad(
                logits_shard[..., :ctx.real_width], target, ctx.vocab_start, global_max, sum_exp,
                grad_loss.contiguous(), ctx.ignore_index)
        return dlogits, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *,
                                 ignore_index: int = -100, vocab_size: int | None = None,
                                 group=None, state=None) -> torch.Tensor:
    """Per-token loss (target's shape, fp32) from this rank's ``(..., V/tp)`` logits shard.

    ``target`` holds global vocabulary ids of shape ``logits_shard.shape[:-1]`` (the same on every
    TP rank). ``vocab_size``: the real vocabulary; the columns beyond it (padding) are left out of
    the softmax (None: every column is real).
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits shape {tuple(logits_shard.shape)} "
                         f"must be target shape {tuple(target.shape)} plus a vocab dim")
    tp = resolve_tp_group(group, state)
    if vocab_size is not None and not 0 < vocab_size <= logits_shard.shape[-1] * tp.size:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size} must be in "
                         f"[1, {logits_shard.shape[-1] * tp.size}] (the padded vocabulary)")
    if tp.size == 1:                                   # the whole vocabulary: no statistics to combine
        real = logits_shard if vocab_size is None else logits_shard[..., :vocab_size]
        return _deps.cross_entropy(real, target, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, ignore_index, tp, vocab_size)
