"""megatron-core 0.16's ``tensor_parallel.mappings``: Megatron's names, argument order and
default group (the default ParallelState's tensor-parallel group when ``group`` is None), over
``tpfuse.parallel.mappings``' autograd Functions.

``output_split_sizes`` / ``input_split_sizes`` (uneven sequence splits, used by MoE token
dispatch) are supported; ``use_global_buffer`` is accepted and only changes where Megatron
allocates the result, never its value.

Megatron's private autograd Functions of this module are here under Megatron's names too, for
code (and Megatron's unit tests) that calls them directly: ``forward(ctx, input_, group, ...)``,
``backward(ctx, grad_output)`` reading ``ctx.group`` (and the saved options), and
``symbolic(graph, input_, group, ...)`` computing the forward. Each is a pair of conjugate
collectives; the collectives themselves are the region functions above them (tpfuse's Functions
underneath), called outside autograd::

    _CopyToModelParallelRegion            identity          | all-reduce
    _ReduceFromModelParallelRegion        all-reduce        | identity
    _ScatterToModelParallelRegion         split last dim    | all-gather last dim
    _GatherFromModelParallelRegion        all-gather last   | split last dim
    _ScatterToSequenceParallelRegion      split first dim   | all-gather first dim
    _GatherFromSequenceParallelRegion     all-gather first  | reduce-scatter first (or split)
    _ReduceScatterToSequenceParallelRegion reduce-scatter 1st | all-gather first dim
    _AllGatherFromTensorParallelRegion    all-gather last   | reduce-scatter last dim
    _ReduceScatterToTensorParallelRegion  reduce-scatter last | all-gather last dim
    _AllToAll                             all-to-all        | all-to-all, splits swapped
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


# --------------------------------------------------------------------------- Megatron's Functions

def _plain(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _conjugate_pair(name: str, forward_fn, backward_fn, *backward_args):
    """A Function named ``name`` whose forward (and symbolic) is ``forward_fn(input_, group)`` and
    whose backward is ``backward_fn(grad_output, *backward_args, ctx.group)`` (region functions of
    this module): the shape every plain conjugate pair of the module docstring's table shares."""
    def symbolic(graph, input_, group):
        return _plain(forward_fn, input_, group)

    def forward(ctx, input_, group):
        ctx.group = group
        return _plain(forward_fn, input_, group)

    def backward(ctx, grad_output):
        return _plain(backward_fn, grad_output, *backward_args, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"symbolic": staticmethod(symbolic), "forward": staticmethod(forward),
                 "backward": staticmethod(backward), "__module__": __name__,
                 "__qualname__": name})


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group):
        return input_

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _plain(reduce_from_tensor_model_parallel_region, grad_output,
                      ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group):
        return _plain(reduce_from_tensor_model_parallel_region, input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        return _plain(reduce_from_tensor_model_parallel_region, input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


_ScatterToModelParallelRegion = _conjugate_pair(
    "_ScatterToModelParallelRegion", scatter_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region)


_GatherFromModelParallelRegion = _conjugate_pair(
    "_GatherFromModelParallelRegion", gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region)


_ScatterToSequenceParallelRegion = _conjugate_pair(
    "_ScatterToSequenceParallelRegion", scatter_to_sequence_parallel_region,
    gather_from_sequence_parallel_region, False)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, tensor_parallel_output_grad=True, group=None,
                 output_split_sizes=None, use_global_buffer=False):
        return _plain(gather_from_sequence_parallel_region, input_,
                      tensor_parallel_output_grad, group, output_split_sizes)

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True, group=None,
                output_split_sizes=None, use_global_buffer=False):
        ctx.tensor_parallel_output_grad, ctx.group = tensor_parallel_output_grad, group
        ctx.output_split_sizes = output_split_sizes
        return _plain(gather_from_sequence_parallel_region, input_,
                      tensor_parallel_output_grad, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _plain(reduce_scatter_to_sequence_parallel_region, grad_output,
                          ctx.group, ctx.output_split_sizes)
        else:
            grad = _plain(scatter_to_sequence_parallel_region, grad_output, ctx.group)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group, input_split_sizes=None, use_global_buffer=False):
        return _plain(reduce_scatter_to_sequence_parallel_region, input_, group,
                      input_split_sizes)

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes=None, use_global_buffer=False):
        ctx.group, ctx.input_split_sizes = group, input_split_sizes
        return _plain(reduce_scatter_to_sequence_parallel_region, input_, group,
                      input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _plain(gather_from_sequence_parallel_region, grad_output, False,
                      ctx.group, ctx.input_split_sizes), None, None, None


_AllGatherFromTensorParallelRegion = _conjugate_pair(
    "_AllGatherFromTensorParallelRegion", all_gather_last_dim_from_tensor_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region)


_ReduceScatterToTensorParallelRegion = _conjugate_pair(
    "_ReduceScatterToTensorParallelRegion", reduce_scatter_last_dim_to_tensor_parallel_region,
    all_gather_last_dim_from_tensor_parallel_region)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return _plain(all_to_all, group, input, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _plain(all_to_all, ctx.group, grad_output[0],
                             ctx.input_split_sizes, ctx.output_split_sizes), None, None)
