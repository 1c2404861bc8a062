"""Data-parallel gradient reduction over persistent buffers (Megatron's DistributedDataParallel).

``DataParallelBuffers(model_chunks, config, state)`` gives every trainable parameter of a rank's
model chunks a ``param.main_grad`` (a view into a contiguous buffer, ``training/grad_buffers.py``)
and reduces those buffers bucket by bucket over the data-parallel group::

    g_p  ←  Σ_{ranks of the group}  g_p / dp_cp              (all-reduce, or reduce-scatter into
                                                              this rank's shard: distributed opt.)

The distributed optimizer's reduce-scatter runs as the state's ``comm_options.reduce_scatter``
says (``parallel.reduce_scatter``; by default NCCL reduce-scatters, gloo all-reduces the bucket
and keeps its shard, the faster there: the same numbers, the buffer is full-size anyway).

Groups: a parameter with ``param.allreduce = False`` (an expert parameter) is reduced over the
expert-data-parallel group ``state.group("edp")``, every other one over the data-parallel group
(data + context when cp > 1, ``state.dp_cp_group``). Both are scaled by 1/dp_cp: the loss is an
average over the tokens of all dp·cp replicas, and an expert's gradient on one rank already sums
over the tokens routed to it from its expert-parallel peers (Megatron's scaling).

Gradient arrival: a hook on each parameter's ``AccumulateGrad`` node moves what autograd produced
(``param.grad``) into ``main_grad`` and counts one contribution; the node runs once per backward
even when the weight gradient was accumulated into ``main_grad`` directly and autograd got None
(``kernels/wgrad.py``). When a zero-bubble I pass deferred that weight-gradient GEMM to a later W
action (``param.deferred_wgrads`` > 0 at the hook), the contribution is counted when W has run
it instead (``param.after_deferred_wgrads``). When every parameter of a bucket has its ``m`` contributions of the step
(``begin_step(m)``), the bucket is final and, with ``overlap_grad_reduce``, its reduction starts at
once, asynchronously, while backward goes on. Buckets of one group start strictly in bucket order,
so every rank of the group issues the same collectives in the same order, whatever order its
autograd engine finishes them in. ``finish_grad_sync()`` starts the rest (a parameter that got
fewer contributions, e.g. an expert no token reached, counts as final then) and waits for all.

Hybrid sharding (``--num-distributed-optimizer-instances`` N, Megatron's partial distributed
optimizer): the distributed optimizer shards over one instance's ranks only (``intra-dp-cp`` /
``intra-edp``, dp_cp/N and edp/N ranks) and each shard is all-reduced across the N instances
(``inter-dp-cp`` / ``inter-edp``) after its reduce-scatter::

    shard  ←  RS_intra(g / dp_cp)          then    shard  ←  AR_inter(shard)

the sum over all dp_cp replicas, as with N = 1. With N > 1 the reduce-scatter of a bucket runs
synchronously when it starts (the all-reduce needs its result; Megatron runs both on one side
stream) and the all-reduce asynchronously with ``overlap_grad_reduce``. Parameters are gathered
inside the instance.

Parameters (distributed optimizer): after the optimizer has updated its shard, ``start_param_sync``
all-gathers every bucket's parameters; with ``overlap_param_gather`` asynchronously, a forward
pre-hook on each module waiting only for the buckets holding that module's parameters, so the
gathers overlap the next forward. ``finish_param_sync()`` waits for all (before saving, say).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.parallel.reduce_scatter import reduce_scatter_tensor

from .grad_buffers import ParamAndGradBuffer

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class DistributedDataParallelConfig:
    """Megatron's DistributedDataParallelConfig fields (flags ``--overlap-grad-reduce`` ...).

    ``bucket_size`` None: max(40M, 1M·dp) elements; without ``overlap_grad_reduce`` one bucket
    per buffer (reduced after backward)."""
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"ddp bucket_size must be >= 1 elements, got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True "
                             "(--overlap-param-gather needs --use-distributed-optimizer)")


def is_expert(param) -> bool:
    """Megatron's marker: expert parameters carry ``allreduce = False``."""
    return not getattr(param, "allreduce", True)


