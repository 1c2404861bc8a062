"""Token dispatchers: bring every token to the ranks holding its experts, and the results back.

``dispatch(tokens (T, h), probs (T, E), routing_map (T, E))`` → ``(rows (M, h),
tokens_per_local_expert, plan)``: the rows this rank's L local experts must process, grouped by
local expert (and inside an expert by source rank, then token order); ``combine(expert_rows, plan)``
→ ``y (T, h)`` with ``y[t] = Σ_e p(t, e) · expert_e(tokens[t])`` over the experts that kept t.

AllGatherDispatcher (Megatron's ``allgather``), over the etp × ep group G:
    gather tokens, probs and map over G (T·|G| tokens) → keep my experts' columns → permute →
    experts → unpermute with my probs (a partial: my experts only, partial sums under etp) →
    reduce-scatter over G → (T, h)

AlltoAllDispatcher (Megatron's ``alltoall``):
    per-expert token counts exchanged over etp × ep (every rank learns every split size)
    permute by global expert → all-to-all over ep (rows to the rank holding their expert) →
    all-gather over etp (each etp rank computes its shard of the expert for all of them) →
    sort chunks [etp src][ep src][expert] → [expert][etp src][ep src]
    combine: unsort → reduce-scatter over etp (sums the etp partials) → all-to-all back →
    unpermute with the probabilities
``begin_dispatch`` / ``end_dispatch`` (alltoall) split ``dispatch`` at the all-to-all over ep,
which travels in between (``comm.start_all_to_all``): the MoE layer runs its shared expert there
(``moe_shared_expert_overlap``), in backward too (autograd reaches the shared expert's nodes
between the wait's backward, which starts the gradient's exchange, and the start's, which ends it).
With ``capacity`` (``moe_pad_expert_input_to_capacity``) every expert gets exactly C rows from
every rank — zero rows where it kept fewer tokens — so the split sizes are known without counting.

Row maps: the permutation is ``kernels.moe_permute`` with a ``(T, slots)`` row map built from the
routing map (rows ordered by expert, then token); chunk sorting is the same kernel with one slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse.kernels.moe_permute import permute_tokens, unpermute_tokens
from tpfuse.parallel.mappings import (all_gather_first_dim, gather_from_sequence_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region)

from .comm import (all_gather_v, all_to_all, reduce_scatter_v, start_all_to_all,
                   wait_all_to_all)
from .routing import expert_capacity


def routing_row_map(routing_map, probs, slots: int, capacity: int | None = None):
    """``(row_map (T, slots), slot_probs (T, slots), rows_per_expert)``: token t's j-th used
    expert e sits at row start_e + (rank of t among e's tokens), experts in column order; start_e
    = e·C with a capacity C, else the tokens of the experts before e. Unused slots are −1 / 0."""
    counts = routing_map.sum(dim=0)                                           # (E,)
    if capacity is None:
        starts = counts.cumsum(0) - counts
        rows_per_expert = counts.tolist()
    else:
        starts = torch.arange(routing_map.shape[1], device=counts.device) * capacity
        rows_per_expert = [capacity] * routing_map.shape[1]
    position = routing_map.long().cumsum(dim=0) - 1                          # (T, E)
    rows = torch.where(routing_map, starts + position, -1)
    row_map, experts = rows.topk(slots, dim=1)
    slot_probs = probs.gather(1, experts) * (row_map >= 0)
    return row_map, slot_probs, rows_per_expert


def chunk_row_map(sizes, order, device):
    """Row map ``(R, 1)`` moving chunk ``c`` (``sizes[c]`` rows, chunks stored in index order) to
    its place in ``order``; ``unpermute_tokens`` with the same map moves them back."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    dest = torch.empty(starts[-1], dtype=torch.long, device="cpu")     # on the host, copied once
    out = 0
    for c in order:
        dest[starts[c]:starts[c] + sizes[c]] = torch.arange(out, out + sizes[c], device="cpu")
        out += sizes[c]
    return dest.to(device)[:, None]


@dataclass
class Plan:
    """What ``combine`` needs from ``dispatch`` (one per call, so calls may interleave)."""
    row_map: torch.Tensor
    slot_probs: torch.Tensor
    sort_map: torch.Tensor | None = None
    etp_sizes: tuple = ()
    in_splits: tuple = ()
    out_splits: tuple = ()


class AllGatherDispatcher:
    def __init__(self, groups, num_experts: int, topk: int):
        self.groups, self.num_experts, self.topk = groups, num_experts, topk
        self.num_local = num_experts // groups.ep_size
        self.first_expert = groups.ep_rank * self.num_local

    def dispatch(self, tokens, probs, routing_map):
        group = self.groups.etp_ep
        if self.groups.etp_ep_size > 1:
            options = self.groups.options                       # tokens become (T·G, h)
            tokens = gather_from_sequence_parallel_region(tokens, group, options=options)
            probs = gather_from_sequence_parallel_region(probs, group, options=options)
            routing_map = all_gather_first_dim(routing_map.to(torch.uint8), group).bool()
        mine = slice(self.first_expert, self.first_expert + self.num_local)
        row_map, slot_probs, rows_per_expert = routing_row_map(
            routing_map[:, mine], probs[:, mine], min(self.topk, self.num_local))
        rows = permute_tokens(tokens, row_map, sum(rows_per_expert))            # (M, h)
        return rows, rows_per_expert, Plan(row_map, slot_probs)

    def combine(self, expert_rows, plan):
        out = unpermute_tokens(expert_rows, plan.row_map, plan.slot_probs)      # (T·G, h)
        if self.groups.etp_ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.groups.etp_ep,
                                                             options=self.groups.options)
        return out                                                              # (T, h)


