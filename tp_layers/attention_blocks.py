"""Attention over one (query chunk, key chunk) pair: what context-parallel attention is built of.

``block_forward`` → ``(out, lse)`` and ``block_backward`` → ``(dq, dk, dv)`` are
``kernels.flash_attention``'s ``attention_forward`` / ``attention_backward`` (the same mask
keywords: causal, ``window_size``, document ids, position offsets, held in the kernels'
``AttentionMask``), with two additions:

- head dims outside the kernels' 16..128 (tiny test models) run the explicit masked softmax of
  ``kernels.flash_attention_reference`` (``explicit_forward`` / ``explicit_backward``: the same
  algebra and the same empty-row convention, out 0, lse −inf);
- a pair whose every key is visible to every query (no window, no documents) is passed as a full,
  unshifted mask and a diagonal pair as an aligned causal one (the kernels' cheapest tile loops).

Attention dropout (``dropout``: the kernels' ``AttentionDropout``) masks each probability by its
global sample, head and the positions the mask's offsets give, so a block draws exactly the
single-process mask of its (query, key) rectangle; its lse stays undropped and merges as before.

``chunk_pairs`` lists which (query chunk, key chunk) pairs of a causal / windowed sequence hold any
visible key, ``ChunkPlan`` turns them into block calls with their masks; ``BlockAttention`` is the
autograd Function over one call. Context-parallel attention cuts its work into c × c blocks
(c = s / (2·cp)): every call has equal query and key lengths, so aligned-mask kernels run the
fully visible and the diagonal ones.

    forward   S = scale · Q Kᵀ + M,  lse = log Σ_j e^S,  O = e^(S − lse) V
    backward  P = e^(S − lse),  δ = rowsum(dO ⊙ O),  dS = P ⊙ (dO Vᵀ − δ)
              dQ = scale · dS K,  dK = scale · Σ_group dSᵀ Q,  dV = Σ_group Pᵀ dO
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _deps
from ._deps import AttentionMask


def kernel_takes(head_dim: int) -> bool:
    return _deps.MIN_HEAD_DIM <= head_dim <= _deps.MAX_HEAD_DIM


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


# ----------------------------------------------------------------------------- dispatch

def _drop_factor(q, k, mask: AttentionMask, dropout):
    """The explicit path's dropout factor (b, h, s_q, s_k) fp32, or None without dropout."""
    if dropout is None:
        return None
    b, h, s_q, _ = q.shape
    return dropout.factor(b, h, s_q, k.shape[2], mask.q_offset, mask.k_offset, q.device,
                          torch.float64 if q.dtype == torch.float64 else torch.float32)


def _kernel_mask(mask: AttentionMask, s_q: int, s_k: int, dropout) -> AttentionMask:
    """The mask the kernels get: simplified, unless dropout needs its absolute offsets."""
    return mask if dropout is not None else mask.simplified(s_q, s_k)


def block_forward(q, k, v, scale: float, mask: AttentionMask, dropout=None):
    """``(out (b, h, s_q, d), lse (b, h, s_q) fp32)`` of q over these keys only."""
    if not kernel_takes(q.shape[-1]):
        return _deps.explicit_forward(q, k, v, scale, mask.visible(q.shape[2], k.shape[2], q.device),
                                      _drop_factor(q, k, mask, dropout))
    mask = _kernel_mask(mask, q.shape[2], k.shape[2], dropout)
    return _deps.attention_forward(q, k, v, softmax_scale=scale, dropout=dropout,
                                   **mask.keywords())


def block_backward(dout, q, k, v, out, lse, scale: float, mask: AttentionMask, dropout=None):
    """``(dq, dk, dv)``: this key block's part of the gradient (dq sums over blocks)."""
    if not kernel_takes(q.shape[-1]):
        return _deps.explicit_backward(dout, q, k, v, out, lse, scale,
                                       mask.visible(q.shape[2], k.shape[2], q.device),
                                       _drop_factor(q, k, mask, dropout))
    mask = _kernel_mask(mask, q.shape[2], k.shape[2], dropout)
    return _deps.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale,
                                    dropout=dropout, **mask.keywords())


