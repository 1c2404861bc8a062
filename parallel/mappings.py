"""Conjugate communication primitives for tensor (and sequence) parallelism.

Activations are sequence-first ``[s, b, h]`` as in Megatron: the *sequence* dim is 0, the *hidden*
dim is -1. Each primitive is a small autograd Function paired with its conjugate: what the forward
does (identity, all-reduce, split, all-gather, reduce-scatter) the backward undoes with the
transposed operation, so that ``y = f(x)`` and ``dx = fᵀ(dy)``:

    copy_to_region                          forward: identity       backward: all-reduce
    copy_many_to_region                     forward: identity       backward: one all-reduce
                                                                    of the grads joined
    reduce_from_region                      forward: all-reduce     backward: identity
    scatter_to_region                       forward: split h        backward: all-gather h
    gather_from_region                      forward: all-gather h   backward: split h
    scatter_to_sequence_parallel_region     forward: split s        backward: all-gather s
    gather_from_sequence_parallel_region    forward: all-gather s   backward: reduce-scatter s
                                                                    (split s if the output grad
                                                                     is not tensor-parallel)
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter s  backward: all-gather s
    all_gather_last_dim_region              forward: all-gather h   backward: reduce-scatter h
    reduce_scatter_last_dim_region          forward: reduce-scatter h  backward: all-gather h
    all_to_all_region                       forward: all-to-all rows  backward: the reverse

Every one takes its process group explicitly (``None`` is torch's world group); those that
reduce-scatter also take ``options`` (a ``parallel.comm_options.CommOptions``: native
reduce-scatter or all-reduce + own slice, by default by the group's backend; None = the
defaults). Each is the identity at group size 1 (or when ``torch.distributed`` is not
initialised). A dim that does not divide by the group size raises ``ValueError`` before any
collective is entered. Megatron's names,
argument order and default group (the default ParallelState's TP group) are in
``tpfuse.megatron_compat.tensor_parallel.mappings``; ``default_tensor_parallel_group(group)``
resolves that default.

The plain (non-autograd) collectives ``all_gather_first_dim`` / ``reduce_scatter_first_dim`` are
public too: the fused comm+GEMM kernels use them for their unfused fallback.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_options import REDUCE_SCATTER_STRATEGIES, CommOptions, options_or_default  # noqa: F401
from .reduce_scatter import reduce_scatter_tensor


# ----------------------------------------------------------------------------- group arithmetic

def group_size(group) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group`` (0 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    """ValueError naming the sizes when ``x.shape[dim]`` does not split into ``size`` parts."""
    if x.dim() == 0:
        raise ValueError(f"{what}: expected a tensor with at least one dim, got a scalar")
    if x.shape[dim] % size != 0:
        name = "sequence dim 0" if dim == 0 else f"dim {dim}"
        raise ValueError(f"{what}: {name} of size {x.shape[dim]} (shape {tuple(x.shape)}) is not "
                         f"divisible by the group size {size}")


# ----------------------------------------------------------------------------- plain collectives

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_first_dim(x: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``x`` along dim 0: ``(s/tp, ...) -> (s, ...)``. Not differentiable
    (the autograd Functions below are); with ``async_op=True`` returns ``(out, work)``, ``out``
    valid after ``work.wait()``.
    """
    size = group_size(group)
    if size == 1:
        return (x, None) if async_op else x
    x = x.detach().contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_single(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_first_dim(x: torch.Tensor, group, options: CommOptions | None = None):
    """Sum ``x`` over the ranks and keep this rank's dim-0 slice: ``(s, ...) -> (s/tp, ...)``,
    by ``options.reduce_scatter`` (``parallel.reduce_scatter.reduce_scatter_tensor``: native,
    or an all-reduce of a copy of ``x`` and the own slice). Not differentiable (the autograd
    Functions below are)."""
    size = group_size(group)
    if size == 1:
        return x
    check_divisible(x, 0, size, "reduce_scatter_first_dim")
    x = x.detach().contiguous()
    rows = x.shape[0] // size
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, x, group, options=options)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split_along(x: torch.Tensor, dim: int, group, what: str) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    check_divisible(x, dim, size, what)
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    stacked = all_gather_first_dim(x.unsqueeze(0), group)           # (tp, ..., h/tp)
    return torch.cat(stacked.unbind(0), dim=-1)                      # (..., h)


