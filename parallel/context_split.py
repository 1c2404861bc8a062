"""Context parallelism's sequence split: 2·cp chunks, load-balanced for causal attention.

A sequence of s tokens is cut into 2·cp chunks of c = s / (2·cp) tokens; cp rank r holds chunks r
and 2·cp − 1 − r, concatenated in that order (Megatron's ``get_batch_on_this_cp_rank``). Under
causal attention query chunk a costs a + 1 key chunks, so every rank does (r + 1) + (2·cp − r) =
2·cp + 1 chunk pairs: the work is balanced, where a plain contiguous split would leave the last
rank cp times more work than the first.

    cp = 2, s = 8:  chunks [0 1][2 3][4 5][6 7]  →  rank 0 holds tokens 0 1 6 7, rank 1: 2 3 4 5

With sequence parallelism the local s/cp tokens are further split over tp (the embedding's
reduce-scatter), so s must divide by 2·cp·tp. Pure arithmetic and indexing: no process groups.
Also the names of the context-parallel attention variants (``cp_comm_type``) and their checks.
"""
from __future__ import annotations

import torch

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
CP_COMM_TYPE_ALIASES = {"allgather": "all_gather"}     # Megatron's spelling; TE's is all_gather


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices cp rank ``cp_rank`` holds: ``(r, 2·cp − 1 − r)``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_sequence_split(seq_length: int, cp_size: int, tp_size: int = 1,
                         sequence_parallel: bool = False) -> int:
    """The chunk length c = s / (2·cp); ValueError naming the values when s does not split
    (into 2·cp chunks, and with sequence parallelism each rank's 2·c tokens over tp)."""
    if cp_size < 1:
        raise ValueError(f"context_parallel_size={cp_size} must be a positive integer")
    if cp_size == 1:
        return seq_length
    parts = 2 * cp_size * (tp_size if sequence_parallel else 1)
    if seq_length % parts:
        what = (f"2 × context_parallel_size ({cp_size}) × tensor_model_parallel_size ({tp_size}) "
                f"(sequence_parallel=True)" if sequence_parallel and tp_size > 1
                else f"2 × context_parallel_size ({cp_size})")
        raise ValueError(f"seq_length={seq_length} is not divisible by {what} = {parts}: context "
                         "parallelism cuts the sequence into 2·cp load-balanced chunks")
    return seq_length // (2 * cp_size)


def local_token_index(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of this rank's tokens, ``(s/cp,)`` int64: chunk r then chunk 2·cp−1−r."""
    c = check_sequence_split(seq_length, cp_size)
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence): chunks r and 2·cp−1−r, ``s/cp``
    long. ``cp_size == 1`` returns ``x`` itself."""
    if cp_size == 1:
        return x
    dim = dim % x.dim()
    s = x.shape[dim]
    c = check_sequence_split(s, cp_size)
    chunks = x.reshape(*x.shape[:dim], 2 * cp_size, c, *x.shape[dim + 1:])
    index = torch.tensor(chunk_ids(cp_size, cp_rank), device=x.device)
    local = chunks.index_select(dim, index)                       # (..., 2, c, ...)
    return local.reshape(*x.shape[:dim], 2 * c, *x.shape[dim + 1:])


def rank_order_index(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """``(s,)`` int64: the global position of each token when every rank's ``s/cp`` tokens are
    concatenated in cp-rank order (what an all-gather / all-to-all over the cp group returns).

    ``natural = gathered[:, argsort(rank_order_index)]`` restores sequence order;
    ``gathered = natural[:, rank_order_index]`` goes back (``rank_order_to_natural`` /
    ``natural_to_rank_order`` do the same without an index)."""
    return torch.cat([local_token_index(seq_length, cp_size, r, device) for r in range(cp_size)])


def canonical_comm_type(comm_type: str) -> str:
    """``p2p | all_gather (allgather) | a2a``; ValueError naming the value otherwise."""
    name = CP_COMM_TYPE_ALIASES.get(comm_type, comm_type)
    if name not in CP_COMM_TYPES:
        hint = " (hierarchical a2a+p2p is not implemented)" if comm_type == "a2a+p2p" else ""
        raise ValueError(f"cp_comm_type={comm_type!r} must be one of {list(CP_COMM_TYPES)} "
                         f"(or 'allgather'){hint}")
    return name


def check_context_parallel_heads(comm_type: str, heads_local: int, groups_local: int,
                                 cp_size: int) -> None:
    """a2a (Ulysses) gives each cp rank 1/cp of this tp rank's heads and kv heads: ValueError
    naming the values when they do not divide."""
    if cp_size == 1 or canonical_comm_type(comm_type) != "a2a":
        return
    for name, value in (("attention heads", heads_local), ("query groups (kv heads)",
                                                             groups_local)):
        if value % cp_size:
            raise ValueError(
                f"cp_comm_type='a2a': {name} per tensor-parallel rank = {value} is not divisible "
                f"by context_parallel_size={cp_size} (Ulysses gives each cp rank 1/cp of the "
                "heads); use p2p or all_gather")


def rank_order_to_natural(x: torch.Tensor, cp_size: int, dim: int) -> torch.Tensor:
    """The cp ranks' s/cp tokens concatenated in rank order along ``dim`` (what an all-gather or
    all-to-all over the cp group returns) → sequence order. Chunk j comes from rank j's first half,
    chunk 2·cp−1−j from its second: a flip and a cat, so autograd keeps nothing for backward."""
    dim = dim % x.dim()
    shape, s = x.shape, x.shape[dim]
    c = check_sequence_split(s, cp_size)
    halves = x.reshape(*shape[:dim], cp_size, 2, c, *shape[dim + 1:])
    first, second = halves.select(dim + 1, 0), halves.select(dim + 1, 1).flip(dim)
    return torch.cat([first, second], dim).reshape(shape)


def natural_to_rank_order(x: torch.Tensor, cp_size: int, dim: int) -> torch.Tensor:
    """The inverse of ``rank_order_to_natural``: sequence order → rank j's chunks (j, 2·cp−1−j)
    at slot j along ``dim``."""
    dim = dim % x.dim()
    shape, s = x.shape, x.shape[dim]
    c = check_sequence_split(s, cp_size)
    chunks = x.reshape(*shape[:dim], 2 * cp_size, c, *shape[dim + 1:])
    first, second = chunks.narrow(dim, 0, cp_size), chunks.narrow(dim, cp_size, cp_size).flip(dim)
    return torch.stack([first, second], dim + 1).reshape(shape)