class BlockAttention(torch.autograd.Function):
    """``out = attention(q, k, v)`` over one block, differentiable in q, k, v (any head dim)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, dropout=None):
        out, lse = block_forward(q, k, v, scale, mask, dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (scale, mask, dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------------ which pairs to compute

def pair_visible(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool,
                 window_size: int | None) -> bool:
    """Whether any key of positions [k_start, k_start + k_len) is visible to any query of
    [q_start, q_start + q_len) under the positional rules (documents aside)."""
    if causal and k_start > q_start + q_len - 1:          # every key after every query
        return False
    if window_size is not None and q_start - (k_start + k_len - 1) >= window_size:
        return False                                       # every key older than the window
    return True


def chunk_pairs(q_chunks, k_chunks, chunk_len: int, causal: bool, window_size: int | None):
    """``[(qi, ki)]``: local indices of the query / key chunks (global chunk ids ``q_chunks``,
    ``k_chunks``, each ``chunk_len`` tokens) whose pair holds a visible key."""
    return [(qi, ki) for qi, qc in enumerate(q_chunks) for ki, kc in enumerate(k_chunks)
            if pair_visible(qc * chunk_len, chunk_len, kc * chunk_len, chunk_len, causal,
                            window_size)]


@dataclass(frozen=True)
class ChunkPlan:
    """The block calls of one context-parallel attention: this cp rank's query chunks
    (``cp_rank``, 2·cp−1−``cp_rank``) against key chunks of ``chunk_len`` tokens, with the
    masks (positions from the global chunk index, document ids sliced from the whole
    sequence's)."""
    cp_size: int
    cp_rank: int
    chunk_len: int                      # c = s / (2·cp)
    scale: float
    causal: bool
    window_size: int | None
    document_ids: torch.Tensor | None   # (b, s) of the whole sequence, natural order
    dropout: object = None              # the kernels' AttentionDropout, or None

    def chunks_of(self, cp_rank: int) -> tuple[int, int]:
        return cp_rank, 2 * self.cp_size - 1 - cp_rank

    def pairs(self, k_chunks):
        """``(qi, ki, AttentionMask)`` for every visible (local query chunk qi, key chunk
        ``k_chunks[ki]``) pair."""
        q_chunks = self.chunks_of(self.cp_rank)
        for qi, ki in chunk_pairs(q_chunks, k_chunks, self.chunk_len, self.causal,
                                  self.window_size):
            yield qi, ki, self.mask(q_chunks[qi], k_chunks[ki])

    def mask(self, q_chunk: int, k_chunk: int) -> AttentionMask:
        c, ids = self.chunk_len, self.document_ids
        return AttentionMask(
            causal=self.causal, window_size=self.window_size, q_offset=q_chunk * c,
            k_offset=k_chunk * c,
            q_document_ids=None if ids is None else ids[:, q_chunk * c:(q_chunk + 1) * c],
            k_document_ids=None if ids is None else ids[:, k_chunk * c:(k_chunk + 1) * c])


def chunk(t: torch.Tensor, index: int, c: int) -> torch.Tensor:
    """Chunk ``index`` of ``c`` rows along the sequence dim −2 of ``(..., s, d)``: a view."""
    return t.narrow(-2, index * c, c)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out, part_lse) -> None:
    """``(out, lse) ← merge_attention((out, lse), (part_out, part_lse))`` in place (fp32 views
    ``(b, h, c, d)`` / ``(b, h, c)``)."""
    merged_out, merged_lse = _deps.merge_attention(out, lse, part_out, part_lse)
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def attend_key_chunks(q, kv, plan: ChunkPlan, key_chunks, out, lse) -> None:
    """``(out, lse) ←`` merged with this rank's queries ``q (b, h, 2c, d)`` over the key chunks
    ``key_chunks`` (global ids) that ``kv (2, b, g, len(key_chunks)·c, d)`` holds in that order,
    the visible pairs only; ``out (b, h, 2c, d)`` / ``lse (b, h, 2c)`` fp32, start at 0 / −inf."""
    c = plan.chunk_len
    for qi, ki, mask in plan.pairs(key_chunks):
        part_out, part_lse = block_forward(chunk(q, qi, c), chunk(kv[0], ki, c),
                                           chunk(kv[1], ki, c), plan.scale, mask, plan.dropout)
        merge_into(chunk(out, qi, c), lse.narrow(-1, qi * c, c), part_out, part_lse)


def attend_key_chunks_backward(dout, q, kv, out, lse, plan: ChunkPlan, key_chunks, dq,
                               dkv) -> None:
    """The gradient of ``attend_key_chunks`` given the whole attention's ``out`` and ``lse``:
    adds into ``dq (b, h, 2c, d)`` and ``dkv (2, b, g, len(key_chunks)·c, d)`` (fp32)."""
    c = plan.chunk_len
    for qi, ki, mask in plan.pairs(key_chunks):
        part_dq, part_dk, part_dv = block_backward(
            chunk(dout, qi, c), chunk(q, qi, c), chunk(kv[0], ki, c), chunk(kv[1], ki, c),
            chunk(out, qi, c), lse.narrow(-1, qi * c, c), plan.scale, mask, plan.dropout)
        chunk(dq, qi, c).add_(part_dq)
        chunk(dkv[0], ki, c).add_(part_dk)
        chunk(dkv[1], ki, c).add_(part_dv)
