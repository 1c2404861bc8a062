"""Megatron's ``torch_dist`` checkpoint layout, independent of any model or layout: sharded state
dicts (``mapping.py``: ShardedTensor, ShardedObject, factories), their save / load
(``serialization.py``) through torch.distributed.checkpoint files (``torch_dist.py``), and
``metadata.json`` (``core.py``). Used by the trainer's ``--ckpt-format torch_dist``
(``checkpoint/torch_dist_format.py``) and, under megatron-core's names, by
``megatron_compat.dist_checkpointing``."""
