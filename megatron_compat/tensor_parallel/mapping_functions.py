"""megatron-core 0.16's private autograd Functions of ``tensor_parallel.mappings`` under
Megatron's names, for code (and Megatron's unit tests) that calls them directly:
``forward(ctx, input_, group, ...)``, ``backward(ctx, grad_output)`` reading ``ctx.group``
(and the saved options), and ``symbolic(graph, input_, group, ...)`` computing the forward.

Each is a pair of conjugate collectives; the collectives themselves are the region functions of
``mappings`` (tpfuse's Functions underneath), called here outside autograd::

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


def _maps():
    from . import mappings
    return mappings


def _plain(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _conjugate_pair(name: str, forward_fn: str, backward_fn: str, *backward_args):
    """A Function named ``name`` whose forward (and symbolic) is ``mappings.<forward_fn>(input_,
    group)`` and whose backward is ``mappings.<backward_fn>(grad_output, *backward_args,
    ctx.group)``: the shape every plain conjugate pair of the table above shares."""
    def run(fn_name, tensor, *args):
        return _plain(getattr(_maps(), fn_name), tensor, *args)

    def symbolic(graph, input_, group):
        return run(forward_fn, input_, group)

    def forward(ctx, input_, group):
        ctx.group = group
        return run(forward_fn, input_, group)

    def backward(ctx, grad_output):
        return run(backward_fn, grad_output, *backward_args, ctx.group), None

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
        return _plain(_maps().reduce_from_tensor_model_parallel_region, grad_output,
                      ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group):
        return _plain(_maps().reduce_from_tensor_model_parallel_region, input_, group)

    @staticmethod
    def forward(ctx, input_, group):
        return _plain(_maps().reduce_from_tensor_model_parallel_region, input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


_ScatterToModelParallelRegion = _conjugate_pair(
    "_ScatterToModelParallelRegion", "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region")


_GatherFromModelParallelRegion = _conjugate_pair(
    "_GatherFromModelParallelRegion", "gather_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region")


_ScatterToSequenceParallelRegion = _conjugate_pair(
    "_ScatterToSequenceParallelRegion", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", False)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, tensor_parallel_output_grad=True, group=None,
                 output_split_sizes=None, use_global_buffer=False):
        return _plain(_maps().gather_from_sequence_parallel_region, input_,
                      tensor_parallel_output_grad, group, output_split_sizes)

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad=True, group=None,
                output_split_sizes=None, use_global_buffer=False):
        ctx.tensor_parallel_output_grad, ctx.group = tensor_parallel_output_grad, group
        ctx.output_split_sizes = output_split_sizes
        return _plain(_maps().gather_from_sequence_parallel_region, input_,
                      tensor_parallel_output_grad, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        maps = _maps()
        if ctx.tensor_parallel_output_grad:
            grad = _plain(maps.reduce_scatter_to_sequence_parallel_region, grad_output,
                          ctx.group, ctx.output_split_sizes)
        else:
            grad = _plain(maps.scatter_to_sequence_parallel_region, grad_output, ctx.group)
        return grad, None, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def symbolic(graph, input_, group, input_split_sizes=None, use_global_buffer=False):
        return _plain(_maps().reduce_scatter_to_sequence_parallel_region, input_, group,
                      input_split_sizes)

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes=None, use_global_buffer=False):
        ctx.group, ctx.input_split_sizes = group, input_split_sizes
        return _plain(_maps().reduce_scatter_to_sequence_parallel_region, input_, group,
                      input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _plain(_maps().gather_from_sequence_parallel_region, grad_output, False,
                      ctx.group, ctx.input_split_sizes), None, None, None


_AllGatherFromTensorParallelRegion = _conjugate_pair(
    "_AllGatherFromTensorParallelRegion", "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region")


_ReduceScatterToTensorParallelRegion = _conjugate_pair(
    "_ReduceScatterToTensorParallelRegion", "reduce_scatter_last_dim_to_tensor_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return _plain(_maps().all_to_all, group, input, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, _plain(_maps().all_to_all, ctx.group, grad_output[0],
                             ctx.input_split_sizes, ctx.output_split_sizes), None, None)