# ----------------------------------------------------------------------------- autograd Functions

class _CopyToRegion(torch.autograd.Function):
    """forward: identity, backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group), None


class _CopyManyToRegion(torch.autograd.Function):
    """forward: identity on each tensor, backward: one all-reduce of the flattened grads joined."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group, ctx.numels = group, [x.numel() for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *dys):
        joined = _all_reduce(torch.cat([dy.reshape(-1) for dy in dys]), ctx.group)
        return (None, *(part.view_as(dy) for part, dy in zip(joined.split(ctx.numels), dys)))


class _ReduceFromRegion(torch.autograd.Function):
    """forward: all-reduce, backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToRegion(torch.autograd.Function):
    """forward: split the last (hidden) dim, keep this rank's part; backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, -1, group, "scatter_to_region")

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last_dim(dy, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """forward: all-gather the last (hidden) dim; backward: split it, keep this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _split_along(dy, -1, ctx.group, "gather_from_region backward"), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: split the sequence dim 0, keep this rank's part; backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along(x, 0, group, "scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, dy):
        return all_gather_first_dim(dy, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """forward: all-gather dim 0; backward: reduce-scatter dim 0 (split if the grad is replicated)."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, options):
        ctx.group, ctx.options = group, options
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first_dim(dy, ctx.group, ctx.options), None, None, None
        return (_split_along(dy, 0, ctx.group, "gather_from_sequence_parallel_region"), None, None,
                None)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: reduce-scatter dim 0; backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group, options):
        ctx.group = group
        return reduce_scatter_first_dim(x, group, options)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_first_dim(dy, ctx.group), None, None


# ----------------------------------------------------------------------------- public functions

def copy_to_region(x, group):
    """forward: identity, backward: all-reduce. ``(s, b, h) -> (s, b, h)``."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def copy_many_to_region(xs, group) -> tuple:
    """``copy_to_region`` of every tensor of ``xs`` with one all-reduce in backward (their
    grads flattened and joined): a norm's weight and bias in one collective."""
    xs = tuple(xs)
    return xs if group_size(group) == 1 else _CopyManyToRegion.apply(group, *xs)


