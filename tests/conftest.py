"""Shared pytest fixtures.

``run_distributed(world_size, fn, *args)`` runs a module-level test body on every rank of a
gloo world and returns the per-rank results. Pools are started once per world size and kept for
the whole session (process start-up amortised across tests); a pool whose job failed is replaced.
"""
import pytest

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
