"""megatron-core 0.16's ``datasets.blended_megatron_dataset_builder``:
``BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`` →
``(train, valid, test)`` (``GPTDataset`` / ``MockGPTDataset``, blends by weight; see
``gpt_dataset.py``). A sample is Megatron's dict: ``tokens``, ``labels``, ``loss_mask``,
``position_ids`` and, with ``create_attention_mask``, ``attention_mask``."""
from .gpt_dataset import BlendedMegatronDatasetBuilder  # noqa: F401

__all__ = ["BlendedMegatronDatasetBuilder"]
