"""megatron-core 0.16's ``DistributedDataParallel(config, ddp_config, module)`` over tpfuse's
gradient buffers (``tpfuse.training.data_parallel.DataParallelBuffers``).

Every trainable parameter of ``module`` gets ``main_grad`` (a view of a contiguous fp32 / param
dtype buffer); backward accumulates into it and leaves ``param.grad`` None, as Megatron's DDP
does (so a plain ``torch.optim`` optimizer over ``parameters()`` sees no gradient: use
``optimizer.get_megatron_optimizer``). ``finish_grad_sync()`` reduces the buffers over the
data-parallel (+ context-parallel) group, averaging (× 1/dp); expert parameters over the
expert-data-parallel group. ``zero_grad_buffer()`` zeroes them (call it before each step).
``no_sync()`` / ``start_grad_sync()`` exist for Megatron's callers; the reduction happens at
``finish_grad_sync``. With the distributed optimizer ``start_param_sync()`` all-gathers the
updated shards (the optimizer step does it).

Megatron's buffer lists: ``buffers`` (dense parameters) and ``expert_parallel_buffers``
(``allreduce = False``), one ``_ParamAndGradBuffer`` per (param dtype, grad dtype), with their
``bucket_groups`` / ``expert_parallel_bucket_groups`` and ``param_to_bucket_group``
(``param_and_grad_buffer.py``: views of tpfuse's buffers, ``native_buffers``).

The wrapped chunk is ``.module``; ``forward``, ``state_dict``, ``sharded_state_dict`` and
``load_state_dict`` are the module's.
"""
from __future__ import annotations

import contextlib

import torch

from tpfuse.parallel.state import resolve_state
from tpfuse.training.data_parallel import DataParallelBuffers

from ..transformer.module import MegatronModule
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets


def native_chunk(module):
    """The module tpfuse's buffers and collectives see: a compat GPTModel's native engine."""
    while hasattr(module, "module") and not hasattr(module, "native"):
        module = module.module
    return getattr(module, "native", module)


class DistributedDataParallel(MegatronModule):
    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module,
                 disable_bucketing: bool = False, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise ValueError("ddp_config must be a megatron_compat DistributedDataParallelConfig")
        state = resolve_state()          # RuntimeError naming the fix before initialisation
        self.module, self.ddp_config = module, ddp_config
        native_config = ddp_config.to_native()
        if disable_bucketing:
            native_config.bucket_size = None
        self.native_buffers = DataParallelBuffers([native_chunk(module)], native_config, state)
        self.state = state
        self.buffers, self.bucket_groups = self._megatron_buffers("dense", disable_bucketing)
        self.expert_parallel_buffers, self.expert_parallel_bucket_groups = (
            self._megatron_buffers("expert", disable_bucketing))
        self.param_to_bucket_group = {
            param: group for group in self.bucket_groups + self.expert_parallel_bucket_groups
            for bucket in group.buckets for param in bucket.params_list}

    def _megatron_buffers(self, kind: str, disable_bucketing: bool):
        """Megatron's (buffers, bucket groups) of the ``kind`` ("dense" / "expert") buffers; with
        overlapped parameter gathers each group names the one gathered after it (reverse)."""
        native = self.native_buffers
        buffers = [_ParamAndGradBuffer(b, self.ddp_config, native.bucket_size)
                   for b in native.buffers if b.kind == kind]
        groups = partition_buckets(buffers, self.ddp_config, disable_bucketing)
        if self.ddp_config.use_distributed_optimizer and self.ddp_config.overlap_param_gather:
            for later, earlier in zip(groups[1:], groups[:-1]):
                later.next_param_gather_bucket_group = earlier
        return buffers, groups

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    # ------------------------------------------------------------------ gradients
    def zero_grad_buffer(self) -> None:
        self.native_buffers.zero_grad_buffer()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate without reduction (they are reduced at finish_grad_sync)."""
        yield

    def start_grad_sync(self, *unused) -> None:
        """Megatron starts the bucket reductions here; tpfuse reduces at finish_grad_sync."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.native_buffers.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    # ------------------------------------------------------------------ parameters
    def start_param_sync(self, *unused, force_sync: bool = False,
                         force_dispatch: bool = False) -> None:
        self.native_buffers.start_param_sync()
        if force_sync:
            self.native_buffers.finish_param_sync()

    def finish_param_sync(self) -> None:
        self.native_buffers.finish_param_sync()

    def broadcast_params(self) -> None:
        """Every data-parallel rank takes the parameters of data-parallel rank 0."""
        import torch.distributed as dist

        if self.state.size("dp-cp") == 1:
            return
        source = dist.get_global_rank(self.state.dp_cp_group, 0)
        for param in self.module.parameters():
            dist.broadcast(param.data, src=source, group=self.state.dp_cp_group)

    def enable_forward_pre_hook(self) -> None:
        """The parameter-gather hooks are always installed with overlap_param_gather."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        if param_sync:
            self.native_buffers.finish_param_sync()

    # ------------------------------------------------------------------ the wrapped module
    def state_dict(self, prefix="", keep_vars=False, **kwargs):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self
