"""megatron-core 0.16's ``dist_checkpointing``: ``save`` / ``load`` of sharded state dicts in
Megatron's ``torch_dist`` layout, ``ShardedTensor``, ``ShardedObject``,
``LocalNonpersistentObject``, ``ShardedTensorFactory`` (see ``serialization.py``,
``torch_dist.py`` — in ``tpfuse.checkpoint.dist`` — and docs/megatron_coverage.md for the key mapping of a GPT)."""
from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                      ShardedTensorFactory)
from .serialization import load, load_common_state_dict, load_tensors_metadata, save

__all__ = ["save", "load", "load_common_state_dict", "load_tensors_metadata",
           "check_is_distributed_checkpoint", "ShardedTensor", "ShardedObject",
           "LocalNonpersistentObject", "ShardedTensorFactory", "CheckpointingException"]
