"""megatron-core 0.16's ``GPTDatasetConfig``, ``GPTDataset``, ``MockGPTDataset`` on tpfuse's
datasets, and ``BlendedMegatronDatasetBuilder`` for them.

The config has Megatron's 27 fields and defaults: ``reset_position_ids``,
``reset_attention_mask``, ``eod_mask_loss`` are required (Megatron asserts they are set),
``create_attention_mask=True`` adds a bool ``(1, s, s)`` causal ``attention_mask`` (True = masked)
to every sample, ``add_extra_token_to_sequence=True`` reads ``s + 1`` tokens per sample (False:
``s`` tokens, the last label a pad with loss_mask 0). ``to_native()`` gives tpfuse's config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch

from tpfuse.data import builder as _builder
from tpfuse.data import gpt_dataset as _native
from tpfuse.data.config import GPTDatasetConfig as _NativeConfig

from .._fields import _free, _only, check_default_only
from .blended_megatron_dataset_config import BlendedMegatronDatasetConfig, to_pairs


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    reset_position_ids: Optional[bool] = _free(None)
    reset_attention_mask: Optional[bool] = _free(None)
    eod_mask_loss: Optional[bool] = _free(None)
    create_attention_mask: bool = _free(True)
    drop_last_partial_validation_sequence: bool = _free(True)
    add_extra_token_to_sequence: bool = _free(True)
    object_storage_cache_path: Optional[str] = _only(None)
    data_parallel_size: int = _free(1)
    sequence_parallel_size: int = _free(0)
    hybrid_context_parallel: bool = _only(False)
    sequences_per_dataset: Optional[Dict[str, int]] = _only(None)
    token_dtype_code: Optional[int] = field(init=False, default=None)
    context_parallel_size: Optional[int] = _free(None)

    def __post_init__(self):
        super().__post_init__()
        check_default_only(self)
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (with vocab_size and eod)")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig needs {name} (True or False)")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None:
            self.token_dtype_code = 4 if vocab > np.iinfo(np.uint16).max + 1 else 8
        self.native = self.to_native()

    def to_native(self) -> _NativeConfig:
        per_split = None
        if self.blend_per_split is not None and any(self.blend_per_split):
            per_split = [to_pairs(b) for b in self.blend_per_split]
        return _NativeConfig(
            random_seed=self.random_seed, sequence_length=self.sequence_length,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask, eod_mask_loss=self.eod_mask_loss,
            tokenizer=self.tokenizer, blend=to_pairs(self.blend), blend_per_split=per_split,
            split=self.split or "969,30,1", path_to_cache=self.path_to_cache, mock=self.mock,
            add_extra_token_to_sequence=self.add_extra_token_to_sequence)


def _with_attention_mask(sample: dict, config: GPTDatasetConfig) -> dict:
    if config.create_attention_mask and "attention_mask" not in sample:
        s = sample["tokens"].shape[0]
        sample["attention_mask"] = ~torch.tril(torch.ones(s, s, dtype=torch.bool))[None]
    return sample


class _Samples(torch.utils.data.Dataset):
    """A built tpfuse dataset whose samples get Megatron's fields."""

    def __init__(self, dataset, config: GPTDatasetConfig):
        self.dataset, self.config = dataset, config

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        return _with_attention_mask(self.dataset[idx], self.config)

    def __getattr__(self, name):
        return getattr(self.__dict__["dataset"], name)


class GPTDataset(_Samples):
    """Megatron's constructor; the work is tpfuse's GPTDataset."""
    native_class = _native.GPTDataset

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config: GPTDatasetConfig):
        split = getattr(index_split, "name", index_split)
        super().__init__(self.native_class(indexed_dataset, dataset_path, indexed_indices,
                                           num_samples, split, config.native), config)

    @classmethod
    def build_low_level_dataset(cls, dataset_path, config: GPTDatasetConfig):
        return cls.native_class.build_low_level_dataset(dataset_path, config.native)


class MockGPTDataset(GPTDataset):
    native_class = _native.MockGPTDataset


class BlendedMegatronDatasetBuilder:
    """``BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`` →
    (train, valid, test) with Megatron's sample fields (None where not built)."""

    def __init__(self, cls, sizes, is_built_on_rank, config: GPTDatasetConfig):
        if cls not in (GPTDataset, MockGPTDataset):
            raise ValueError(f"cls must be GPTDataset or MockGPTDataset, got {cls!r}")
        native_cls = _native.MockGPTDataset if (cls is MockGPTDataset or config.mock) \
            else _native.GPTDataset
        self.config = config
        self._native = _builder.BlendedMegatronDatasetBuilder(native_cls, sizes,
                                                              is_built_on_rank, config.native)

    def build(self):
        return tuple(None if ds is None else _Samples(ds, self.config)
                     for ds in self._native.build())
