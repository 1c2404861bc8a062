"""FSDP (``--use-torch-fsdp2``): the shard arithmetic, the start-up refusals, and the per-rank
memory of the start-up record against 1/dp of one process.

Memory: a rank of dp holds ⌈n0/dp⌉ rows of every parameter (FSDP pads the last blocks), fp32
parameters, gradients and two Adam moments: 16 bytes per element of its padded shard
(``fsdp_rank_bytes``). The tiny model's first dims (16, 32, 48, 128 rows) divide by 4, so its
record is exactly 1/dp of the single FSDP process's; against one plain process (whose gradient
buffer is a flat padded buffer) the ratio is bounded by 1.1 / dp.
"""
import json

import pytest

from support.pretrain_run import run_pretrain
from tpfuse.training.fsdp import (fsdp_rank_bytes, gathers_per_step, keeps_seams,
                                  padded_shard_numel, shard_rows)

TINY = [
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
    "--ffn-hidden-size", "32", "--seq-length", "8", "--max-position-embeddings", "8",
    "--vocab-size", "63", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "7",
    "--mock-data", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
    "--eval-iters", "0", "--no-progress-bar", "--no-layout-table",
]
ZERO3 = ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads_params"]


# -------------------------------------------------------------------- pure arithmetic
def test_rows_are_cut_like_torch_chunk_with_trailing_ranks_short_or_empty():
    assert [shard_rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [shard_rows(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert padded_shard_numel((5, 3), 4) == 6          # 2 rows of 3 on every rank
    assert padded_shard_numel((16,), 4) == 4


def test_rank_bytes_are_sixteen_per_padded_shard_element():
    held = fsdp_rank_bytes([(5, 3), (16,)], 4)
    assert held == {"parameters": 40, "main_parameters": 0, "gradients": 40,
                    "optimizer_state": 80}


@pytest.mark.parametrize("forward, backward, zero3", [
    # counted pass by pass over F0 B0 F1 B1 F2 B2 (m = 3): a gather wherever the unit is sharded
    # on entry; ZeRO-3 re-shards after each pass unless that seam keeps it, every unit after the
    # step's last backward
    (False, False, 6),      # a middle layer: F0 B0 F1 B1 F2 B2
    (True, False, 3),       # the last layer: F0 (kept) B0, F1 B1, F2 B2
    (False, True, 4),       # the first layer: F0 B0 (kept) F1, B1 (kept) F2, B2
    (True, True, 1),        # the root: F0, kept to the step's end
])
def test_zero3_gathers_per_step_follow_its_seams(forward, backward, zero3):
    kept = dict(kept_after_forward=forward, kept_after_backward=backward)
    assert gathers_per_step("optim_grads_params", 3, **kept) == zero3
    assert gathers_per_step("optim_grads", 3, **kept) == 1      # ZeRO-2 keeps all over the step


def test_only_zero3_without_a_pipeline_keeps_its_seams():
    assert keeps_seams("optim_grads_params", 1)
    assert not keeps_seams("optim_grads_params", 2)    # 1F1B: other passes fall between
    assert not keeps_seams("optim_grads", 1)


# -------------------------------------------------------------------- refusals
@pytest.mark.parametrize("argv, named", [
    # Megatron's own refusal
    (ZERO3 + ["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"], "--use-distributed-optimizer"),
    # what FSDP2 cannot shard by, and contradictions between the two ways of choosing
    (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim"],
     "--data-parallel-sharding-strategy optim"),
    (ZERO3 + ["--torch-fsdp2-no-reshard-after-forward"],
     "optim_grads_params.*--torch-fsdp2-no-reshard-after-forward"),
    # FSDP flags without FSDP, bucket flags with it
    (["--data-parallel-sharding-strategy", "optim_grads"], "needs --use-torch-fsdp2"),
    (["--torch-fsdp2-no-reshard-after-forward"], "needs --use-torch-fsdp2"),
    (ZERO3 + ["--overlap-grad-reduce"], "--overlap-grad-reduce"),
    # the host-staged gloo world (one GPU shared by gloo ranks) does not carry FSDP's collectives
    (ZERO3 + ["--device", "cuda", "--distributed-backend", "gloo"],
     "--device cuda --distributed-backend gloo"),
])
def test_bad_fsdp_settings_fail_at_parse_time_naming_the_flags(argv, named):
    from tpfuse.training.arguments import parse_args

    with pytest.raises(ValueError, match=named):
        parse_args(TINY + argv)


@pytest.mark.parametrize("argv, strategy", [
    # Megatron: --use-torch-fsdp2 re-shards after forward unless told not to
    (["--use-torch-fsdp2"], "optim_grads_params"),
    (["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], "optim_grads"),
    # the strategy names it outright (Megatron-FSDP's meaning of the values)
    (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"], "optim_grads"),
    (["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads",
      "--torch-fsdp2-no-reshard-after-forward"], "optim_grads"),
    (ZERO3, "optim_grads_params"),
])
def test_fsdp_strategy_follows_megatrons_torch_fsdp2_flags(argv, strategy):
    from tpfuse.training.arguments import parse_args

    _, settings = parse_args(TINY + argv)
    assert settings.data_parallel.fsdp_strategy == strategy


# -------------------------------------------------------------------- memory
def _memory_record(argv, metrics_file):
    import torch.distributed as dist
    path = f"{metrics_file}.{dist.get_rank()}"
    run_pretrain(TINY + argv + ["--metrics-file", path])
    if dist.get_rank() != 0:
        return None
    with open(path) as handle:
        records = [json.loads(line) for line in handle]
    return next(r["memory_bytes"] for r in records if "memory_bytes" in r)


def test_zero3_holds_one_dp_th_of_parameters_gradients_and_optimizer(run_distributed, tmp_path):
    def held(world_size, argv):
        name = f"metrics-dp{world_size}{'-fsdp' if argv else ''}"
        record = run_distributed(world_size, _memory_record, argv, str(tmp_path / name))[0]
        return sum(record.values())

    plain, single = held(1, []), held(1, ZERO3)
    for dp in (2, 4):
        sharded = held(dp, ZERO3)
        assert sharded * dp == single                  # no padding in this model
        assert sharded <= 1.1 * plain / dp


# -------------------------------------------------------------------- evaluation between steps
def _losses_and_validation(argv):
    result = run_pretrain(TINY + argv)
    return (result.train_losses, result.valid_losses) if result.is_logger else None


def test_evaluation_between_steps_sees_the_updated_shards(run_distributed):
    """A forward without backward (evaluation, no_grad) must leave no gathered parameters behind
    that the next step would train on (ZeRO-2 keeps them after a training forward): train and
    validation losses equal plain dp 2's (fp32 summation order only, as
    tests/test_invariance.py)."""
    strategy = "optim_grads"
    evaluating = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                  "--global-batch-size", "8"]
    plain = [r for r in run_distributed(2, _losses_and_validation, evaluating) if r][0]
    sharded = [r for r in run_distributed(2, _losses_and_validation, evaluating + [
        "--use-torch-fsdp2", "--data-parallel-sharding-strategy", strategy]) if r][0]
    assert sharded[0] == pytest.approx(plain[0], rel=1e-5)
    assert [v for _, v in sharded[1]] == pytest.approx([v for _, v in plain[1]], rel=1e-5)
    assert len(plain[1]) == 2
