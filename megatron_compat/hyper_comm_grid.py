"""megatron-core 0.16's ``hyper_comm_grid.HyperCommGrid(shape, dim_names, rank_offset=0,
backend=None)``: the ranks ``rank_offset ..`` laid out as a hyper-rectangle, ``dim_names[0]``
varying fastest (the order string of ``initialize_model_parallel``).

``create_pg(dims)`` makes the groups of ranks that differ only along ``dims`` (one
``new_subgroups_by_enumeration`` call: every rank calls it) and returns this rank's;
``get_pg(dims)`` returns it again; ``get_rank_enum(dims)`` lists the groups: groups ordered
by the other coordinates (the earliest named fastest), inside a group the requested dims in
``dim_names`` order with the last one fastest (Megatron's enumeration).
"""
from __future__ import annotations

import itertools
import math
import os

import torch.distributed as dist


class HyperCommGrid:
    def __init__(self, shape, dim_names, rank_offset: int = 0, backend=None):
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError("Cannot determine world size: set WORLD_SIZE or initialize "
                               "torch.distributed before creating HyperCommGrid")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        self.shape, self.dim_names = list(shape), list(dim_names)
        self.rank_offset, self.backend = rank_offset, backend
        self.size = math.prod(self.shape)
        if self.size > world_size - rank_offset:
            raise RuntimeError(f"Grid shape {shape} is over sized with world size {world_size} "
                               f"and rank offset {rank_offset}")
        self._pgs: dict = {}

    def _key(self, dims) -> tuple[list[str], str]:
        dims = [dims] if isinstance(dims, str) else list(dims)
        unknown = [d for d in dims if d not in self.dim_names]
        if unknown:
            raise ValueError(f"unknown dims {unknown}; the grid has {self.dim_names}")
        ordered = [d for d in self.dim_names if d in dims]
        return ordered, "-".join(reversed(ordered))

    def _rank(self, coords: dict) -> int:
        rank, stride = 0, 1
        for name, size in zip(self.dim_names, self.shape):
            rank += coords[name] * stride
            stride *= size
        return self.rank_offset + rank

    def get_rank_enum(self, dims) -> list[list[int]]:
        ordered, _ = self._key(dims)
        sizes = dict(zip(self.dim_names, self.shape))
        others = [d for d in self.dim_names if d not in ordered]
        groups = []
        # itertools.product varies its last factor fastest: reverse to make the first fastest
        for outer in itertools.product(*(range(sizes[d]) for d in reversed(others))):
            fixed = dict(zip(reversed(others), outer))
            groups.append([self._rank({**fixed, **dict(zip(ordered, inner))})
                           for inner in itertools.product(*(range(sizes[d]) for d in ordered))])
        return groups

    def create_pg(self, dims, **kwargs):
        ordered, key = self._key(dims)
        if key in self._pgs:
            raise KeyError(f"Process group {dims} has already been created")
        group, _ = dist.new_subgroups_by_enumeration(self.get_rank_enum(ordered),
                                                      backend=self.backend, **kwargs)
        self._pgs[key] = group
        return group

    def get_pg(self, dims):
        _, key = self._key(dims)
        if key not in self._pgs:
            raise KeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
        return self._pgs[key]
