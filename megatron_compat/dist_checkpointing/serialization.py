"""megatron-core 0.16's ``dist_checkpointing.serialization``: save / load of sharded state dicts.

The layout-independent machinery lives below the trainer, in ``tpfuse.checkpoint.dist.serialization``
(the trainer's ``--ckpt-format torch_dist`` writes and reads through it too); this module gives
it its megatron-core name."""
from tpfuse.checkpoint.dist.serialization import *  # noqa: F401,F403
