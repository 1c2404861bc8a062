"""Gradient buffers and their data-parallel reduction, against hand-computed layouts and plain
torch references (the mean over ranks of locally computed gradients); expert (``allreduce=False``)
routing and the global grad norm's grouping on a hand-built model with ep > 1.

Tolerances: the reductions sum dp fp32 values scaled by 1/dp (a power of two: exact scaling), so
they differ from the reference mean only by summation order: ~dp·u32 relative; rtol 1e-6.
"""
import math

import pytest
import torch
import torch.distributed as dist

from tpfuse.training.data_parallel import DataParallelBuffers, DistributedDataParallelConfig
from tpfuse.training.grad_buffers import plan_buffer


# -------------------------------------------------------------------- pure layout
def test_plan_is_reverse_order_with_buckets_closed_at_size():
    plan = plan_buffer([5, 7, 3, 20], bucket_size=10)
    # reverse order: p3 (20) closes bucket 0; p2 + p1 = 10 close bucket 1; p0 alone
    assert plan.ranges == ((30, 35), (23, 30), (20, 23), (0, 20))
    assert [(b.start, b.end, b.params) for b in plan.buckets] == [(0, 20, (3,)), (20, 30, (2, 1)),
                                                                  (30, 35, (0,))]
    assert plan.numel == 35
    assert len(plan_buffer([5, 7, 3, 20], bucket_size=None).buckets) == 1


def test_sharded_plan_aligns_params_and_pads_buckets_for_every_rank():
    plan = plan_buffer([5, 70, 3], bucket_size=64, shard_over=3)
    # params start at multiples of 64; buckets end at multiples of lcm(3, 128) = 384
    assert plan.ranges == ((384, 389), (64, 134), (0, 3))
    assert [(b.start, b.end, b.params) for b in plan.buckets] == [(0, 384, (2, 1)),
                                                                  (384, 768, (0,))]
    assert plan.numel == 768


def test_own_bucket_param_is_alone_in_its_bucket():
    plan = plan_buffer([5, 6, 3], bucket_size=None, shard_over=2, own_bucket=[False, True, False])
    assert [(b.start, b.end, b.params) for b in plan.buckets] == [
        (0, 128, (2,)), (128, 256, (1,)), (256, 384, (0,))]          # lcm(2, 128) = 128


# -------------------------------------------------------------------- reduction
def _model():
    torch.manual_seed(0)                                          # same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
                               torch.nn.Tanh(), torch.nn.Linear(3, 2))


def reduce_body(distributed: bool, overlap: bool, native_reduce_scatter: bool):
    from tpfuse.parallel.comm_options import CommOptions
    from tpfuse.parallel.state import ParallelState

    # native: the NCCL path (reduce_scatter_tensor) on gloo; else gloo's default (all-reduce)
    options = CommOptions(reduce_scatter="native" if native_reduce_scatter else "auto")
    return _reduce(distributed, overlap, ParallelState.initialize(comm_options=options))


def _reduce(distributed: bool, overlap: bool, state):
    model = _model()
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=20,
                                           use_distributed_optimizer=distributed)
    buffers = DataParallelBuffers([model], config, state)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)               # different data on every rank
    batches = [torch.randn(4, 5, generator=gen) for _ in range(3)]
    local = [torch.zeros_like(p) for p in model.parameters()]
    buffers.zero_grad_buffer()
    buffers.begin_step(len(batches))
    for x in batches:
        grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()),
                                    retain_graph=True)              # the plain-torch reference
        for acc, g in zip(local, grads):
            acc += g
        model(x).square().sum().backward()
    launched = buffers.launched_during_backward()
    buffers.finish_grad_sync()
    errors = []
    for mine, param in zip(local, model.parameters()):
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        mean = torch.stack(gathered).mean(0).reshape(-1)
        start, end = buffers.buffer_of(param).range_of[id(param)]
        got = param.main_grad.reshape(-1)
        if distributed:   # only this rank's shard of each bucket is reduced
            lo, hi = buffers.bucket_of(param).shard_range(rank)
            keep = slice(max(lo, start) - start, max(min(hi, end) - start, 0))
            got, mean = got[keep], mean[keep]
        errors.append((got - mean).abs().max().item() if got.numel() else 0.0)
        assert param.grad is None                                 # all of it is in main_grad
    return launched, len(buffers.queues["dense"]), max(errors)


