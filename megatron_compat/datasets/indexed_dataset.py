"""megatron-core 0.16's ``datasets.indexed_dataset``: ``IndexedDataset(path_prefix)`` reads
Megatron's ``.idx`` / ``.bin`` token files (tpfuse's reader, ``tpfuse.data.indexed``)."""
from tpfuse.data.indexed import IndexedDataset  # noqa: F401

__all__ = ["IndexedDataset"]
