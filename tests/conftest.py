"""Shared pytest fixtures.

``run_distributed(world_size, fn, *args)`` runs a module-level test body on every rank of a
gloo world and returns the per-rank results. Pools are started once per world size and kept for
the whole session (process start-up amortised across tests); a pool whose job failed is replaced.
"""

import pytest
import torch

from tpfuse.parallel.launch import WorkerPool

_POOLS: dict[int, WorkerPool] = {}


def _pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


@pytest.fixture(scope="session")
def run_distributed():
    def run(world_size, fn, *args, timeout_s=300.0, **kwargs):
        return _pool(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)

    yield run
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every torch.empty / empty_like (the kernel launchers' output allocations) comes back full of
    NaN (integers: -2**30), so an element a kernel fails to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
