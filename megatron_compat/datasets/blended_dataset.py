"""megatron-core 0.16's ``datasets.blended_dataset``: ``BlendedDataset`` (samples drawn from
several datasets by weight, deterministically; tpfuse's ``tpfuse.data.blended``)."""
from tpfuse.data.blended import BlendedDataset  # noqa: F401

__all__ = ["BlendedDataset"]
