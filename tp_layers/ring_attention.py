"""Ring attention (``cp_comm_type="p2p"``): K/V blocks travel around the cp ring while the kernel
computes on the block already present.

Every cp rank holds the queries, keys and values of its two sequence chunks (``r`` and
``2·cp − 1 − r``, parallel/context_split.py), ``q (b, h, 2c, d)``, ``k, v (b, g, 2c, d)``. In step
i = 0 … cp − 1 rank r holds the K/V of rank ``r − i`` (mod cp):

    forward   step i:  post  send K/V → next rank,  receive K/V ← previous rank        (async)
                       for every visible (query chunk, key chunk) pair of the block present:
                           (O_p, lse_p) = attention_forward(q chunk, k chunk, v chunk, offsets)
                           (O, lse) = merge_attention(O, lse, O_p, lse_p)              (fp32)
                       wait for the receive
    backward  step i:  post the K/V exchange of step i + 1                              (async)
                       for every visible pair:  (dq_p, dk_p, dv_p) =
                           attention_backward(dO, q, k, v, O, lse)      (O, lse: the merged ones)
                           dQ += dq_p;  dKV_block += (dk_p, dv_p)
                       dKV_block += the partial sum received with this block; post send → next
    after the last step the dK/dV partial sums have gone round the whole ring: each rank
    receives the complete gradient of its own K/V.

Causal attention visits, per block, 2 of the 4 chunk pairs (block of a lower rank: both query
chunks × its first chunk; of a higher rank: the second query chunk × both its chunks; own block:
the 3 pairs on or below the diagonal), so every step costs every rank the same. dK/dV partial sums
travel in fp32 (summed over cp ranks, rounded once). Memory kept for backward: the local q, k, v,
out and lse — 1/cp of the full sequence's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .attention_blocks import ChunkPlan, attend_key_chunks, attend_key_chunks_backward

KV_TAG, DKV_TAG = 11, 12   # gloo matches messages by tag; NCCL by posting order (the same here)


class RingExchange:
    """Send a tensor to the next cp rank and receive one of the same shape / dtype from the
    previous, asynchronously: ``start(t)`` posts both, ``.wait()`` returns the received tensor."""

    def __init__(self, cp, tag: int):
        self.cp, self.tag = cp, tag

    def start(self, tensor: torch.Tensor) -> "_PendingExchange":
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.cp.next_rank, self.cp.group, self.tag),
               dist.P2POp(dist.irecv, received, self.cp.prev_rank, self.cp.group, self.tag)]
        return _PendingExchange(dist.batch_isend_irecv(ops), tensor, received)


@dataclass
class _PendingExchange:
    works: list
    sent: torch.Tensor          # kept alive until the send completes
    received: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, plan: ChunkPlan):
        c = plan.chunk_len
        kv = torch.stack([k, v])                                       # (2, b, g, 2c, d)
        b, h, _, d = q.shape
        out = torch.zeros(b, h, 2 * c, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, 2 * c), float("-inf"), dtype=torch.float32, device=q.device)
        exchange = RingExchange(cp, KV_TAG)
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            pending = exchange.start(kv) if step + 1 < cp.size else None
            attend_key_chunks(q, kv, plan, plan.chunks_of(owner), out, lse)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (cp, plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, plan = ctx.settings
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        kv_exchange, dkv_exchange = RingExchange(cp, KV_TAG), RingExchange(cp, DKV_TAG)
        pending_dkv = None
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            pending_kv = kv_exchange.start(kv) if step + 1 < cp.size else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, b, g, 2c, d)
            attend_key_chunks_backward(dout, q, kv, out, lse, plan, plan.chunks_of(owner), dq,
                                       dkv)
            if pending_dkv is not None:
                dkv += pending_dkv.wait()        # what the ranks before added to this block
            pending_dkv = dkv_exchange.start(dkv)
            if pending_kv is not None:
                kv = pending_kv.wait()
        dkv = pending_dkv.wait()                 # our own block, summed over the whole ring
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, cp, plan: ChunkPlan) -> torch.Tensor:
    """Attention of the local chunks' queries over the whole sequence's keys (see the module
    docstring): ``q (b, h, 2c, d)``, ``k, v (b, g, 2c, d)`` → ``(b, h, 2c, d)``; ``cp`` a
    ``tp_layers._group.CPGroup``."""
    return RingAttention.apply(q, k, v, cp, plan)
