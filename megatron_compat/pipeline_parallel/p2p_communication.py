"""megatron-core 0.16's ``pipeline_parallel.p2p_communication.P2PCommunicator(pp_group,
config)``: the neighbours of this rank in ``pp_group``. tpfuse's schedules exchange through
their own p2p (``tpfuse.pipeline.p2p``) over parallel_state's pipeline group, so passing a
communicator to a schedule (``p2p_communicator=``) is refused there, naming it."""
from __future__ import annotations

import torch.distributed as dist


class P2PCommunicator:
    def __init__(self, pp_group, config):
        self.pp_group, self.config = pp_group, config
        size, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.next_rank = dist.get_global_rank(pp_group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(pp_group, (rank - 1) % size)
