"""The gradient buffers of several ``DistributedDataParallel`` chunks seen as one (what
tpfuse's ``MixedPrecisionOptimizer`` steps over).

Megatron's virtual pipeline wraps every model chunk in its own DDP (each chunk its own buffers
and buckets) and builds one optimizer over all chunks' parameters. ``ChunkBuffers(ddps)`` is
that union: ``params`` in chunk order, every chunk's ``buffers``, the chunk holding each
parameter answering ``buffer_of`` / ``bucket_of``, and the parameter all-gathers of the
distributed optimizer started / awaited chunk by chunk. One chunk: its own buffers, unchanged.
"""
from __future__ import annotations


class ChunkBuffers:
    def __init__(self, ddps):
        self.parts = [ddp.native_buffers for ddp in ddps]
        configs = {(p.config.use_distributed_optimizer, p.config.grad_reduce_in_fp32)
                   for p in self.parts}
        if len(configs) != 1:
            raise ValueError("every DistributedDataParallel chunk needs the same "
                             "use_distributed_optimizer and grad_reduce_in_fp32 "
                             "(one optimizer steps over all of them)")
        self.config = self.parts[0].config
        self.params, self._part_of = [], {}
        for part in self.parts:
            for param in part.params:
                if id(param) in self._part_of:
                    raise ValueError("a parameter is in two DistributedDataParallel chunks")
                self._part_of[id(param)] = part
                self.params.append(param)
        self.buffers = [buffer for part in self.parts for buffer in part.buffers]

    def buffer_of(self, param):
        return self._part_of[id(param)].buffer_of(param)

    def bucket_of(self, param):
        return self._part_of[id(param)].bucket_of(param)

    def start_param_sync(self) -> None:
        for part in self.parts:
            part.start_param_sync()

    def finish_param_sync(self) -> None:
        for part in self.parts:
            part.finish_param_sync()
