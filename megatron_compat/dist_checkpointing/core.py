"""megatron-core 0.16's ``dist_checkpointing.core``: metadata.json and the exception type.

The layout-independent machinery lives below the trainer, in ``tpfuse.checkpoint.dist.core``
(the trainer's ``--ckpt-format torch_dist`` writes and reads through it too); this module gives
it its megatron-core name."""
from tpfuse.checkpoint.dist.core import *  # noqa: F401,F403
