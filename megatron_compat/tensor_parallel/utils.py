"""megatron-core 0.16's ``tensor_parallel.utils``: tensor splitting helpers and ``VocabUtility``
(``tp_group`` defaults to the default ParallelState's tensor-parallel group)."""
from __future__ import annotations

import torch

from tpfuse.parallel.mappings import all_gather_first_dim, group_rank, group_size
from tpfuse.parallel.mappings import default_tensor_parallel_group as _tp

__all__ = ["divide", "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
           "gather_split_1d_tensor", "VocabUtility"]


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``; ValueError unless it divides exactly."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False):
    """``num_partitions`` equal views along the last dim (contiguous copies if asked)."""
    size = divide(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False,
                                      tp_group=None):
    """This TP rank's 1/tp of the flattened tensor (a view, or a copy with ``new_buffer``)."""
    group = _tp(tp_group)
    part = tensor.numel() // group_size(group)
    start = part * group_rank(group)
    data = tensor.reshape(-1)[start:start + part]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of ``split_tensor_into_1d_equal_chunks``: the flat tensor from every TP rank."""
    return all_gather_first_dim(tensor.reshape(-1), _tp(tp_group))


class VocabUtility:
    """Vocabulary range ``[first, last)`` of a rank's partition."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank,
                                                                      world_size)
