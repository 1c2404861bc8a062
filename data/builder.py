"""BlendedMegatronDatasetBuilder: the train / valid / test datasets of a config.

``BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_this_rank, config).build()`` →
``(train, valid, test)``, each ``None`` when its size is 0 or this rank does not build datasets.

- ``cls``: :class:`GPTDataset` or :class:`MockGPTDataset` (``config.mock`` forces the mock).
- ``sizes``: samples wanted per split; ``None`` for a split means one epoch of its documents.
- ``config.split`` (e.g. ``"969,30,1"``) cuts every file's documents into consecutive train /
  valid / test ranges: ``[round(c_k · N), round(c_{k+1} · N))`` with c the cumulative shares.
  With ``config.blend_per_split`` each split uses all documents of its own files instead.
- Several prefixes → one dataset per prefix of ``ceil(size · weight · 1.005)`` samples (Megatron's
  margin) combined by :class:`BlendedDataset` of exactly ``size`` samples.
- With ``torch.distributed`` initialised: global rank 0 builds first (writing the index caches),
  then every rank passes one all-reduce of an error flag (so a failure on rank 0 ends every rank
  with an error instead of a hang), then the other ranks build (loading the caches). Without it,
  no collective is made.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tpfuse.parallel.checks import is_int
from tpfuse.parallel.devices import collective_device

from . import indexed
from .blended import BlendedDataset
from .config import SPLIT_NAMES, GPTDatasetConfig, split_ranges
from .gpt_dataset import MockGPTDataset

SIZE_MARGIN = 1.005


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class BlendedMegatronDatasetBuilder:
    def __init__(self, cls, sizes, is_built_on_this_rank, config: GPTDatasetConfig):
        if not isinstance(config, GPTDatasetConfig):
            raise ValueError(f"config must be a GPTDatasetConfig, got {type(config).__name__}")
        if not isinstance(sizes, (list, tuple)) or len(sizes) != 3 or any(
                s is not None and (not is_int(s) or s < 0) for s in sizes):
            raise ValueError(f"sizes must be [train, valid, test] sample counts (ints >= 0 or None), "
                             f"got {sizes!r}")
        self.cls = MockGPTDataset if config.mock else cls
        self.sizes = list(sizes)
        self.is_built_on_this_rank = is_built_on_this_rank
        self.config = config
        self._check_files_exist()

    def _check_files_exist(self):
        if issubclass(self.cls, MockGPTDataset):
            return
        blends = [self.config.blend_pairs] if self.config.blend_pairs else self.config.blend_per_split_pairs
        for blend in blends:
            for prefix, _ in blend or []:
                if not indexed.exists(prefix):
                    raise ValueError(f"blend: data path prefix {prefix!r} has no {prefix}.bin / {prefix}.idx pair")

    def _built_here(self) -> bool:
        flag = self.is_built_on_this_rank
        return bool(flag() if callable(flag) else flag)

    def build(self):
        """(train, valid, test); see the module docstring for the rank-0-first protocol."""
        if not _distributed():
            return self._build_all() if self._built_here() else (None, None, None)
        rank0 = torch.distributed.get_rank() == 0
        result, error = (None, None, None), None
        if rank0:
            try:
                if self._built_here():
                    result = self._build_all()
            except Exception as err:  # re-raised below, after the other ranks learnt of it
                error = err
        self._share_failure(error)
        if not rank0 and self._built_here():
            result = self._build_all()
        return result

    @staticmethod
    def _share_failure(error):
        flag = torch.tensor([1.0 if error is not None else 0.0], device=collective_device())
        torch.distributed.all_reduce(flag)
        if error is not None:
            raise error
        if flag.item() > 0:
            raise RuntimeError("building the datasets failed on rank 0 (see its error)")

    def _build_all(self):
        if issubclass(self.cls, MockGPTDataset):
            low_level = self.cls.build_low_level_dataset(None, self.config)
            return tuple(self._split_dataset(low_level, None, k, self.sizes[k]) for k in range(3))
        if self.config.blend_per_split_pairs is not None:
            return tuple(self._blend(self.config.blend_per_split_pairs[k], k, whole_file=True)
                         for k in range(3))
        return tuple(self._blend(self.config.blend_pairs, k, whole_file=False) for k in range(3))

    def _blend(self, pairs, split: int, whole_file: bool):
        size = self.sizes[split]
        if size == 0 or not pairs:
            return None
        if len(pairs) == 1:
            return self._file_dataset(pairs[0][0], split, size, whole_file)
        total = sum(w for _, w in pairs)
        datasets = []
        for prefix, weight in pairs:
            wanted = None if size is None else int(math.ceil(size * weight / total * SIZE_MARGIN))
            datasets.append(self._file_dataset(prefix, split, wanted, whole_file))
        if size is None:  # one epoch of each: the blend's size is what the datasets hold together
            size = sum(len(d) for d in datasets)
        return BlendedDataset(datasets, [w for _, w in pairs], size, self.config)

    def _file_dataset(self, prefix, split: int, size, whole_file: bool):
        low_level = self.cls.build_low_level_dataset(prefix, self.config)
        return self._split_dataset(low_level, prefix, split, size, whole_file)

    def _split_dataset(self, low_level, prefix, split: int, size, whole_file: bool = False):
        if size == 0:
            return None
        count = len(low_level.sequence_lengths)
        begin, end = (0, count) if whole_file else split_ranges(self.config.split, count)[split]
        if begin == end:
            raise ValueError(f"split={self.config.split!r} leaves the {SPLIT_NAMES[split]} split of "
                             f"{prefix or 'mock data'} ({count} documents) empty, but {size} samples were requested")
        documents = np.arange(begin, end, dtype=np.int64)
        return self.cls(low_level, prefix, documents, size, SPLIT_NAMES[split], self.config)
