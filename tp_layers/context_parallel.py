"""Context-parallel attention: each cp rank holds 2 of the sequence's 2·cp chunks (r and 2·cp−1−r,
parallel/context_split.py) and computes exact causal attention of its queries over the whole
sequence. Three ways to bring keys and queries together (Megatron's ``--cp-comm-type``):

``p2p`` — ring attention (tp_layers/ring_attention.py). K/V blocks go round the ring in cp − 1
    async steps, each hidden behind the kernel on the block present; backward sends dK/dV round.
    Traffic per rank: (cp − 1)·|K/V local| forward, about twice that backward; memory 1/cp.
    Wins for long sequences and cp spanning slow links (inter-node): the transfer per step is
    small and overlapped, and no rank ever holds the whole K/V.
``all_gather`` — K/V gathered once (one all-gather of cp·|K/V local|), each query chunk attends to
    the key chunks it can see; backward re-gathers K/V (kept: only the local K/V, memory 1/cp)
    and reduce-scatters dK/dV. One collective instead of cp − 1 steps: wins when the sequence per rank
    is short (a ring step would be latency-bound) or with GQA, where K/V is small next to Q, on a
    fast intra-node link; it holds the full K/V transiently.
``a2a`` — DeepSpeed-Ulysses. An all-to-all swaps the split: every rank gets the whole sequence of
    h/cp of its heads (q, k, v), runs ordinary attention, and a second all-to-all returns the
    output to the sequence split. Traffic: 4 all-to-alls of |local q| size (q, k, v, out), about
    1/cp of a ring's per rank, and the kernel runs once on full-length tiles. Wins on fast
    all-to-all fabrics (NVLink) with enough heads; needs local heads and kv groups divisible by
    cp, and its activations are the full sequence of h/cp heads (memory 1/cp as well).

All three take ``q (b, h, 2c, d)``, ``k, v (b, g, 2c, d)`` (this rank's heads, its two chunks
concatenated; GQA when g < h), the sliding window and the local document ids ``(b, 2c)``
(documents may cross chunk and rank boundaries: the ids of the whole sequence are all-gathered
once per call, a ``(b, s)`` integer tensor), and return ``(b, h, 2c, d)``.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from tpfuse.parallel.context_split import (CP_COMM_TYPE_ALIASES, CP_COMM_TYPES,  # noqa: F401
                                           canonical_comm_type, check_context_parallel_heads,
                                           natural_to_rank_order, rank_order_to_natural)
from tpfuse.parallel.mappings import all_gather_first_dim, reduce_scatter_first_dim

from ._deps import AttentionMask
from .attention_blocks import (BlockAttention, ChunkPlan, attend_key_chunks,
                               attend_key_chunks_backward, default_scale)
from .ring_attention import ring_attention

# ----------------------------------------------------------------------------- shared pieces

def gather_document_ids(document_ids: torch.Tensor, cp) -> torch.Tensor:
    """``(b, 2c)`` local ids → ``(b, s)`` ids of the whole sequence in natural order."""
    gathered = all_gather_first_dim(document_ids.t().contiguous(), cp.group)   # (s, b) rank order
    return rank_order_to_natural(gathered, cp.size, 0).t()


# ----------------------------------------------------------------------------- all_gather

def _gather_kv(k, v, cp):
    """Local K/V ``(b, g, 2c, d)`` → the whole sequence's ``(2, b, g, s, d)`` in natural order."""
    kv = torch.stack([k, v]).movedim(3, 0)                            # (2c, 2, b, g, d)
    gathered = all_gather_first_dim(kv, cp.group)                      # (s, 2, b, g, d) rank order
    return rank_order_to_natural(gathered, cp.size, 0).movedim(0, 3)


