"""Model state of FSDP-sharded chunks in the checkpoint's layout-independent form.

A chunk sharded by ``fully_shard`` (``--use-torch-fsdp2``) holds each parameter as a DTensor whose
local tensor is a block of rows of the tensor-parallel shard (``Shard(0)`` over the dp·cp or
expert-data mesh). Rank files carry whole TP shards, as for every other layout, so a checkpoint
written with FSDP loads into plain data parallelism or the distributed optimizer and back, and to
another dp size, through the same resharding path (``reshard.py``)::

    saved     W_tp        = all-gather_mesh(rows of W_tp)           (full_state_dict; collective)
    loaded    rows of W_tp = rows [r·c, (r+1)·c) of W_tp, c = ⌈n0/size⌉            (copy_into)

The optimizer side needs nothing here: FSDP's pieces are flat row ranges ``[lo·r, hi·r)`` of the
TP shard, the ``[start, end)`` form the distributed optimizer saves. Without DTensors both
functions are the plain ``state_dict()`` / ``copy_``.
"""
from __future__ import annotations

import sys

import torch


def is_sharded(tensor) -> bool:
    """A parameter FSDP shards, marked by the trainer with its group, rank and size
    (``fsdp_group``, ``fsdp_rank``, ``fsdp_size``). DTensor's module is looked up, not imported:
    until ``fully_shard`` has imported it (half a second of start-up) nothing is a DTensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return (dtensor is not None and isinstance(tensor, dtensor.DTensor)
            and hasattr(tensor, "fsdp_group"))


def _block_rows(rows: int, size: int) -> int:
    return -(-rows // size)


def gather_rows(param) -> torch.Tensor:
    """The whole (TP-shard) tensor of the sharded ``param``: every rank's row block, padded to
    ⌈n0/size⌉ rows, all-gathered over ``param.fsdp_group`` (a collective)."""
    import torch.distributed as dist

    local = param._local_tensor.detach()
    rows, size = param.shape[0], param.fsdp_size
    block = _block_rows(rows, size)
    padded = local.new_zeros((block,) + tuple(local.shape[1:]))
    padded[:local.shape[0]] = local
    gathered = local.new_empty((block * size,) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded.contiguous(), group=param.fsdp_group)
    return gathered[:rows].clone()


def full_state_dict(module) -> dict:
    """``module.state_dict()`` with every sharded tensor gathered whole (a collective over its
    group when there is one: every rank of the group calls it, in the same order)."""
    targets = module.state_dict(keep_vars=True)
    if not any(is_sharded(t) for t in targets.values()):
        return module.state_dict()
    return {name: gather_rows(value) if is_sharded(value) else value.detach()
            for name, value in targets.items()}


def local_rows(target, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``full`` for the sharded ``target`` (blocks of ⌈n0/size⌉ rows, as
    ``torch.chunk`` cuts; empty where the rows run out before this rank)."""
    rows = full.shape[0]
    block = _block_rows(rows, target.fsdp_size)
    start = min(rows, target.fsdp_rank * block)
    return full[start:min(rows, start + block)]


@torch.no_grad()
def copy_into(target, full: torch.Tensor) -> None:
    """Write the whole (TP-shard) tensor ``full`` into ``target``, sharded or not."""
    if is_sharded(target):
        target._local_tensor.copy_(local_rows(target, full))
    else:
        target.copy_(full)


def load_full_state_dict(module, state: dict) -> None:
    """``module.load_state_dict(state)`` for whole tensors, also into a sharded module (same keys
    required: a missing or unexpected key is a ValueError naming it)."""
    targets = module.state_dict(keep_vars=True)
    if not any(is_sharded(t) for t in targets.values()):
        module.load_state_dict(state)
        return
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(f"model state does not fit this chunk: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, target in targets.items():
        copy_into(target, state[name])