@pytest.mark.parametrize("distributed, native", [(False, False), (True, False), (True, True)],
                         ids=["all-reduce", "sharded-gloo", "sharded-reduce-scatter"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
def test_buckets_average_over_data_parallel_ranks(run_distributed, distributed, native, overlap):
    for launched, buckets, error in run_distributed(4, reduce_body, distributed, overlap, native):
        assert error < 1e-6
        if overlap:   # bucket_size 20 splits the 80 parameters; all in flight before backward ends
            assert buckets > 1 and launched == buckets
        else:         # one bucket, reduced by finish_grad_sync
            assert buckets == 1 and launched == 0


# -------------------------------------------------------------------- experts and the grad norm
def expert_body(tp: int, ep: int, etp: int):
    """A hand-built model: a TP-sharded weight, a TP-replicated bias (identical on the TP ranks,
    as the layers make it) and an expert weight (``allreduce = False``, one expert per ep rank).
    Every rank's local gradients are distinct numbers; returns what the reference needs."""
    from tpfuse.parallel.state import ParallelState
    from tpfuse.training.optimizer import MixedPrecisionOptimizer

    state = ParallelState.initialize(tp=tp, ep=ep, etp=etp)
    rank = dist.get_rank()
    sharded = torch.nn.Parameter(torch.zeros(3, 4))
    sharded.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.zeros(5))
    replicated.tensor_model_parallel = False
    expert = torch.nn.Parameter(torch.zeros(2, 3))
    expert.tensor_model_parallel, expert.allreduce = False, False
    module = torch.nn.ParameterList([sharded, replicated, expert])
    buffers = DataParallelBuffers([module], DistributedDataParallelConfig(), state)
    optimizer = MixedPrecisionOptimizer([module], buffers, state, lr=0.0, weight_decay=0.0)
    buffers.zero_grad_buffer()
    buffers.begin_step(1)
    dp_rank = state.rank_in("dp-cp")
    local = {"sharded": torch.arange(12.0).reshape(3, 4) + 100 * rank,
             "replicated": torch.arange(5.0) + 10 * dp_rank,       # same on the tp ranks
             "expert": torch.arange(6.0).reshape(2, 3) * (1 + rank)}
    loss = sum((p * local[n]).sum() for n, p in zip(local, module))
    loss.backward()
    buffers.finish_grad_sync()
    result = optimizer.step()
    return {"rank": rank, "tp": state.tp_rank, "ep": state.rank_in("ep"),
            "etp": state.rank_in("etp"), "edp": state.rank_in("edp"), "dp": dp_rank,
            "dp_size": state.size("dp-cp"), "edp_ranks": state.ranks("edp"),
            "local": local, "reduced": {n: p.main_grad.clone() for n, p in zip(local, module)},
            "norm": result.grad_norm}


@pytest.mark.parametrize("tp, ep, etp", [(1, 2, 1), (2, 2, 1)])
def test_expert_params_reduce_over_expert_data_group_and_norm_counts_each_element_once(
        run_distributed, tp, ep, etp):
    results = run_distributed(4, expert_body, tp, ep, etp)
    by_rank = {r["rank"]: r for r in results}
    for r in results:
        dense_peers = [p for p in results if p["tp"] == r["tp"]]    # its dp group (no pp/cp)
        mean = sum(p["local"]["sharded"] for p in dense_peers) / r["dp_size"]
        torch.testing.assert_close(r["reduced"]["sharded"], mean, rtol=1e-6, atol=1e-6)
        # Megatron's expert scaling: Σ over the expert-data group, divided by dp (not by edp)
        expert_sum = sum(by_rank[p]["local"]["expert"] for p in r["edp_ranks"])
        torch.testing.assert_close(r["reduced"]["expert"], expert_sum / r["dp_size"],
                                   rtol=1e-6, atol=1e-6)
    # the norm by hand: one copy of each distinct element — the sharded weight per tp rank, the
    # replicated bias once, the expert weight per (ep, etp) coordinate
    sharded = {r["tp"]: r["reduced"]["sharded"] for r in results}
    experts = {(r["ep"], r["etp"]): r["reduced"]["expert"] for r in results}
    squares = (sum(t.double().square().sum() for t in sharded.values())
               + results[0]["reduced"]["replicated"].double().square().sum()
               + sum(t.double().square().sum() for t in experts.values()))
    for r in results:
        assert r["norm"] == pytest.approx(math.sqrt(squares), rel=1e-6)


# -------------------------------------------------------------------- optimizer memory per rank
def optimizer_bytes_body(flags):
    """Memory of a GPT (h 128, 2 layers) with and without the distributed optimizer at dp=4."""
    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel import parallel_state
    from tpfuse.training.arguments import parse_args
    from tpfuse.training.train_step import build_buffers_and_optimizer

    config, args = parse_args(["--num-layers", "2", "--hidden-size", "128",
                               "--num-attention-heads", "4", "--seq-length", "16",
                               "--vocab-size", "63", "--mock-data", "--micro-batch-size", "1",
                               "--train-iters", "1", "--lr", "1e-3"] + flags)
    state = parallel_state.initialize_model_parallel()
    model = build_model(make_gpt_model_provider(config), config)
    buffers, optimizer = build_buffers_and_optimizer(
        model, config, state, optimizer=args.optimizer, precision=args.precision,
        data_parallel=args.data_parallel, lr=args.scheduler.lr)
    padding = sum(b.grad_data.numel() - b.numel_unpadded for b in buffers.buffers)
    return optimizer.memory_bytes(), padding


def test_distributed_optimizer_holds_a_quarter_of_the_state_at_dp4(run_distributed):
    """Every main-parameter / Adam element lives on exactly one rank (the shards add up to the
    plain optimizer's state), and each rank holds at most its shard: (plain + 8 bytes per padding
    element)/dp, where the padding (parameters aligned to 64 elements, buckets to lcm(dp, 128))
    is < 1 % of this model."""
    plain = run_distributed(4, optimizer_bytes_body, [])
    sharded = run_distributed(4, optimizer_bytes_body, ["--use-distributed-optimizer", "--bf16"])
    plain_bytes = plain[0][0]["optimizer_state"]
    assert all(p[0]["optimizer_state"] == plain_bytes for p in plain)
    per_rank = [s[0]["optimizer_state"] for s in sharded]
    assert sum(per_rank) == plain_bytes
    padding = sharded[0][1]
    assert padding < 0.01 * plain_bytes / 8
    assert max(per_rank) <= (plain_bytes + 8 * padding) / 4
    # bf16 main copies exist for the shard only: 4 bytes each, half the moments' 8
    assert sum(s[0]["main_parameters"] for s in sharded) * 2 == plain_bytes
