"""megatron-core 0.16's ``_ParamAndGradBuffer`` / ``_ParamAndGradBucket`` /
``_ParamAndGradBucketGroup`` as views of tpfuse's gradient buffers (``training/grad_buffers.py``):
what ``DistributedDataParallel.buffers`` / ``.expert_parallel_buffers`` / ``.bucket_groups``
hold, with the attributes Megatron's scripts and optimizer read. The tensors are tpfuse's
(``grad_data`` / ``param_data`` are the very buffers ``param.main_grad`` / ``param.data`` view);
the reductions run through the DDP's methods.

Megatron's bookkeeping, in buffer coordinates (parameters laid out in reverse order, bucket b
covering ``[start_b, end_b)`` with ``end_b`` padded)::

    param_index_map[p]   = (start_p, end_p, b)          bucket_indices[b] = (start_b, end_b)
    bucket.param_to_index[p] = (Σ_{q before p in b} numel_q, that + numel_p)   (no padding)
    bucket.numel_unpadded = (end of the bucket's last parameter) − start_b, that end rounded up
                            to 64 when the bucket was closed early for a shared embedding
    numel = end_last_bucket,                   numel_unpadded = Σ_b bucket.numel_unpadded
"""
from __future__ import annotations

from tpfuse.training.grad_buffers import PARAM_ALIGNMENT


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _ViewOfNative:
    """``param_data`` / ``grad_data``: the flat tensors of the tpfuse object ``self.native``."""

    @property
    def grad_data(self):
        return self.native.grad_data

    @property
    def param_data(self):
        return self.native.param_data


class _ParamAndGradBucket(_ViewOfNative):
    """One bucket of a buffer: ``params_list`` (buffer order), ``params`` (a set), its slices
    ``grad_data`` / ``param_data``, ``offset`` in the buffer, ``bucket_id``."""

    def __init__(self, native, numel_unpadded: int, gradient_scaling_factor: float):
        self.native = native
        self.params_list = list(native.params)
        self.params = set(self.params_list)
        self.offset = native.offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = native.index
        self.param_to_index, start = {}, 0
        for param in self.params_list:
            self.param_to_index[param] = (start, start + param.numel())
            start += param.numel()


class _ParamAndGradBuffer(_ViewOfNative):
    """One flat buffer (one param dtype, one grad dtype, one reduce group) of a DDP chunk."""

    def __init__(self, native, ddp_config, bucket_size: int | None):
        self.native, self.ddp_config = native, ddp_config
        self.params = list(native.params)                       # registration order
        self.param_indices = list(range(len(self.params)))      # among same-dtype params
        self.param_dtype, self.grad_dtype = native.param_dtype, native.grad_dtype
        self.data_parallel_group = native.group
        self.data_parallel_world_size = native.dp_size
        self.gradient_scaling_factor = native.gradient_scaling_factor
        self.param_index_map, self.param_to_bucket, self.buckets = {}, {}, []
        self.bucket_indices = [(b.start, b.end) for b in native.plan.buckets]
        unpadded = _bucket_numels_unpadded(native, bucket_size)
        for native_bucket, numel_unpadded in zip(native.buckets, unpadded):
            bucket = _ParamAndGradBucket(native_bucket, numel_unpadded,
                                         self.gradient_scaling_factor)
            self.buckets.append(bucket)
            for param in bucket.params_list:
                start, end = native.range_of[id(param)]
                self.param_index_map[param] = (start, end, bucket.bucket_id)
                self.param_to_bucket[param] = bucket
        self.numel = native.plan.numel
        self.numel_unpadded = sum(unpadded)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale the gradient data by ``scaling_factor``."""
        self.native.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradients."""
        self.native.reset()


def _bucket_numels_unpadded(native, bucket_size: int | None) -> list:
    """Megatron's per-bucket unpadded sizes: up to the end of the last parameter; a bucket the
    distributed optimizer closed before a shared-embedding parameter (not full, not that
    parameter's own) counts up to that parameter's 64-aligned start."""
    plans, ranges = native.plan.buckets, native.plan.ranges
    sizes = []
    for index, plan in enumerate(plans):
        end = max(ranges[i][1] for i in plan.params)
        following = plans[index + 1].params[0] if index + 1 < len(plans) else None
        closed_early = (following is not None and _alone(native, following)
                        and not _alone(native, plan.params[-1])
                        and (bucket_size is None or end - plan.start < bucket_size))
        sizes.append((_round_up(end, PARAM_ALIGNMENT) if closed_early else end) - plan.start)
    return sizes


def _alone(native, index: int) -> bool:
    """Whether parameter ``index`` of the buffer has a bucket of its own (the tied embedding
    with the distributed optimizer)."""
    return id(native.params[index]) in native.own_bucket


class _ParamAndGradBucketGroup:
    """Buckets reduced together: each bucket its own group (tpfuse reduces bucket by bucket),
    every bucket of the chunk's buffers in one with ``disable_bucketing``."""

    def __init__(self, buckets, ddp_config, data_parallel_group):
        self.buckets, self.ddp_config = buckets, ddp_config
        self.data_parallel_group = data_parallel_group
        self.param_to_bucket = {p: b for b in buckets for p in b.params_list}
        self.params = set(self.param_to_bucket)
        self.next_param_gather_bucket_group = None


def partition_buckets(buffers, ddp_config, force_single_bucket_group: bool = False) -> list:
    """Megatron's grouping without fp8 buffers: one group per bucket, or one for all."""
    if not buffers:
        return []
    if force_single_bucket_group:
        buckets = [bucket for buffer in buffers for bucket in buffer.buckets]
        return [_ParamAndGradBucketGroup(buckets, ddp_config, buffers[0].data_parallel_group)]
    return [_ParamAndGradBucketGroup([bucket], ddp_config, buffer.data_parallel_group)
            for buffer in buffers for bucket in buffer.buckets]