@dataclass(frozen=True)
class DispatchRecord:
    """One ``AlltoAllDispatcher.dispatch`` call as ``tpfuse-plan`` reads it: ``counts[p][e]``
    the rows etp × ep member p sent to expert e (the table every member exchanged) and whether
    the call built the graph backward runs through (a recomputed region's first forward runs
    without one; its re-run builds it)."""
    counts: tuple
    builds_graph: bool


class AlltoAllDispatcher:
    def __init__(self, groups, num_experts: int, topk: int, capacity_factor: float | None = None,
                 pad_to_capacity: bool = False):
        self.groups, self.num_experts, self.topk = groups, num_experts, topk
        self.routing_log: list | None = None    # a list: every dispatch appends its DispatchRecord
        self.num_local = num_experts // groups.ep_size
        self.first_expert = groups.ep_rank * self.num_local
        self.capacity_factor = capacity_factor if pad_to_capacity else None
        self._position = {coord: p for p, coord in enumerate(groups.etp_ep_coords)}

    def _capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.num_experts, self.topk, self.capacity_factor)

    def _count_table(self, rows_per_expert, capacity, device):
        """rows[p][e]: tokens etp_ep member p sends to expert e (all C under padding)."""
        if capacity is not None:
            return [[capacity] * self.num_experts] * self.groups.etp_ep_size
        counts = torch.tensor(rows_per_expert, dtype=torch.long, device=device)
        if self.groups.etp_ep_size == 1:
            return [rows_per_expert]
        return all_gather_first_dim(counts[None], self.groups.etp_ep).tolist()

    def dispatch(self, tokens, probs, routing_map):
        return self.end_dispatch(self.begin_dispatch(tokens, probs, routing_map))

    def begin_dispatch(self, tokens, probs, routing_map):
        """``dispatch`` up to the all-to-all over ep, left in flight (``end_dispatch`` finishes
        it); whatever runs in between overlaps the exchange (--moe-shared-expert-overlap)."""
        g, L, e0 = self.groups, self.num_local, self.first_expert
        capacity = self._capacity(tokens.shape[0])
        row_map, slot_probs, rows_per_expert = routing_row_map(routing_map, probs, self.topk,
                                                               capacity)
        rows = permute_tokens(tokens, row_map, sum(rows_per_expert))           # by global expert
        table = self._count_table(rows_per_expert, capacity, tokens.device)
        if self.routing_log is not None:
            self.routing_log.append(DispatchRecord(tuple(map(tuple, table)),
                                                   torch.is_grad_enabled()))

        def sent(q, r):  # rows etp rank q / ep rank r sends to each of my experts
            return table[self._position[(q, r)]][e0:e0 + L]

        in_splits = [sum(rows_per_expert[r * L:(r + 1) * L]) for r in range(g.ep_size)]
        out_splits = [sum(sent(g.etp_rank, r)) for r in range(g.ep_size)]
        rows, pending = start_all_to_all(rows, g.ep, out_splits, in_splits)
        return rows, pending, sent, row_map, slot_probs, in_splits, out_splits, tokens.device

    def end_dispatch(self, begun):
        g, L = self.groups, self.num_local
        rows, pending, sent, row_map, slot_probs, in_splits, out_splits, device = begun
        rows = wait_all_to_all(rows, pending)                                 # [ep src][expert]
        etp_sizes = [sum(sum(sent(q, r)) for r in range(g.ep_size)) for q in range(g.etp_size)]
        rows = all_gather_v(rows, g.etp, etp_sizes, g.options)           # [etp src][ep src][expert]
        chunk_sizes = [n for q in range(g.etp_size) for r in range(g.ep_size) for n in sent(q, r)]
        order = [(q * g.ep_size + r) * L + local for local in range(L)
                 for q in range(g.etp_size) for r in range(g.ep_size)]
        sort_map = chunk_row_map(chunk_sizes, order, device)
        rows = permute_tokens(rows, sort_map, len(sort_map))            # [expert][etp][ep src]
        per_expert = [sum(chunk_sizes[c] for c in order[local * g.etp_size * g.ep_size:
                                                         (local + 1) * g.etp_size * g.ep_size])
                      for local in range(L)]
        plan = Plan(row_map, slot_probs, sort_map, tuple(etp_sizes), tuple(in_splits),
                    tuple(out_splits))
        return rows, per_expert, plan

    def combine(self, expert_rows, plan):
        g = self.groups
        rows = unpermute_tokens(expert_rows, plan.sort_map)             # [etp][ep src][expert]
        rows = reduce_scatter_v(rows, g.etp, plan.etp_sizes, g.options)  # [ep src][expert], Σ etp
        rows = all_to_all(rows, g.ep, plan.in_splits, plan.out_splits)  # back by global expert
        return unpermute_tokens(rows, plan.row_map, plan.slot_probs)    # (T, h)
