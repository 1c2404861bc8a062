"""megatron-core 0.16's ``pipeline_parallel.utils``: stage predicates over an explicit
pipeline group."""
from __future__ import annotations

import torch.distributed as dist


def is_pp_first_stage(pp_group) -> bool:
    """This rank is the first of ``pp_group``."""
    return dist.get_rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    """This rank is the last of ``pp_group``."""
    return dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1
