"""Variable-size collectives of the token dispatchers, as conjugate autograd Functions.

Rows (dim 0) move; every rank knows every split size (the dispatcher exchanges counts first):

    all_to_all(x, group, out_splits, in_splits)   forward: rank r sends in_splits[q] rows to q and
                                                  receives out_splits[q] rows from q, in q order
                                                  backward: all_to_all with the splits swapped
    all_gather_v(x, group, sizes)                 forward: concatenate every rank's rows (sizes[q]
                                                  from rank q);  backward: reduce_scatter_v
    reduce_scatter_v(x, group, sizes)             forward: sum over ranks, keep my sizes[me] rows
                                                  of the [sizes[0] | sizes[1] | …] layout
                                                  backward: all_gather_v

The uneven gather / reduce-scatter pad every rank's block to the largest size and use the even
collectives (NCCL and gloo alike); each is the identity at group size 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.mappings import all_gather_first_dim, all_to_all_region, group_rank
from tpfuse.parallel.mappings import group_size, reduce_scatter_first_dim


def _pad_rows(x, rows):
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def _all_gather_v(x, group, sizes):
    largest = max(sizes)
    if largest == 0:
        return x.detach().clone()
    gathered = all_gather_first_dim(_pad_rows(x.detach().contiguous(), largest), group)
    blocks = gathered.split(largest)                                     # one per rank
    return torch.cat([block[:rows] for block, rows in zip(blocks, sizes)])


def _reduce_scatter_v(x, group, sizes, options=None):
    largest = max(sizes)
    if largest == 0:
        return x.detach().clone()
    blocks = x.detach().split(list(sizes))
    padded = torch.cat([_pad_rows(block, largest) for block in blocks])
    return reduce_scatter_first_dim(padded, group, options)[:sizes[group_rank(group)]]


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, options):
        ctx.group, ctx.sizes, ctx.options = group, sizes, options
        return _all_gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_v(dy, ctx.group, ctx.sizes, ctx.options), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, options):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_v(x, group, sizes, options)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_v(dy, ctx.group, ctx.sizes), None, None, None


def all_to_all(x, group, out_splits, in_splits):
    """``(Σ in_splits, ...)`` → ``(Σ out_splits, ...)`` (see the module docstring)."""
    return all_to_all_region(x, group, list(out_splits), list(in_splits))


def all_gather_v(x, group, sizes, options=None):
    """``(sizes[me], ...)`` → ``(Σ sizes, ...)``; ``options``: how backward reduce-scatters."""
    if group_size(group) == 1:
        return x
    return _AllGatherV.apply(x, group, tuple(sizes), options)


def reduce_scatter_v(x, group, sizes, options=None):
    """``(Σ sizes, ...)`` → ``(sizes[me], ...)`` summed over the group (reduce-scatter as
    ``options``, a ``parallel.comm_options.CommOptions``, says)."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, group, tuple(sizes), options)


# ----------------------------------------------------------------------------- in flight
# An all-to-all started in one call and finished in another, so that other work (the shared
# expert) runs while it travels:  out, pending = start_all_to_all(x, ...); ...; out =
# wait_all_to_all(out, pending). Backward mirrors it: the gradient's reverse all-to-all starts in
# the wait's backward and is finished in the start's, and autograd runs the nodes created between
# the two (the shared expert's, whose sequence numbers lie between them) in that window.

class PendingAllToAll:
    """One exchange in flight: its group and splits, the work handle and the buffer it reads."""

    def __init__(self, group, out_splits, in_splits):
        self.group, self.out_splits, self.in_splits = group, list(out_splits), list(in_splits)
        self.work = self.sent = self.received = None

    def launch(self, x, out_splits, in_splits):
        self.sent = x.detach().contiguous()
        out = self.sent.new_empty((sum(out_splits),) + tuple(self.sent.shape[1:]))
        self.work = dist.all_to_all_single(out, self.sent, output_split_sizes=out_splits,
                                           input_split_sizes=in_splits, group=self.group,
                                           async_op=True)
        return out

    def finish(self):
        self.work.wait()
        self.work = self.sent = None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        return pending.launch(x, pending.out_splits, pending.in_splits)

    @staticmethod
    def backward(ctx, _):               # the gradient travels in the exchange the wait started
        pending = ctx.pending
        dx = pending.received
        pending.finish()
        pending.received = None
        return dx, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending):
        ctx.pending = pending
        pending.finish()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dy):
        """Starts dy's reverse exchange; hands dy on only as the start's (ignored) input."""
        pending = ctx.pending
        pending.received = pending.launch(dy, pending.in_splits, pending.out_splits)
        return dy, None


def start_all_to_all(x, group, out_splits, in_splits):
    """``all_to_all`` begun: ``(out, pending)``; ``out`` is valid after ``wait_all_to_all``.
    At group size 1 the exchange is the identity: ``(x, None)``."""
    if group_size(group) == 1:
        return x, None
    pending = PendingAllToAll(group, out_splits, in_splits)
    return _StartAllToAll.apply(x, pending), pending


def wait_all_to_all(out, pending):
    """The rows of a started exchange, once it has arrived."""
    return out if pending is None else _WaitAllToAll.apply(out, pending)
