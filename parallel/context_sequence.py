"""Whole-sequence operations on context parallelism's load-balanced chunks, one collective each.

Cp rank r holds chunks r and 2·cp − 1 − r of the 2·cp chunks of c tokens (``context_split``),
concatenated along the sequence dim. Two operations need tokens or sums of the other ranks:

``roll_left_over_context(x, cp_group, cp_size, cp_rank)``: this rank's part of the whole sequence
shifted one step left, the vacated global last entry 0 (Megatron's ``roll_tensor`` under cp):
``out[i] = x[i + 1]`` over global positions. Inside a chunk that is a local shift; the last slot of
chunk j takes the first token of chunk j + 1, which is held by

    j = r < cp − 1          rank r + 1, its first chunk
    j = r = cp − 1          this rank, its second chunk (chunk cp)
    j = 2·cp − 1 − r, r > 0  rank r − 1, its second chunk (chunk 2·cp − r)
    j = 2·cp − 1 (r = 0)     nobody: the sequence's end, 0

so one all-gather of every rank's two chunk-first tokens gives each rank both of its fills.
Not differentiable (no gradient flows through the gather): for token ids, positions, labels and
loss masks, which is what multi-token prediction rolls.

``masked_sequence_mean(losses, mask, cp_group, cp_size)``: the mean over the kept tokens of the
whole sequence, ``L = Σ_cp Σ_local loss·mask / Σ_cp Σ_local mask`` (one all-reduce of [sum, count]),
and the loss each rank back-propagates, ``cp · Σ_local loss·mask / Σ_cp mask``: the cp ranks'
gradients of a parameter sum to cp · ∇L, and the data-parallel reduction over dp·cp scales by
1/dp_cp (Megatron's), leaving ∇L — the gradient of one process on the whole sequence.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.context_split import check_sequence_split
from tpfuse.parallel.mappings import all_gather_first_dim


def roll_left(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` shifted one step left along ``dim``, the vacated last entry 0:
    ``out[i] = x[i + 1]``, ``out[-1] = 0``."""
    rolled = torch.roll(x, shifts=-1, dims=dim)
    rolled.select(dim, -1).zero_()
    return rolled


def _chunk_heads(gathered: torch.Tensor, cp_size: int, cp_rank: int):
    """The first tokens of chunks r + 1 and 2·cp − r (the latter zero for r = 0) from the
    all-gathered ``(cp, 2, ...)`` chunk-first tokens (``[q, 0]``: chunk q, ``[q, 1]``: chunk
    2·cp − 1 − q)."""
    after_first = gathered[cp_rank + 1, 0] if cp_rank + 1 < cp_size else gathered[cp_rank, 1]
    after_second = gathered[cp_rank - 1, 1] if cp_rank > 0 else torch.zeros_like(gathered[0, 1])
    return after_first, after_second


def roll_left_over_context(x: torch.Tensor, cp_group=None, cp_size: int = 1, cp_rank: int = 0,
                           dim: int = -1) -> torch.Tensor:
    """This cp rank's ``(..., 2·c, ...)`` part of the whole sequence (along ``dim``) rolled one
    step left over the global positions, the global last entry 0 (the module docstring);
    ``roll_left`` when cp = 1. A collective over ``cp_group``."""
    if cp_size == 1:
        return roll_left(x, dim)
    dim = dim % x.dim()
    c = check_sequence_split(x.shape[dim] * cp_size, cp_size)
    first, second = x.detach().split(c, dim)
    heads = torch.stack([first.select(dim, 0), second.select(dim, 0)])              # (2, ...)
    gathered = all_gather_first_dim(heads, cp_group)                                # (2·cp, ...)
    after_first, after_second = _chunk_heads(gathered.view(cp_size, 2, *heads.shape[1:]),
                                             cp_size, cp_rank)
    first, second = roll_left(first, dim), roll_left(second, dim)
    first.select(dim, -1).copy_(after_first)
    second.select(dim, -1).copy_(after_second)
    return torch.cat([first, second], dim)


def masked_sequence_mean(losses: torch.Tensor, mask: torch.Tensor, cp_group=None,
                         cp_size: int = 1):
    """``(loss to back-propagate, the whole sequence's mean loss (detached))`` of this rank's
    per-token ``losses`` and ``mask`` (same shape, any); one all-reduce over ``cp_group`` when
    cp > 1 (the module docstring)."""
    losses = losses.float().reshape(-1)
    mask = mask.float().reshape(-1).to(losses.device)
    total = (losses * mask).sum()
    if cp_size == 1:
        loss = total / mask.sum().clamp(min=1.0)
        return loss, loss.detach()
    sums = torch.stack([total.detach(), mask.sum()])
    dist.all_reduce(sums, group=cp_group)
    count = sums[1].clamp(min=1.0)
    return total * (cp_size / count), sums[0] / count
