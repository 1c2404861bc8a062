"""megatron-core 0.16's ``BlendedMegatronDatasetConfig``: Megatron's fields and defaults.

``blend`` is Megatron's ``(path prefixes, weights or None)``; ``blend_per_split`` three of those
(or None each). With neither, ``mock`` becomes True and ``split`` ``"1,1,1"``, as in Megatron; a
``blend`` needs a ``split``. ``split_matrix`` is derived (``[begin, end)`` fractions per split).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tpfuse.data.config import parse_split

from .._fields import _free, _only, check_default_only


@dataclass
class BlendedMegatronDatasetConfig:
    random_seed: int
    sequence_length: int
    blend: Optional[tuple] = _free(None)
    blend_per_split: Optional[list] = _free(None)
    multiple_validation_sets: Optional[bool] = _only(None)
    full_validation: Optional[bool] = _only(None)
    split: Optional[str] = _free(None)
    split_matrix: Optional[list] = field(init=False, default=None)
    num_dataset_builder_threads: int = _free(1)
    path_to_cache: Optional[str] = _free(None)
    mmap_bin_files: bool = _free(True)
    mock: bool = field(init=False, default=False)
    tokenizer: Optional[object] = _free(None)
    mid_level_dataset_surplus: float = _free(0.005)
    allow_ambiguous_pad_tokens: Optional[bool] = _free(False)
    fast_cache_load: bool = _only(False)
    defer_npy_index_mmap: bool = _only(False)

    def __post_init__(self):
        check_default_only(self)
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None or self.split is not None:
                raise ValueError("blend_per_split excludes blend and split")
            if len(self.blend_per_split) != 3:
                raise ValueError("blend_per_split must hold 3 blends (train, valid, test), got "
                                 f"{len(self.blend_per_split)}")
            for blend in self.blend_per_split:
                _check_blend(blend)
            return
        if self.blend is not None:
            _check_blend(self.blend)
            if self.split is None:
                raise ValueError("split must be given with blend (e.g. '969,30,1')")
        else:
            self.mock, self.split = True, "1,1,1"
        shares = parse_split(self.split)
        bounds = [sum(shares[:i]) for i in range(4)]
        self.split_matrix = [(bounds[i], bounds[i + 1]) if shares[i] else None for i in range(3)]


def _check_blend(blend):
    if blend is None:
        return
    prefixes, weights = blend
    if weights is not None and len(weights) != len(prefixes):
        raise ValueError(f"blend has {len(prefixes)} prefixes but {len(weights)} weights")


def to_pairs(blend):
    """Megatron's ``(prefixes, weights or None)`` → tpfuse's ``[(prefix, weight), ...]``."""
    if blend is None:
        return None
    prefixes, weights = blend
    return [(prefix, 1.0 if weights is None else float(weight))
            for prefix, weight in zip(prefixes, weights or [None] * len(prefixes))]
