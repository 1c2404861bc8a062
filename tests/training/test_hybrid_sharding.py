"""Hybrid sharding (``--num-distributed-optimizer-instances``): the instance groups against
Megatron-core's hierarchical groups (the reference arithmetic, ``megatron_compat``'s copy of
``create_hierarchical_groups``' rank lists), the process groups a ParallelState builds and a sum
over them, and every bad input refused with one ValueError naming the flag, before any
collective. The training curves are in tests/test_invariance.py, memory and communication
against the plan in tests/training/test_plan.py."""
import pytest

from support.pretrain_run import pretrain_error
from tpfuse.megatron_compat._extra_groups import hierarchical_rank_groups
from tpfuse.parallel.layout import (RankLayout, check_distributed_optimizer_instances,
                                    instance_groups, split_into_instances)
from tpfuse.training.arguments import parse_args

MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
         "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "63",
         "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
         "--no-progress-bar", "--no-layout-table", "--eval-iters", "0"]
FLAG = "--num-distributed-optimizer-instances"


def test_instances_are_megatrons_hierarchical_levels():
    """dp 8 x tp 2 (world 16): each dp group [r, r+2, ..., r+14] in 2 instances of 4 (level 0
    of Megatron's [4, 2] hierarchy) and 4 replica pairs (level 1)."""
    layout = RankLayout(16, tp=2)
    for ranks in layout.groups("dp-cp"):
        intra, inter = split_into_instances([ranks], 2)
        level0, level1 = hierarchical_rank_groups(ranks, [4, 2])
        assert (intra, inter) == (level0, level1)
    assert instance_groups(layout, "intra-dp-cp", 2)[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert instance_groups(layout, "inter-dp-cp", 2)[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    # ep 2 over world 8: edp 4 in 2 instances of 2
    moe = RankLayout(8, ep=2)
    assert moe.groups("edp")[0] == [0, 2, 4, 6]
    assert instance_groups(moe, "intra-edp", 2)[:2] == [[0, 2], [4, 6]]
    assert instance_groups(moe, "inter-edp", 2)[:2] == [[0, 4], [2, 6]]


def _state_body():
    import torch
    import torch.distributed as dist

    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(num_distributed_optimizer_instances=2)
    try:
        names = ("intra-dp-cp", "inter-dp-cp", "intra-edp", "inter-edp")
        ranks = {name: state.ranks(name) for name in names}
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value, group=state.group("inter-dp-cp"))
        plain = ParallelState.initialize()
        single = {name: (plain.ranks(name), plain.group(name) is None) for name in names}
        plain.destroy()
    finally:
        state.destroy()
    with pytest.raises(ValueError) as error:
        ParallelState.initialize(num_distributed_optimizer_instances=3)
    return dist.get_rank(), ranks, value.item(), single, str(error.value)


def test_parallel_state_builds_the_instance_groups(run_distributed):
    """World 4, dp 4, 2 instances: intra [0, 1] [2, 3], inter [0, 2] [1, 3]; an all-reduce over
    the inter group sums the two replicas' values (ranks r and r + 2: 2r + 4 for values r + 1);
    one instance keeps the dp group and a group-less inter of the rank alone; 3 instances
    do not divide dp 4."""
    for rank, ranks, summed, single, error in run_distributed(4, _state_body):
        assert ranks["intra-dp-cp"] == ranks["intra-edp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ranks["inter-dp-cp"] == ranks["inter-edp"] == [rank % 2, rank % 2 + 2]
        assert summed == 2 * (rank % 2) + 4
        assert single["intra-dp-cp"] == ([0, 1, 2, 3], False)
        assert single["inter-dp-cp"] == ([rank], True)
        assert error == (f"{FLAG} 3 must divide the data-parallel (dp x cp) size 4")


@pytest.mark.parametrize("argv,message", [
    ([FLAG, "0"], f"{FLAG} must be >= 1, got 0"),
    ([FLAG, "2"], f"{FLAG} 2 needs a sharded mode to replicate: --use-distributed-optimizer or "
                  "--use-torch-fsdp2"),
])
def test_bad_instances_are_refused_at_parse_time(argv, message):
    with pytest.raises(ValueError, match="^" + message.replace("+", r"\+")):
        parse_args(MODEL + argv)


def test_instances_must_divide_both_data_parallel_sizes():
    check_distributed_optimizer_instances(2, 4, 2)
    with pytest.raises(ValueError, match=f"{FLAG} 3 must divide the data-parallel "):
        check_distributed_optimizer_instances(3, 4, 4)
    with pytest.raises(ValueError, match=f"{FLAG} 2 must divide the expert data-parallel size 1"):
        check_distributed_optimizer_instances(2, 2, 1)


def test_trainer_refuses_instances_that_do_not_divide_dp_before_any_collective(run_distributed):
    """dp 2 with 4 instances: the same ValueError on both ranks from the layout check, which
    runs before the first group (or the fingerprint's all-gather) exists."""
    argv = MODEL + ["--use-distributed-optimizer", FLAG, "4"]
    errors = run_distributed(2, pretrain_error, argv)
    assert errors == [f"{FLAG} 4 must divide the data-parallel (dp x cp) size 2"] * 2


def test_plan_refuses_instances_that_do_not_divide_dp():
    from tpfuse.training.plan.report import plan_layout

    config, settings = parse_args(MODEL + ["--use-torch-fsdp2", FLAG, "3"])
    with pytest.raises(ValueError, match=f"{FLAG} 3 must divide the data-parallel"):
        plan_layout(config, settings, 4)
