"""tpfuse.checkpoint: the checkpoint format, below the trainer; used by training, inference and
conversion.

- ``format.py``: layout on disk, saving (``save_checkpoint``, collective), verification
  (``verify_checkpoint``, any single process), loading (``load_checkpoint``,
  ``load_weights_only``) — every function takes the folder, model chunks, optimizer, scheduler and
  ParallelState explicitly, never the trainer's flags;
- ``file_io.py``: the file-system side (exclusive temporary files, atomic publication, hashes,
  pruning, clean-up of crashed saves);
- ``async_save.py``: ``AsyncCheckpointSaver``, rank files written beside training;
- ``reshard.py`` / ``sharding.py``: loading into another TP / PP / VPP / DP / EP layout;
- ``reading.py``: a checkpoint read by one process without training state (its newest folder,
  rank 0's head, the tokenizer it records).
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "save_checkpoint": "format", "load_checkpoint": "format", "load_weights_only": "format",
    "verify_checkpoint": "format", "latest_iteration": "format",
    "AsyncCheckpointSaver": "async_save",
    "checkpoint_folder": "reading", "read_checkpoint_head": "reading",
    "load_tokenizer": "reading",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
