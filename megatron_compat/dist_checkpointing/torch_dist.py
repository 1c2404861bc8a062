"""megatron-core 0.16's ``dist_checkpointing.torch_dist``: the torch.distributed.checkpoint files.

The layout-independent machinery lives below the trainer, in ``tpfuse.checkpoint.dist.torch_dist``
(the trainer's ``--ckpt-format torch_dist`` writes and reads through it too); this module gives
it its megatron-core name."""
from tpfuse.checkpoint.dist.torch_dist import *  # noqa: F401,F403
