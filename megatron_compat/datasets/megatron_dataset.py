"""megatron-core 0.16's ``datasets.megatron_dataset``: ``MegatronDataset``, the base class of
Megatron's datasets here (``GPTDataset`` / ``MockGPTDataset`` derive from it: a built tpfuse
dataset whose samples carry Megatron's fields)."""
from .gpt_dataset import _Samples as MegatronDataset  # noqa: F401

__all__ = ["MegatronDataset"]
