"""Data-parallel gradient averaging: bucketed, and overlapped with the backward pass.

Over one optimizer step each parameter's gradient is accumulated over ``m`` micro-batch backward
passes. Once a parameter has received all ``m`` of them its gradient is final. Parameters are packed
(in reverse registration order, roughly the order backward produces them) into buckets of about
``bucket_numel`` elements; as soon as every parameter of the next bucket in line is final, that
bucket is flattened, divided by the DP size and all-reduced asynchronously, while the backward of
earlier layers (and, in a pipeline, of later micro-batches of other chunks) goes on::

    g_p  ←  (1/dp) Σ_{dp ranks} g_p

Buckets are launched strictly in bucket order, so every DP rank issues the same collectives in the
same order (a requirement of gloo and NCCL), whatever order its autograd engine finishes them in.
``finish()`` launches what is left (parameters that got fewer than m gradients, e.g. unused ones,
count as zeros), waits for every bucket and copies the averaged values back into ``param.grad``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _Bucket:
    def __init__(self, params):
        self.params = params
        self.flat = None
        self.work = None

    def launch(self, group, dp_size: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp_size)
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        offset = 0
        for param in self.params:
            numel = param.numel()
            value = self.flat[offset:offset + numel].view_as(param)
            if param.grad is None:
                param.grad = value.clone()
            else:
                param.grad.copy_(value)
            offset += numel
        self.flat, self.work = None, None


class DataParallelGradSync:
    """Averages the gradients of ``params`` over ``group`` (the data-parallel group)."""

    def __init__(self, params, group, bucket_numel: int = 2_000_000, overlap: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.overlap = overlap and self.dp_size > 1
        self.buckets = self._make_buckets(bucket_numel)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._expected = 0
        self._counts: dict[int, int] = {}
        self._ready_in_bucket = [0] * len(self.buckets)
        self._next_to_launch = 0
        self._hooks = []
        if self.overlap:
            for param in self.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _make_buckets(self, bucket_numel: int) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for param in reversed(self.params):
            current.append(param)
            size += param.numel()
            if size >= bucket_numel:
                buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def begin_step(self, num_microbatches: int) -> None:
        """Call before the step's forward/backward: each gradient is final after this many."""
        self._expected = num_microbatches
        self._counts = {id(p): 0 for p in self.params}
        self._ready_in_bucket = [0] * len(self.buckets)
        self._next_to_launch = 0

    def _on_grad(self, param) -> None:
        if self._expected == 0:
            return  # outside a training step (e.g. a test's own backward)
        key = id(param)
        self._counts[key] += 1
        if self._counts[key] == self._expected:
            index = self._bucket_of[key]
            self._ready_in_bucket[index] += 1
            self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while (self._next_to_launch < len(self.buckets)
               and self._ready_in_bucket[self._next_to_launch]
               == len(self.buckets[self._next_to_launch].params)):
            self.buckets[self._next_to_launch].launch(self.group, self.dp_size)
            self._next_to_launch += 1

    def finish(self) -> None:
        """Launch the buckets not yet in flight, wait for all, write the averages back."""
        if self.dp_size > 1:
            for bucket in self.buckets[self._next_to_launch:]:
                bucket.launch(self.group, self.dp_size)
            for bucket in self.buckets:
                bucket.finish()
        self._expected = 0
        self._next_to_launch = 0

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
