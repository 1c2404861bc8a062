"""BlendedDataset: a weighted mixture of datasets, deterministic (Megatron-core's greedy rule).

Weights are normalised to sum to 1. Sample ``i`` of the blend comes from the dataset whose
``weight · max(i, 1) − samples_taken_so_far`` is largest (ties → the lowest dataset id), and is that
dataset's next unused sample, so after n samples every dataset has given within about one sample of
``weight · n``. No random numbers are involved: the mixture follows from the weights alone (the
shuffling happens inside each dataset, from the seed).
"""
from __future__ import annotations

import numpy as np
import torch

from .indices import blending_indices


class BlendedDataset(torch.utils.data.Dataset):
    def __init__(self, datasets, weights, size: int, config=None):
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"BlendedDataset: at most {np.iinfo(np.int16).max} datasets, got {len(datasets)}")
        if any(not np.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"BlendedDataset: weights must be positive and finite, got {list(weights)}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"BlendedDataset: size must be a positive int, got {size!r}")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size
        self.config = config
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        self._check_sizes()

    def _check_sizes(self):
        taken = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (dataset, count) in enumerate(zip(self.datasets, taken)):
            if count > len(dataset):
                raise ValueError(f"BlendedDataset: dataset {d} ({dataset!r}) has {len(dataset)} samples, "
                                 f"the blend of {self.size} at weight {self.weights[d]:.4g} needs {count}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]

    def __repr__(self):
        return f"BlendedDataset(size={self.size}, weights={[round(w, 4) for w in self.weights]})"