class AllGatherAttention(torch.autograd.Function):
    """K/V all-gathered in forward and again in backward (only the local K/V is kept); each
    query chunk attends to the visible key chunks (c × c blocks merged by lse); dK/dV of the
    whole sequence reduce-scattered back to the owners."""

    @staticmethod
    def forward(ctx, q, k, v, cp, plan: ChunkPlan):
        c = plan.chunk_len
        kv = _gather_kv(k, v, cp)                                      # (2, b, g, s, d)
        b, h, _, d = q.shape
        out = torch.zeros(b, h, 2 * c, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, 2 * c), float("-inf"), dtype=torch.float32, device=q.device)
        attend_key_chunks(q, kv, plan, range(2 * cp.size), out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (cp, plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, plan = ctx.settings
        kv = _gather_kv(k, v, cp)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)   # (2, b, g, s, d)
        attend_key_chunks_backward(dout.contiguous(), q, kv, out, lse, plan, range(2 * cp.size),
                                   dq, dkv)
        rank_order = natural_to_rank_order(dkv, cp.size, 3).movedim(3, 0)
        local = reduce_scatter_first_dim(rank_order, cp.group,  # (2, b, g, 2c, d)
                                         cp.options).movedim(0, 3)
        return dq.to(q.dtype), local[0].to(k.dtype), local[1].to(v.dtype), None, None


# ----------------------------------------------------------------------------- a2a (Ulysses)

class _AllToAll(torch.autograd.Function):
    """Dim-0 slot j goes to cp rank j, slot j of the result came from rank j. The exchange is its
    own adjoint, so the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_sequence(x, cp):
    """``(b, n, 2c, d)`` (all heads, local chunks) → ``(b, n/cp, s, d)`` (heads group of this
    rank, whole sequence in natural order)."""
    b, n, two_c, d = x.shape
    slots = x.reshape(b, cp.size, n // cp.size, two_c, d).transpose(0, 1)   # (cp, b, n/cp, 2c, d)
    received = _AllToAll.apply(slots, cp.group)                # slot j: rank j's chunks, our heads
    full = received.permute(1, 2, 0, 3, 4).reshape(b, n // cp.size, cp.size * two_c, d)
    return rank_order_to_natural(full, cp.size, 2)


def _sequence_to_heads(x, cp):
    """The inverse of ``_heads_to_sequence``: ``(b, n/cp, s, d)`` → ``(b, n, 2c, d)``."""
    b, n_part, s, d = x.shape
    ranked = natural_to_rank_order(x, cp.size, 2)
    slots = ranked.reshape(b, n_part, cp.size, s // cp.size, d).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(slots, cp.group)                # slot j: head group j, our chunks
    return received.transpose(0, 1).reshape(b, cp.size * n_part, s // cp.size, d)


def ulysses_attention(q, k, v, cp, scale, causal, window_size, ids, dropout=None):
    """All-to-all to (h/cp heads, whole sequence), one attention call, all-to-all back. Rank j
    holds heads [j·h/cp, (j+1)·h/cp) of the local ones: dropout's head offset moves by that."""
    q_full, k_full, v_full = (_heads_to_sequence(t, cp) for t in (q, k, v))
    mask = AttentionMask(causal=causal, window_size=window_size, q_document_ids=ids,
                     k_document_ids=ids)
    if dropout is not None:
        dropout = replace(dropout, head_offset=dropout.head_offset + cp.rank * q_full.shape[1])
    out = BlockAttention.apply(q_full, k_full, v_full, scale, mask, dropout)  # (b, h/cp, s, d)
    return _sequence_to_heads(out, cp)


# ----------------------------------------------------------------------------- dispatch

def context_parallel_attention(q, k, v, cp, comm_type: str = "p2p", *, causal: bool = True,
                               softmax_scale: float | None = None, window_size: int | None = None,
                               document_ids: torch.Tensor | None = None,
                               dropout=None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence (see the module docstring).

    ``q (b, h, 2c, d)``, ``k, v (b, g, 2c, d)``: this cp rank's chunks r and 2·cp−1−r; ``cp`` a
    ``tp_layers._group.CPGroup``; ``document_ids (b, 2c)`` int or None; ``window_size`` as
    flash_attention's (the last W positions); ``dropout``: the kernels' ``AttentionDropout``
    (each block draws the single-process mask of its global positions). Differentiable in q, k, v.
    """
    comm_type = canonical_comm_type(comm_type)
    scale = default_scale(q.shape[-1], softmax_scale)
    if cp.size == 1:
        mask = AttentionMask(causal=causal, window_size=window_size, q_document_ids=document_ids,
                         k_document_ids=document_ids)
        return BlockAttention.apply(q, k, v, scale, mask, dropout)
    if q.shape[2] % 2:
        raise ValueError(f"context-parallel attention: local sequence {q.shape[2]} must hold two "
                         "equal chunks")
    check_context_parallel_heads(comm_type, q.shape[1], k.shape[1], cp.size)
    ids = None if document_ids is None else gather_document_ids(document_ids, cp)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, cp, scale, causal, window_size, ids, dropout)
    plan = ChunkPlan(cp.size, cp.rank, q.shape[2] // 2, scale, causal, window_size, ids, dropout)
    if comm_type == "p2p":
        return ring_attention(q, k, v, cp, plan)
    return AllGatherAttention.apply(q, k, v, cp, plan)
