"""Data-parallel micro-batches in Megatron's pretraining order (MegatronPretrainingSampler).

The dataset's samples are consumed in order ``0, 1, 2, ...``; each global chunk of
``micro_batch_size × data_parallel_size`` consecutive samples is one micro-batch step, of which data
parallel rank r takes the contiguous slice ``[r · b, (r + 1) · b)``. Resuming from
``consumed_samples`` (a multiple of that chunk, counted over all DP ranks) continues exactly where
the uninterrupted run would be: the loader's whole state is ``consumed_samples``.

``build_pretraining_data_loader(...)`` returns an iterator of collated batches: dicts of tensors
``(b, s)`` (``attention_mask`` ``(b, 1, s, s)`` when the dataset gives one). A final partial chunk is
dropped (Megatron's ``drop_last``), so every DP rank yields the same number of micro-batches. A
dataset with its own ``collate`` (``data/variable_length.py``'s, padding each micro-batch to its
longest sample) is collated with it.
"""
from __future__ import annotations

import torch

from tpfuse.parallel.checks import is_int


class MegatronPretrainingSampler:
    """Yields, for this DP rank, the list of sample ids of each micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        for name, value, low in (("total_samples", total_samples, 1), ("consumed_samples", consumed_samples, 0),
                                 ("micro_batch_size", micro_batch_size, 1),
                                 ("data_parallel_size", data_parallel_size, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(data_parallel_rank, int) or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank must lie in [0, {data_parallel_size}), got {data_parallel_rank!r}")
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} leaves nothing of the dataset's "
                             f"{total_samples} samples (build the dataset with more samples)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.chunk = micro_batch_size * data_parallel_size  # samples per micro-batch step, all DP ranks

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        return (self.total_samples - self.consumed_samples) // self.chunk

    def __iter__(self):
        begin = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - self.chunk + 1, self.chunk):
            yield list(range(start + begin, start + begin + self.micro_batch_size))


def collate(samples: list[dict]) -> dict:
    """A list of sample dicts → one dict of stacked tensors (a leading batch dimension)."""
    return {name: torch.stack([sample[name] for sample in samples]) for name in samples[0]}


class PretrainingDataIterator:
    """Iterator of collated micro-batches; ``consumed_samples`` counts all DP ranks' samples so far."""

    def __init__(self, dataset, sampler: MegatronPretrainingSampler):
        self.dataset = dataset
        self.sampler = sampler
        self.consumed_samples = sampler.consumed_samples
        self._ids = iter(sampler)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        ids = next(self._ids)
        self.consumed_samples += self.sampler.chunk
        return getattr(self.dataset, "collate", collate)([self.dataset[i] for i in ids])

    def __len__(self) -> int:
        return (self.sampler.total_samples - self.consumed_samples) // self.sampler.chunk


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int):
    """This DP rank's micro-batches of ``dataset`` from ``consumed_samples`` on (None for no dataset)."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    return PretrainingDataIterator(dataset, sampler)
