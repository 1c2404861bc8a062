"""megatron-core 0.16's ``transformer.module``: ``MegatronModule``, the base of every model part.

It holds ``config`` (a TransformerConfig) and gives ``sharded_state_dict(prefix,
sharded_offsets, metadata)``: every parameter of this module and its children as a
``dist_checkpointing.ShardedTensor`` (tensor-parallel ones cut along their ``partition_dim``,
replicated ones with ``replica_id`` = tp rank so only tp rank 0 writes them), other entries
(buffers) the same way, replicated. ``set_is_first_microbatch`` and
``state_dict_for_save_checkpoint`` are Megatron's conveniences.
"""
from __future__ import annotations

import torch

from ..dist_checkpointing.mapping import make_sharded_tensors_for_module


class MegatronModule(torch.nn.Module):
    def __init__(self, config=None, pg_collection=None, **kwargs):
        super().__init__()
        if pg_collection is not None:
            raise ValueError("pg_collection is not supported: tpfuse modules use the process "
                             "groups of parallel_state's default state")
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        """This module's state as ShardedTensors keyed like ``state_dict(prefix=prefix)``."""
        return make_sharded_tensors_for_module(self, prefix, sharded_offsets)

    def set_is_first_microbatch(self):
        """Megatron's FP8 weight-cache hint: nothing to do in tpfuse."""

    def set_symmetric_ar(self, set_to=None):
        if set_to is not None:
            raise ValueError(f"symmetric_ar_type={set_to!r} is not supported by tpfuse")


class Float16Module(MegatronModule):
    """Megatron's half-precision wrapper; tpfuse builds models in ``params_dtype`` directly."""

    def __init__(self, config, module):
        raise ValueError("Float16Module is not used by tpfuse: set bf16/fp16 and params_dtype in "
                         "the TransformerConfig, the model is built in that dtype")
