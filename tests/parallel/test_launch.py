"""The shared worker pool: results per rank, real collectives, failures surface with tracebacks."""
import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel.launch import WorkerError


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def test_pool_runs_collectives(run_distributed):
    results = run_distributed(4, _rank_and_sum)
    # 1 + 2 + 3 + 4 = 10 on every rank, results ordered by rank
    assert results == [(r, 10.0) for r in range(4)]


def test_pool_reports_failing_rank_and_recovers(run_distributed):
    with pytest.raises(WorkerError, match="boom from rank 1"):
        run_distributed(2, _fail_on_rank_one)
    # the failed pool is replaced by a fresh one
    assert run_distributed(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]
