"""Layout-independent initialisation: draw the full master weight, keep this rank's slice.

Every rank draws the *whole* ``[out, in]`` master weight from torch's default CPU generator (the
caller seeds it with ``torch.manual_seed``) and keeps only its partition. Because the draw does not
depend on the tensor-parallel size, a layer built after the same seed at tp=4 holds exactly the
slices of the layer built at tp=1 — the basis of every "same loss at any layout" test.

Partitioning with a stride (Megatron's ``partition_stride``): the partitioned dimension of size n is
cut into ``tp * stride`` equal blocks, dealt round-robin, so rank r holds blocks
``r, r + tp, r + 2·tp, …`` (rank 0 of tp=2 at stride 2 holds blocks 0 and 2). A gated MLP whose
master fc1 is ``[gate; up]`` uses stride 2, so every rank holds its gate rows and the matching up
rows, in that order.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def normal_init(std: float) -> InitMethod:
    """``init_method`` drawing N(0, std²) in place (Megatron's ``init_method_normal``)."""
    if std <= 0:
        raise ValueError(f"init std must be > 0, got {std}")
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


DEFAULT_INIT_STD = 0.02


def draw_master_weight(rows: int, cols: int, init_method: InitMethod | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full ``[rows, cols]`` master weight, drawn in fp32 on the CPU default generator."""
    init_method = init_method or normal_init(DEFAULT_INIT_STD)
    master = torch.empty(rows, cols, dtype=torch.float32)
    init_method(master)
    return master.to(dtype)


def check_partitionable(size: int, tp: int, stride: int, what: str) -> None:
    """ValueError unless ``size`` splits into ``tp * stride`` equal blocks."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if size % (tp * stride) != 0:
        raise ValueError(
            f"{what}={size} is not divisible by tensor-parallel size tp={tp}"
            + (f" times stride={stride}" if stride > 1 else ""))


def shard(master: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s partition of ``master`` along ``dim``: blocks rank, rank+tp, … (copy)."""
    check_partitionable(master.shape[dim], tp, stride, f"dim {dim} size")
    blocks = torch.chunk(master, tp * stride, dim=dim)
    mine = [blocks[rank + i * tp] for i in range(stride)]
    return torch.cat(mine, dim=dim).contiguous().clone()


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: reassemble the master from every rank's partition (rank order)."""
    tp = len(shards)
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]  # per_rank[r][i] = block r + i·tp
    ordered = [per_rank[r][i] for i in range(stride) for r in range(tp)]
    return torch.cat(ordered, dim=dim)
