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


def _rank_one_fails_after_rank_zero_dies():
    import os
    import time

    if dist.get_rank() == 0:
        time.sleep(0.3)     # rank 1's error is in first, as when a crash breaks a peer's socket
        os._exit(7)
    raise ConnectionError("peer closed")


def test_a_rank_that_died_is_named_beside_the_error_it_caused(run_distributed):
    with pytest.raises(WorkerError, match=r"failed on rank\(s\) \[1\] \(rank 0 died \(exit code 7\)\)"):
        run_distributed(2, _rank_one_fails_after_rank_zero_dies)
    assert run_distributed(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def _leave_a_group_behind():
    dist.new_group([0, 1])
    return len(dist.distributed_c10d._world.pg_map)


def _count_groups():
    return len(dist.distributed_c10d._world.pg_map)


def test_a_group_a_job_left_alive_is_destroyed_before_the_next_job(run_distributed):
    run_distributed(2, _rank_and_sum)          # a pool whose earlier jobs left nothing
    before = run_distributed(2, _count_groups)
    assert run_distributed(2, _leave_a_group_behind) == [b + 1 for b in before]
    assert run_distributed(2, _count_groups) == before
