"""megatron-core 0.16's ``tensor_parallel.data.broadcast_data``: rank 0 of each tensor-parallel
group sends its batch to the group's other ranks."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tpfuse.parallel.mappings import group_rank, group_size
from tpfuse.parallel.mappings import default_tensor_parallel_group as _tp

_MAX_DATA_DIM = 5


def _device():
    return torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else torch.device("cpu")


def broadcast_data(keys, data, datatype, tp_group=None):
    """``{key: tensor}`` for ``keys``, as held by the first rank of the TP group, on every rank
    of it (other ranks' ``data`` is not read). Every tensor must be ``datatype``; at most
    ``_MAX_DATA_DIM - 1`` dims, each > 0."""
    group = _tp(tp_group)
    if group_size(group) == 1:
        return {key: data[key].to(_device()) for key in keys}
    device = _device()
    first = dist.get_process_group_ranks(group)[0]
    sizes = torch.zeros(len(keys) * _MAX_DATA_DIM, dtype=torch.long, device=device)
    if group_rank(group) == 0:
        for i, key in enumerate(keys):
            tensor = data[key]
            if tensor.dtype != datatype:
                raise ValueError(f"broadcast_data: {key!r} has dtype {tensor.dtype}, "
                                 f"expected {datatype}")
            if tensor.dim() >= _MAX_DATA_DIM:
                raise ValueError(f"broadcast_data: {key!r} has {tensor.dim()} dims; at most "
                                 f"{_MAX_DATA_DIM - 1} are supported")
            sizes[i * _MAX_DATA_DIM:i * _MAX_DATA_DIM + tensor.dim()] = torch.tensor(
                tensor.shape, device=device)
    dist.broadcast(sizes, first, group=group)
    shapes = []
    for i in range(len(keys)):
        dims = sizes[i * _MAX_DATA_DIM:(i + 1) * _MAX_DATA_DIM].tolist()
        shapes.append([d for d in dims if d > 0])
    numels = [math.prod(s) for s in shapes]
    if group_rank(group) == 0:
        flat = torch.cat([data[key].to(device).reshape(-1) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, first, group=group)
    out, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat[offset:offset + numel].view(shape)
        offset += numel
    return out
