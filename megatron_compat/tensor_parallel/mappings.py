"""megatron-core 0.16's ``tensor_parallel.mappings``: Megatron's names, argument order and
default group (the default ParallelState's tensor-parallel group when ``group`` is None), over
``tpfuse.parallel.mappings``' autograd Functions.

``output_split_sizes`` / ``input_split_sizes`` (uneven sequence splits, used by MoE token
dispatch) are supported; ``use_global_buffer`` is accepted and only changes where Megatron
allocates the result, never its value.
"""
from __future__ import annotations

import torch

from tpfuse.moe.comm import all_gather_v, reduce_scatter_v
from tpfuse.parallel import mappings as _m
from tpfuse.parallel.mappings import default_tensor_parallel_group as _tp

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region", "all_to_all", "all_to_all_sp2hp",
    "all_to_all_hp2sp",
]


def copy_to_tensor_model_parallel_region(input_, group=None):
    """forward: identity, backward: all-reduce."""
    return _m.copy_to_region(input_, _tp(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """forward: all-reduce, backward: identity."""
    return _m.reduce_from_region(input_, _tp(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """forward: split the last dim, backward: all-gather it."""
    return _m.scatter_to_region(input_, _tp(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """forward: all-gather the last dim, backward: split it."""
    return _m.gather_from_region(input_, _tp(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """forward: split dim 0, backward: all-gather it."""
    return _m.scatter_to_sequence_parallel_region(input_, _tp(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                         output_split_sizes=None, use_global_buffer=False):
    """forward: all-gather dim 0 (rank r contributes ``output_split_sizes[r]`` rows when given),
    backward: reduce-scatter dim 0 (split it when ``tensor_parallel_output_grad`` is False)."""
    group = _tp(group)
    if output_split_sizes is None:
        return _m.gather_from_sequence_parallel_region(input_, group, tensor_parallel_output_grad)
    if not tensor_parallel_output_grad:
        raise ValueError("output_split_sizes needs tensor_parallel_output_grad=True "
                         "(as in Megatron)")
    return all_gather_v(input_, group, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                               use_global_buffer=False):
    """forward: reduce-scatter dim 0 (rank r keeps ``input_split_sizes[r]`` rows when given),
    backward: all-gather dim 0."""
    group = _tp(group)
    if input_split_sizes is None:
        return _m.reduce_scatter_to_sequence_parallel_region(input_, group)
    return reduce_scatter_v(input_, group, input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """forward: all-gather the last dim, backward: reduce-scatter it."""
    return _m.all_gather_last_dim_region(input_, _tp(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """forward: reduce-scatter the last dim, backward: all-gather it."""
    return _m.reduce_scatter_last_dim_region(input_, _tp(group))


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    """All-to-all of dim-0 rows over ``group`` (required, as in Megatron); backward reverses it."""
    if group is None:
        raise ValueError("all_to_all: group must be given (Megatron's signature has no default)")
    return _m.all_to_all_region(input_, group, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_, group=None):
    """``[tokens/tp, h] -> [tokens, h/tp]``: each rank sends hidden slice j of its tokens to j."""
    group = _tp(group)
    size = _m.group_size(group)
    flat = input_.reshape(-1, input_.shape[-1])                       # (n/tp, h)
    _m.check_divisible(flat, -1, size, "all_to_all_sp2hp")
    by_slice = torch.cat(flat.chunk(size, dim=-1), dim=0)            # (tp · n/tp, h/tp)
    return _m.all_to_all_region(by_slice, group)                     # (n, h/tp)


def all_to_all_hp2sp(input_, group=None):
    """``[tokens, h/tp] -> [tokens/tp, h]``, the inverse of ``all_to_all_sp2hp``."""
    group = _tp(group)
    size = _m.group_size(group)
    flat = input_.reshape(-1, input_.shape[-1])                       # (n, h/tp)
    exchanged = _m.all_to_all_region(flat, group)                    # (tp · n/tp, h/tp)
    return torch.cat(exchanged.chunk(size, dim=0), dim=-1)           # (n/tp, h)


from .mapping_functions import (  # noqa: E402,F401  (Megatron's private Function names)
    _AllGatherFromTensorParallelRegion, _AllToAll, _CopyToModelParallelRegion,
    _GatherFromModelParallelRegion, _GatherFromSequenceParallelRegion,
    _ReduceFromModelParallelRegion, _ReduceScatterToSequenceParallelRegion,
    _ReduceScatterToTensorParallelRegion, _ScatterToModelParallelRegion,
    _ScatterToSequenceParallelRegion)