def reduce_from_region(x, group):
    """forward: all-reduce, backward: identity. ``(s, b, h) -> (s, b, h)``."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x, group):
    """forward: split the hidden (last) dim, backward: all-gather it. ``(s, b, h) -> (s, b, h/tp)``."""
    if group_size(group) == 1:
        return x
    check_divisible(x, -1, group_size(group), "scatter_to_region")
    return _ScatterToRegion.apply(x, group)


def gather_from_region(x, group):
    """forward: all-gather the hidden (last) dim, backward: split it. ``(s, b, h/tp) -> (s, b, h)``."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """forward: split the sequence dim 0, backward: all-gather it. ``(s, b, h) -> (s/tp, b, h)``."""
    if group_size(group) == 1:
        return x
    check_divisible(x, 0, group_size(group), "scatter_to_sequence_parallel_region")
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True, *,
                                         options: CommOptions | None = None):
    """forward: all-gather the sequence dim 0, backward: reduce-scatter it (split it if
    ``tensor_parallel_output_grad=False``, i.e. the output's grad is the same on every rank).
    ``(s/tp, b, h) -> (s, b, h)``; ``options``: how the reduce-scatter runs."""
    if isinstance(group, bool):
        raise TypeError("gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad)"
                        f": got the bool {group} as group; Megatron's argument order (x, "
                        "tensor_parallel_output_grad, group) is tpfuse.megatron_compat's")
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, bool(tensor_parallel_output_grad),
                                                   options)


def reduce_scatter_to_sequence_parallel_region(x, group, *, options: CommOptions | None = None):
    """forward: reduce-scatter the sequence dim 0 (as ``options`` says), backward: all-gather
    it. ``(s, b, h) -> (s/tp, b, h)``."""
    if group_size(group) == 1:
        return x
    check_divisible(x, 0, group_size(group), "reduce_scatter_to_sequence_parallel_region")
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, options)


# ----------------------------------------------------------------------------- hidden-dim pair, all-to-all

def _reduce_scatter_last_dim(x: torch.Tensor, group, options=None) -> torch.Tensor:
    """Sum over the ranks and keep this rank's slice of the last dim: (..., h) -> (..., h/tp)."""
    size = group_size(group)
    if size == 1:
        return x
    check_divisible(x, -1, size, "reduce_scatter_last_dim")
    stacked = torch.stack(x.chunk(size, dim=-1))                     # (tp, ..., h/tp)
    return reduce_scatter_first_dim(stacked, group, options)[0]      # (..., h/tp)


def _all_to_all(x: torch.Tensor, group, output_split_sizes, input_split_sizes):
    if group_size(group) == 1:
        return x
    x = x.detach().contiguous()
    rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return out


class _AllGatherLastDim(torch.autograd.Function):
    """forward: all-gather the last dim; backward: reduce-scatter it (the output's grads differ
    per rank, unlike gather_from_region's)."""

    @staticmethod
    def forward(ctx, x, group, options):
        ctx.group, ctx.options = group, options
        return _all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_last_dim(dy, ctx.group, ctx.options), None, None


class _ReduceScatterLastDim(torch.autograd.Function):
    """forward: reduce-scatter the last dim; backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group, options):
        ctx.group = group
        return _reduce_scatter_last_dim(x, group, options)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last_dim(dy, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all along dim 0 (rows split by ``input_split_sizes``, received rows by
    ``output_split_sizes``; equal parts when None); backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        return _all_to_all(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, dy):
        output_split_sizes, input_split_sizes = ctx.splits
        dx = _all_to_all(dy, ctx.group, input_split_sizes, output_split_sizes)
        return dx, None, None, None


def all_gather_last_dim_region(x, group, *, options: CommOptions | None = None):
    """forward: all-gather the hidden (last) dim, backward: reduce-scatter it (as ``options``
    says). ``(s, b, h/tp) -> (s, b, h)``."""
    return x if group_size(group) == 1 else _AllGatherLastDim.apply(x, group, options)


def reduce_scatter_last_dim_region(x, group, *, options: CommOptions | None = None):
    """forward: reduce-scatter the hidden (last) dim (as ``options`` says), backward:
    all-gather it. ``(s, b, h) -> (s, b, h/tp)``."""
    if group_size(group) == 1:
        return x
    check_divisible(x, -1, group_size(group), "reduce_scatter_last_dim_region")
    return _ReduceScatterLastDim.apply(x, group, options)


def all_to_all_region(x, group, output_split_sizes=None, input_split_sizes=None):
    """forward: all-to-all of dim-0 rows, backward: the reverse all-to-all. Equal splits need
    dim 0 divisible by the group size."""
    if group_size(group) == 1:
        return x
    if input_split_sizes is None:
        check_divisible(x, 0, group_size(group), "all_to_all_region")
    return _AllToAll.apply(x, group, output_split_sizes, input_split_sizes)


def default_tensor_parallel_group(group=None):
    """``group``, else the default ParallelState's TP group (Megatron's default when a mapping
    is called without a group); None in a plain process without torch.distributed."""
    if group is not None:
        return group
    from tpfuse.parallel.state import resolve_state_or_none

    state = resolve_state_or_none()
    return None if state is None else state.tp_group
