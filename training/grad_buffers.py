"""Contiguous parameter / gradient buffers cut into buckets (Megatron's param_and_grad_buffer).

Every trainable parameter of one reduce group (dense or expert) and one (param dtype, grad dtype)
pair gets a slice of one flat gradient buffer; ``param.main_grad`` is that slice viewed in the
parameter's shape, and micro-batch gradients accumulate there (``kernels/wgrad.py`` writes weight
gradients straight into it). Parameters are laid out in *reverse* registration order, roughly the
order backward produces their gradients, and consecutive parameters are grouped into buckets of
about ``bucket_size`` elements; a bucket is reduced over the data-parallel group as one message::

    buffer  [ p_last ... | ... p_k | p_k-1 ... p_0 ]        (one dtype, one reduce group)
             └ bucket 0 ┘ └ bucket 1 ┘ └ bucket 2 ┘

With the distributed optimizer the buffer also holds the parameters themselves (``param.data``
becomes a view of ``param_data``), each parameter starts at a multiple of 64 elements and each
bucket is padded to a multiple of lcm(dp, 128), so every data-parallel rank r owns the same-size
contiguous shard ``[r·P/dp, (r+1)·P/dp)`` of every bucket (P its padded size): gradients are
reduce-scattered into that shard, the optimizer updates it, and the parameters are all-gathered
back. The word embedding tied between the first and last pipeline stage gets a bucket of its own
there on both stages, so they cut it into identical shards (its gradients are summed across the
stages after the reduce-scatter).

Hybrid sharding (``--num-distributed-optimizer-instances`` N > 1): the buffer is sharded over the
ranks of one optimizer instance (the intra group, dp/N ranks) and ``replica_group`` holds the
ranks of the other instances with the same shard (N ranks): a shard reduce-scattered inside the
instance is then all-reduced across the instances, so every replica of it holds the full sum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PARAM_ALIGNMENT = 64          # elements (Megatron: 128-byte aligned for >= 16-bit values)
BUCKET_ALIGNMENT = 128


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: buffer range ``[start, end)`` (end padded) and its parameters' indices."""
    start: int
    end: int
    params: tuple


@dataclass(frozen=True)
class BufferPlan:
    """Where every parameter lives in the buffer: ``ranges[i] = (start, end)`` of parameter i."""
    ranges: tuple
    buckets: tuple
    numel: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_buffer(numels, bucket_size: int | None, shard_over: int | None = None,
                own_bucket=None) -> BufferPlan:
    """Lay out parameters of sizes ``numels`` (registration order) in reverse order.

    A bucket closes once it holds >= ``bucket_size`` elements (None: one bucket). With
    ``shard_over = dp`` (distributed optimizer) parameters start at multiples of 64 and buckets end
    at multiples of lcm(dp, 128); ``own_bucket[i]`` puts parameter i in a bucket of its own.
    """
    own_bucket = own_bucket or [False] * len(numels)
    param_align = PARAM_ALIGNMENT if shard_over else 1
    bucket_align = math.lcm(shard_over, BUCKET_ALIGNMENT) if shard_over else 1
    ranges, buckets = [None] * len(numels), []
    bucket_start, cursor, members = 0, 0, []

    def close(end: int) -> int:
        nonlocal bucket_start, members
        padded = _round_up(end, bucket_align)
        buckets.append(BucketPlan(bucket_start, padded, tuple(members)))
        bucket_start, members = padded, []
        return padded

    for index in reversed(range(len(numels))):
        if own_bucket[index] and members:
            cursor = close(cursor)
        start = _round_up(cursor, param_align)
        ranges[index] = (start, start + numels[index])
        members.append(index)
        cursor = start + numels[index]
        full = bucket_size is not None and cursor - bucket_start >= bucket_size
        if full or own_bucket[index]:
            cursor = close(cursor)
    if members:
        cursor = close(cursor)
    return BufferPlan(tuple(ranges), tuple(buckets), cursor)


class Bucket:
    """A contiguous piece of a buffer reduced as one message; ``shard(t, r)`` is rank r's part."""

    def __init__(self, index: int, params: list, grad_data: torch.Tensor,
                 param_data: torch.Tensor | None, offset: int, dp_size: int):
        self.index = index
        self.params = params                  # buffer order
        self.grad_data = grad_data            # (padded numel,)
        self.param_data = param_data          # (padded numel,) with the distributed optimizer
        self.offset = offset                  # of grad_data in the buffer
        self.dp_size = dp_size
        self.grad_work = None                 # in-flight reduction
        self.param_work = None                # in-flight parameter all-gather

    def shard(self, data: torch.Tensor, rank: int) -> torch.Tensor:
        size = data.numel() // self.dp_size
        return data[rank * size:(rank + 1) * size]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """This rank's shard in buffer coordinates."""
        size = self.grad_data.numel() // self.dp_size
        return self.offset + rank * size, self.offset + (rank + 1) * size


class ParamAndGradBuffer:
    """The flat buffers of ``params`` (one param dtype, one grad dtype, one reduce group).

    ``group`` / ``dp_size`` / ``dp_rank``: the group the gradients are reduced over;
    ``gradient_scaling_factor`` multiplies every gradient before the (sum) reduction (1/dp for an
    average). ``distributed``: hold the parameters too and pad for sharding (see module docstring);
    ``own_bucket``: ids of parameters that get a bucket of their own then; ``replica_group`` /
    ``replicas``: the group holding the same shard in the other optimizer instances and its size
    (1: no hybrid sharding).
    """

    def __init__(self, params: list, grad_dtype: torch.dtype, group, dp_size: int, dp_rank: int,
                 gradient_scaling_factor: float, bucket_size: int | None,
                 distributed: bool = False, kind: str = "dense", own_bucket=frozenset(),
                 replica_group=None, replicas: int = 1):
        self.params, self.group, self.kind = params, group, kind
        self.replica_group, self.replicas = replica_group, replicas
        self.param_dtype, self.grad_dtype = params[0].dtype, grad_dtype
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.gradient_scaling_factor = gradient_scaling_factor
        self.distributed = distributed
        own = [distributed and id(p) in own_bucket for p in params]
        self.own_bucket = frozenset(id(p) for p, alone in zip(params, own) if alone)
        self.plan = plan_buffer([p.numel() for p in params], bucket_size,
                                dp_size if distributed else None, own)
        device = params[0].device
        self.grad_data = torch.zeros(self.plan.numel, dtype=grad_dtype, device=device)
        self.param_data = (torch.zeros(self.plan.numel, dtype=self.param_dtype, device=device)
                           if distributed else None)
        self.range_of = {}                                    # id(param) -> (start, end)
        for param, (start, end) in zip(params, self.plan.ranges):
            self.range_of[id(param)] = (start, end)
            if self.param_data is not None:
                self._move_into_buffer(param, start, end)
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.buckets = [self._bucket(i, plan) for i, plan in enumerate(self.plan.buckets)]

    def _move_into_buffer(self, param, start: int, end: int) -> None:
        view = self.param_data[start:end].view(param.shape)
        view.copy_(param.data)
        param.data = view

    def _bucket(self, index: int, plan: BucketPlan) -> Bucket:
        param_data = None if self.param_data is None else self.param_data[plan.start:plan.end]
        return Bucket(index, [self.params[i] for i in plan.params],
                      self.grad_data[plan.start:plan.end], param_data, plan.start, self.dp_size)

    def reset(self) -> None:
        """Zero the gradients (start of an optimizer step)."""
        self.grad_data.zero_()

    @property
    def numel_unpadded(self) -> int:
        return sum(p.numel() for p in self.params)
