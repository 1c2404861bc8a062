"""One reduce-scatter for every caller: native, or an all-reduce that keeps this rank's block.

For a group of n ranks and an input of n equal blocks ``x_r = [x_r^0 | ... | x_r^(n-1)]``
(dim 0, or the flat elements), rank k's output is ``Σ_r x_r^k`` (``AVG``: divided by n). The
strategy (``CommOptions.reduce_scatter``, resolved for the group's backend by
``comm_options.resolve_reduce_scatter``) says how:

    native        ``reduce_scatter_tensor(output, input)``
    all_reduce    ``all_reduce(input)`` in place (SUM), then ``output ← input[block k]``
                  (``AVG``: the block divided by n); the same sums, since block k of the
                  all-reduced input is Σ_r x_r^k. Any op other than SUM and AVG runs native.

With ``async_op=True`` the call returns a handle whose ``wait()`` completes the collective and,
for all_reduce, then writes the output: callers that defer completion (the data-parallel
buckets' ``grad_work``, FSDP's host reduce-scatter) wait on it like a ``torch.distributed`` work.
Used by ``parallel.mappings.reduce_scatter_first_dim`` (tensor and sequence parallelism, the MoE
dispatchers, context parallelism), ``training/data_parallel.py`` and ``training/fsdp.py``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_options import CommOptions, options_or_default, resolve_reduce_scatter

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_BLOCK_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)   # what the all-reduce path computes


def reduce_scatter_strategy(group, options: CommOptions | None = None) -> str:
    """"native" or "all_reduce": ``options.reduce_scatter`` (None: the defaults) resolved for
    the backend of ``group``."""
    return resolve_reduce_scatter(options_or_default(options).reduce_scatter,
                                  dist.get_backend(group))


class AllReduceBlockWork:
    """The handle of an asynchronous all-reduce reduce-scatter: ``wait()`` waits for the
    all-reduce, then writes this rank's block (``AVG``: divided by the group size) to the
    output; a second ``wait()`` does nothing."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._work = None
            self._finish()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _copy_block(output: torch.Tensor, summed: torch.Tensor, size: int, rank: int, op) -> None:
    """``output ← summed[block rank]`` (``AVG``: divided by ``size``); nothing to copy when
    ``output`` already is that block (a view into ``summed``, the data-parallel bucket's
    shard)."""
    block = summed.view(size, -1)[rank].view(output.shape)
    if op == dist.ReduceOp.AVG:
        torch.div(block, size, out=output)
    elif output.data_ptr() != block.data_ptr():
        output.copy_(block)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group, *,
                          options: CommOptions | None = None, op=dist.ReduceOp.SUM,
                          async_op: bool = False, preserve_input: bool = True):
    """``output`` (input.numel() / n elements) ← this rank's block of Σ_ranks ``input`` (``op``
    SUM or AVG) over ``group`` of n ranks, by the strategy of ``options`` (None: the defaults;
    see the module docstring). Both tensors contiguous, ``output`` may be a view into
    ``input``. ``preserve_input=False`` lets the all_reduce strategy reduce in ``input`` itself
    (it then holds the full sums); otherwise it reduces a copy. Returns None, or with
    ``async_op=True`` a handle to ``wait()`` on (a ``torch.distributed`` work when native)."""
    strategy = reduce_scatter_strategy(group, options)
    if strategy == "native" or op not in _BLOCK_OPS:
        return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    summed = input.clone() if preserve_input else input
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    work = dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if not async_op:
        _copy_block(output, summed, size, rank, op)
        return None
    return AllReduceBlockWork(work, lambda: _copy_block(output, summed, size, rank, op))
