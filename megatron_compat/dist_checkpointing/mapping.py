"""megatron-core 0.16's ``dist_checkpointing.mapping``: ShardedTensor, ShardedObject, factories.

The layout-independent machinery lives below the trainer, in ``tpfuse.checkpoint.dist.mapping``
(the trainer's ``--ckpt-format torch_dist`` writes and reads through it too); this module gives
it its megatron-core name."""
from tpfuse.checkpoint.dist.mapping import *  # noqa: F401,F403
