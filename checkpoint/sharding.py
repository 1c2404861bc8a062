"""Sharding algebra of checkpoints: a parameter's single-process tensor from a layout's shards, and
one rank's part of it (``reshard.py`` applies it per parameter).

Dense parameters are split over the tensor-parallel group along their partition dim with
Megatron's ``partition_stride`` (the dim cut into tp·s blocks, TP rank r holding blocks r, r + tp,
…). Expert parameters (``allreduce = False``) stack an ep rank's consecutive experts on dim 0 and
are split over the expert-tensor-parallel group along their partition dim::

    W = cat_r unshard_etp(shards of ep rank r)
    this rank's part = shard_etp(W[ep_rank·L : (ep_rank + 1)·L])          L = E / ep

``sizes`` dicts carry ``tp tp_rank ep ep_rank etp etp_rank`` of a layout and rank.
"""
from __future__ import annotations

import torch

from tpfuse.tp_layers.init import shard, unshard


def full_from_shards(shards: list[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """The full tensor from the old TP ranks' shards (rank order); replicated: rank 0's copy."""
    if dim is None:
        return shards[0]
    return unshard(shards, dim, stride)


def shard_for(full: torch.Tensor, dim: int | None, stride: int, tp: int,
              tp_rank: int) -> torch.Tensor:
    """This TP rank's part of ``full`` (all of it for a replicated parameter)."""
    if dim is None:
        return full.clone()
    return shard(full, dim, tp, tp_rank, stride)


def reshard_tensor(old_shards: list[torch.Tensor], dim: int | None, stride: int, tp: int,
                   tp_rank: int) -> torch.Tensor:
    """shard_{tp_rank}(unshard(old_shards)) — the old layout's shards re-cut for (tp, tp_rank)."""
    return shard_for(full_from_shards(old_shards, dim, stride), dim, stride, tp, tp_rank)


def sizes_of(state) -> dict:
    """The sharding sizes and this rank's coordinates a model chunk is cut by."""
    return {"tp": state.tp_size, "tp_rank": state.tp_rank, "ep": state.ep_size,
            "ep_rank": state.ep_rank, "etp": state.etp_size, "etp_rank": state.etp_rank}


def dense_sizes(tp: int, tp_rank: int) -> dict:
    """Sizes of a layout without expert parallelism (experts split like the dense TP layers)."""
    return {"tp": tp, "tp_rank": tp_rank, "ep": 1, "ep_rank": 0, "etp": tp, "etp_rank": tp_rank}


def ordered(by_tp_rank: dict, name: str, old_tp: int) -> list:
    """The old TP ranks' tensors in rank order; ValueError naming the missing ranks."""
    missing = sorted(set(range(old_tp)) - set(by_tp_rank))
    if missing:
        raise ValueError(f"checkpoint lacks TP ranks {missing} of parameter {name}")
    return [by_tp_rank[r] for r in range(old_tp)]


def old_expert_sizes(old_layout: dict) -> tuple[int, int]:
    """(ep, etp) of a saved layout (layouts saved without them: ep 1, etp = tp)."""
    return old_layout.get("ep", 1), old_layout.get("etp", old_layout["tp"])


def full_tensor(entry: dict, by_key: dict, name: str, old_layout: dict) -> torch.Tensor:
    """The single-process tensor from the old layout's shards (see the module docstring)."""
    record = entry["record"]
    dim, stride = record["dim"], record["stride"]
    if not record.get("expert"):
        return full_from_shards(ordered(by_key, name, old_layout["tp"]), dim, stride)
    ep, etp = old_expert_sizes(old_layout)
    missing = sorted({(r, q) for r in range(ep) for q in range(etp)} - set(by_key))
    if missing:
        raise ValueError(f"checkpoint lacks (ep, etp) shards {missing} of parameter {name}")
    return torch.cat([full_from_shards([by_key[(r, q)] for q in range(etp)], dim, stride)
                      for r in range(ep)])


def local_part(record: dict, full: torch.Tensor, sizes: dict) -> torch.Tensor:
    """This rank's part of a single-process tensor."""
    if not record.get("expert"):
        return shard_for(full, record["dim"], record["stride"], sizes["tp"], sizes["tp_rank"])
    block = full.shape[0] // sizes["ep"]
    mine = full[sizes["ep_rank"] * block:(sizes["ep_rank"] + 1) * block]
    return shard_for(mine, record["dim"], record["stride"], sizes["etp"], sizes["etp_rank"])
