"""``parallel.reduce_scatter``: the one reduce-scatter (native, or all-reduce + this rank's block)
against a plain reference, the sum over the ranks of every rank's input, known on every rank
(each rank's input is drawn from a generator seeded by its rank); and the per-backend resolution
of the "auto" strategy.

Tolerances: the collectives sum the ranks' fp32 values in their own order, the reference in
rank order: ~world·u32 relative; rtol 1e-6.
"""
import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel.comm_options import (REDUCE_SCATTER_STRATEGIES, CommOptions,
                                          resolve_reduce_scatter)
from tpfuse.parallel.host_staging import HOST_STAGED, HOST_STAGED_EVERY

ROWS, COLS = 3, 5                       # each rank's block of the (world·ROWS, COLS) input


def _input_of(rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(world * ROWS, COLS, generator=gen)


def _expected(op, rank: int, world: int) -> torch.Tensor:
    total = torch.stack([_input_of(r, world) for r in range(world)]).sum(0)
    block = total[rank * ROWS:(rank + 1) * ROWS]
    return block / world if op == dist.ReduceOp.AVG else block


class _Calls:
    """Counts the collectives ``parallel.reduce_scatter`` enters while the block runs."""

    def __enter__(self):
        from tpfuse.parallel import reduce_scatter as module

        self.module, self.counts = module, {"all_reduce": 0, "reduce_scatter": 0}
        self.all_reduce, self.native = dist.all_reduce, module._reduce_scatter_single

        def all_reduce(*args, **kwargs):
            self.counts["all_reduce"] += 1
            return self.all_reduce(*args, **kwargs)

        def native(*args, **kwargs):
            self.counts["reduce_scatter"] += 1
            return self.native(*args, **kwargs)
        dist.all_reduce, module._reduce_scatter_single = all_reduce, native
        return self.counts

    def __exit__(self, *exc):
        dist.all_reduce, self.module._reduce_scatter_single = self.all_reduce, self.native


def _close(got, want) -> bool:
    return torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def reduce_scatter_body():
    """Every (strategy, op, sync/async) against the reference; returns a list of failures."""
    from tpfuse.parallel.reduce_scatter import reduce_scatter_strategy, reduce_scatter_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for strategy in ("native", "all_reduce", "auto"):
        options = CommOptions(reduce_scatter=strategy)
        ran = "all_reduce" if strategy == "auto" else strategy          # gloo: auto = all_reduce
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            for async_op in (False, True):
                case = (strategy, str(op), async_op)
                x = _input_of(rank, world)
                out = torch.full((ROWS, COLS), float("nan"))
                with _Calls() as calls:
                    handle = reduce_scatter_tensor(out, x, None, options=options, op=op,
                                                   async_op=async_op)
                    if async_op:
                        assert handle is not None
                        handle.wait()
                        handle.wait()                                    # a second wait: no-op
                    elif handle is not None:
                        failures.append((case, "a handle from a synchronous call"))
                if calls != {"all_reduce": int(ran == "all_reduce"),
                             "reduce_scatter": int(ran == "native")}:
                    failures.append((case, calls))
                if not _close(out, _expected(op, rank, world)):
                    failures.append((case, "wrong block"))
                if not torch.equal(x, _input_of(rank, world)):
                    failures.append((case, "input changed"))
        if reduce_scatter_strategy(None, options) != ran:
            failures.append((strategy, "resolution"))
    if reduce_scatter_strategy(None) != "all_reduce":                   # the defaults: auto
        failures.append(("defaults", reduce_scatter_strategy(None)))
    return failures


def bucket_shard_body():
    """The data-parallel bucket's use: the output a view of this rank's block of the input,
    reduced in place (``preserve_input=False``); both strategies, sync and async."""
    from tpfuse.parallel.reduce_scatter import reduce_scatter_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    total = torch.stack([_input_of(r, world) for r in range(world)]).sum(0)
    for strategy in ("native", "all_reduce"):
        for async_op in (False, True):
            bucket = _input_of(rank, world).reshape(-1)
            shard = bucket.view(world, -1)[rank]
            handle = reduce_scatter_tensor(shard, bucket, None,
                                           options=CommOptions(reduce_scatter=strategy),
                                           async_op=async_op, preserve_input=False)
            if handle is not None:
                handle.wait()
            if not _close(shard, total.reshape(world, -1)[rank]):
                failures.append((strategy, async_op, "shard"))
            if strategy == "all_reduce" and not _close(bucket, total.reshape(-1)):
                failures.append((strategy, async_op, "the bucket holds the full sums"))
    return failures


def other_op_body():
    """An op other than SUM / AVG runs the native reduce-scatter under either strategy."""
    from tpfuse.parallel.reduce_scatter import reduce_scatter_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    x = _input_of(rank, world)
    out = torch.empty(ROWS, COLS)
    with _Calls() as calls:
        reduce_scatter_tensor(out, x, None, options=CommOptions(reduce_scatter="all_reduce"),
                              op=dist.ReduceOp.MAX)
    want = torch.stack([_input_of(r, world) for r in range(world)]).amax(0)
    return calls, torch.equal(out, want[rank * ROWS:(rank + 1) * ROWS])


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_matches_the_sum_over_ranks(run_distributed, world_size):
    assert run_distributed(world_size, reduce_scatter_body) == [[]] * world_size


def test_reduce_scatter_into_a_view_of_its_input(run_distributed):
    assert run_distributed(4, bucket_shard_body) == [[]] * 4


def test_other_ops_run_native(run_distributed):
    for calls, equal in run_distributed(2, other_op_body):
        assert calls == {"all_reduce": 0, "reduce_scatter": 1} and equal


def test_auto_resolves_by_backend():
    assert CommOptions().reduce_scatter == "auto" and REDUCE_SCATTER_STRATEGIES[0] == "auto"
    for backend in ("gloo", HOST_STAGED, HOST_STAGED_EVERY):
        assert resolve_reduce_scatter("auto", backend) == "all_reduce", backend
    for backend in ("nccl", "mpi", "ucc"):
        assert resolve_reduce_scatter("auto", backend) == "native", backend
    for backend in ("gloo", "nccl"):
        for strategy in ("native", "all_reduce"):
            assert resolve_reduce_scatter(strategy, backend) == strategy
    with pytest.raises(ValueError, match="reduce-scatter strategy.*'ring'"):
        resolve_reduce_scatter("ring", "gloo")