def trainable_parameters(model_chunks) -> list:
    """The chunks' parameters that require a gradient, each once (a tied parameter shared by two
    chunks included once), in module order."""
    seen, params = set(), []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _tied_embedding(model_chunks, state) -> frozenset:
    """ids of the word embedding summed across pipeline stages (GPT chunks; none otherwise).
    Buffers over a subset of a rank's chunks (one per virtual chunk, as Megatron's DDP) hold it
    only when the subset has the pipeline's end chunk (pre_process first, post_process last)."""
    chunks = [getattr(c, "module", c) for c in model_chunks]
    if not all(hasattr(c, "shared_embedding_or_output_weight") for c in chunks):
        return frozenset()
    if state is not None and chunks and state.pp_size > 1:
        first = state.is_pipeline_first_stage()
        end, flag = (chunks[0], "pre_process") if first else (chunks[-1], "post_process")
        if not getattr(end, flag, True):
            return frozenset()
    from tpfuse.models.gpt import tied_embedding_weight

    weight = tied_embedding_weight(model_chunks, state)
    return frozenset() if weight is None else frozenset({id(weight)})


class DataParallelBuffers:
    """The gradient (and, distributed, parameter) buffers of one rank's model chunks."""

    def __init__(self, model_chunks, config: DistributedDataParallelConfig, state):
        self.chunks, self.config, self.state = list(model_chunks), config, state
        self.params = trainable_parameters(self.chunks)
        dp_cp = state.size("dp-cp")
        bucket_size = config.bucket_size or max(40_000_000, 1_000_000 * dp_cp)
        if not config.overlap_grad_reduce:
            bucket_size = None
        self.bucket_size = bucket_size              # elements; None: one bucket per buffer
        groups = {"dense": "dp-cp", "expert": "edp"}
        tied = _tied_embedding(self.chunks, state)
        self.buffers = []
        for kind, base in groups.items():
            name = f"intra-{base}" if config.use_distributed_optimizer else base
            replicas = state.size(f"inter-{base}") if config.use_distributed_optimizer else 1
            by_dtype = {}
            for param in self.params:
                if (kind == "expert") == is_expert(param):
                    grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
                    by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
            for (_, grad_dtype), params in by_dtype.items():
                self.buffers.append(ParamAndGradBuffer(
                    params, grad_dtype, state.group(name), state.size(name), state.rank_in(name),
                    1.0 / dp_cp, bucket_size, distributed=config.use_distributed_optimizer,
                    kind=kind, own_bucket=tied, replicas=replicas,
                    replica_group=state.group(f"inter-{base}") if replicas > 1 else None))
        # buckets of one reduce group, in launch order (a group's buffers one after the other)
        self.queues = {kind: [b for buf in self.buffers if buf.kind == kind for b in buf.buckets]
                       for kind in groups}
        self._buffer_of_bucket = {id(b): buf for buf in self.buffers for b in buf.buckets}
        self._bucket_of = {id(p): b for buf in self.buffers for b in buf.buckets for p in b.params}
        self._lock = threading.Lock()           # CUDA: hooks may run on two autograd threads
        self._expected = 0
        self._counts: dict = {}
        self._ready: dict = {}
        self._launched = {kind: 0 for kind in groups}
        self._grad_accs = []
        self._hook_handles = [self._register_grad_hook(p) for p in self.params]
        if config.overlap_param_gather:
            self._hook_handles += self._register_forward_pre_hooks()

    # ------------------------------------------------------------------ gradients
    def _register_grad_hook(self, param):
        with torch.enable_grad():
            grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]   # AccumulateGrad
        self._grad_accs.append(grad_acc)          # keep the node alive: hooks live on it

        def hook(*unused):
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
            if getattr(param, "deferred_wgrads", 0):
                return              # a zero-bubble W still owes this backward's weight gradient
            count()

        def count():
            if self._expected:
                with self._lock:
                    self._one_contribution(param)
        param.after_deferred_wgrads = count     # called by kernels/wgrad once W has caught up
        return grad_acc.register_hook(hook)

    def _one_contribution(self, param) -> None:
        key = id(param)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] != self._expected:
            return
        bucket = self._bucket_of[key]
        self._ready[id(bucket)] = self._ready.get(id(bucket), 0) + 1
        if self.config.overlap_grad_reduce:
            self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        for kind, queue in self.queues.items():
            while (self._launched[kind] < len(queue)
                   and self._ready.get(id(queue[self._launched[kind]]), 0)
                   == len(queue[self._launched[kind]].params)):
                self._start_reduce(queue[self._launched[kind]], async_op=True)
                self._launched[kind] += 1

    def _start_reduce(self, bucket, async_op: bool) -> None:
        buffer = self._buffer_of_bucket[id(bucket)]
        if buffer.gradient_scaling_factor != 1.0:
            # also for a group of one: an expert gradient with edp = 1 < dp_cp still sums the
            # losses of dp_cp replicas (tokens came from every ep peer) and takes the 1/dp_cp
            bucket.grad_data.mul_(buffer.gradient_scaling_factor)
        if buffer.dp_size == 1 and buffer.replicas == 1:
            return
        if buffer.distributed:      # the shard is a view into the bucket: reduce in place
            shard = bucket.shard(bucket.grad_data, buffer.dp_rank)
            if buffer.dp_size > 1:
                bucket.grad_work = reduce_scatter_tensor(
                    shard, bucket.grad_data, buffer.group, options=self.state.comm_options,
                    async_op=async_op and buffer.replicas == 1, preserve_input=False)
            if buffer.replicas > 1:  # hybrid sharding: the same shard of the other instances
                bucket.grad_work = dist.all_reduce(shard, group=buffer.replica_group,
                                                   async_op=async_op)
        else:
            bucket.grad_work = dist.all_reduce(bucket.grad_data, group=buffer.group,
                                               async_op=async_op)

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (call before the step's first forward)."""
        for buffer in self.buffers:
            buffer.reset()
        for param in self.params:
            param.grad = None

    def begin_step(self, num_microbatches: int) -> None:
        """Each gradient is final after this many contributions (micro-batch backwards)."""
        with self._lock:
            self._expected = num_microbatches
            self._counts, self._ready = {}, {}
            self._launched = {kind: 0 for kind in self.queues}

    def finish_grad_sync(self) -> None:
        """Start the buckets not yet in flight (in order), wait for every reduction."""
        with self._lock:
            for kind, queue in self.queues.items():
                for bucket in queue[self._launched[kind]:]:
                    self._start_reduce(bucket, async_op=self.config.overlap_grad_reduce)
                self._launched[kind] = len(queue)
            self._expected = 0
        for queue in self.queues.values():
            for bucket in queue:
                if bucket.grad_work is not None:
                    bucket.grad_work.wait()
                    bucket.grad_work = None

    # ------------------------------------------------------------------ parameters
    def start_param_sync(self) -> None:
        """All-gather every bucket's parameter shards (distributed optimizer), asynchronously
        with ``overlap_param_gather``."""
        if not self.config.use_distributed_optimizer:
            return
        self.finish_param_sync()
        for buffer in self.buffers:
            if buffer.dp_size == 1:
                continue
            for bucket in buffer.buckets:
                bucket.param_work = _all_gather_single(
                    bucket.param_data, bucket.shard(bucket.param_data, buffer.dp_rank),
                    group=buffer.group, async_op=self.config.overlap_param_gather)

    def finish_param_sync(self, buckets=None) -> None:
        """Wait for the parameter all-gathers of ``buckets`` (default: all)."""
        if buckets is None:
            buckets = [b for buffer in self.buffers for b in buffer.buckets]
        for bucket in buckets:
            if bucket.param_work is not None:
                bucket.param_work.wait()
                bucket.param_work = None

    def _register_forward_pre_hooks(self) -> list:
        handles = []
        for chunk in self.chunks:
            for module in chunk.modules():
                buckets = {id(self._bucket_of[id(p)]): self._bucket_of[id(p)]
                           for p in module.parameters(recurse=False) if id(p) in self._bucket_of}
                if buckets:
                    needed = list(buckets.values())
                    handles.append(module.register_forward_pre_hook(
                        lambda *unused, needed=needed: self.finish_param_sync(needed)))
        return handles

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles, self._grad_accs = [], []

    # ------------------------------------------------------------------ queries
    def bucket_of(self, param):
        return self._bucket_of[id(param)]

    def buffer_of(self, param) -> ParamAndGradBuffer:
        return self._buffer_of_bucket[id(self._bucket_of[id(param)])]

    def launched_during_backward(self) -> int:
        """Buckets whose reduction has been started so far this step (all groups)."""
        return sum(self._launched.values())
