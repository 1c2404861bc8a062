"""Resharding: a checkpoint saved at one TP/PP/VPP/DP layout resumes at another.

The pure tests check the sharding algebra against index arithmetic on a full tensor. The end-to-end
test trains 4 iterations at tp=2 pp=2 vpp=2 + SP (SwiGLU, so fc1 has partition stride 2), saves,
and resumes at tp=1 pp=2 dp=2 for the remaining 6: the 10 losses must equal one uninterrupted
single-process run within the invariance test's 1e-5 relative tolerance (only the order of fp32
sums differs between layouts; a wrongly resharded weight or Adam moment moves the loss by far
more — the first resumed loss checks the weights, the later ones the optimizer state).
"""
import types

import pytest
import torch

from support.pretrain_run import pretrain_error
from test_invariance import DISTRIBUTED_OPTIMIZER, TINY_MODEL, _losses, _parallel
from tpfuse.checkpoint.format import _read_payload, iteration_dir
from tpfuse.checkpoint.reshard import (VOCAB_PARAMETERS, assemble_global_state, full_from_shards,
                                     reshard_tensor, shard_for)

SWIGLU = ["--swiglu", "--num-layers", "8"]   # 8 layers: pp 2 × vpp 2 of 2 layers, re-cut to vpp 4
VOCAB = 64   # TINY_MODEL's token ids (--vocab-size 63 + EOD)


# -------------------------------------------------------------------- pure algebra
def _reference_shard(full, dim, stride, tp, rank):
    """Rank ``rank``'s slice by index arithmetic: blocks rank, rank + tp, … of size n/(tp·s)."""
    block = full.shape[dim] // (tp * stride)
    index = [(rank + i * tp) * block + j for i in range(stride) for j in range(block)]
    return full.index_select(dim, torch.tensor(index))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(dim, stride, tp):
    full = torch.arange(16 * 24, dtype=torch.float32).reshape(16, 24)
    shards = [shard_for(full, dim, stride, tp, r) for r in range(tp)]
    for rank, part in enumerate(shards):
        assert torch.equal(part, _reference_shard(full, dim, stride, tp, rank))
    assert torch.equal(full_from_shards(shards, dim, stride), full)
    for new_tp in (1, 2, 4):          # old layout's shards re-cut for every other tp
        for new_rank in range(new_tp):
            assert torch.equal(reshard_tensor(shards, dim, stride, new_tp, new_rank),
                               _reference_shard(full, dim, stride, new_tp, new_rank))


def test_replicated_parameter_takes_rank_zero_copy():
    full = torch.randn(5)
    assert torch.equal(reshard_tensor([full, full.clone()], None, 1, 4, 3), full)


# -------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def saved(run_distributed, tmp_path_factory):
    """(checkpoint dir, losses of iterations 1-4) from tp=2 pp=2 vpp=2 + SP on 4 ranks."""
    root = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    first = _losses(run_distributed, 4, SWIGLU + _parallel(tp=2, pp=2, vpp_layers=2, sp=True)
                    + ["--save", root, "--save-interval", "4", "--train-iters", "4"])
    assert len(first) == 4
    return root, first


def test_resume_at_another_layout_reproduces_single_process(run_distributed, saved):
    root, first = saved
    reference = _losses(run_distributed, 1, SWIGLU)
    resumed = _losses(run_distributed, 4, SWIGLU + _parallel(tp=1, pp=2) + ["--load", root])
    assert len(resumed) == 6
    assert first + resumed == pytest.approx(reference, rel=1e-5)


TARGETS = {  # name: (world size, flags) of the layout loading the tp=2 pp=2 vpp=2 checkpoint
    "tp1-pp2-dp2": (4, _parallel(tp=1, pp=2)),
    "pp2-vpp4": (2, _parallel(pp=2, vpp_layers=1)),
    "single-process": (1, []),
    # the distributed optimizer cuts every rank's fp32 state into dp shards of its own buckets
    "tp1-pp2-dp2-distopt": (4, _parallel(tp=1, pp=2) + DISTRIBUTED_OPTIMIZER),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_resharded_state_is_bit_exact(run_distributed, saved, tmp_path, target):
    """Load at another layout, save at once: every full weight, Adam moment and step is equal.

    Resharding only moves values, so this is exact (torch.equal), not a tolerance.
    """
    root, _ = saved
    again = str(tmp_path / "again")
    world_size, layout = TARGETS[target]
    _losses(run_distributed, world_size,
            SWIGLU + layout + ["--load", root, "--save", again, "--train-iters", "4"])
    _assert_same_global_state(root, again, 4, ["exp_avg", "exp_avg_sq", "param", "step"])


def _assert_same_global_state(root: str, again: str, iteration: int, keys: list) -> None:
    """Every full weight and optimizer tensor of the two checkpoints is equal (torch.equal; the
    vocabulary parameters' padding rows, which depend on tp, are checked to be zero)."""
    before = assemble_global_state(iteration_dir(root, iteration), _read_payload)
    after = assemble_global_state(iteration_dir(again, iteration), _read_payload)
    assert sorted(after) == sorted(before)
    for name, entry in before.items():
        assert sorted(after[name]) == sorted(entry) == keys, name
        for key, value in entry.items():
            new = after[name][key]
            if name in VOCAB_PARAMETERS and key != "step":  # padding: 256 rows at tp=2, 128 at 1
                assert not value[VOCAB:].any() and not new[VOCAB:].any(), f"{name} {key} padding"
                value, new = value[:VOCAB], new[:VOCAB]
            assert torch.equal(new, value), f"{name} {key}"


def test_bf16_distributed_optimizer_state_reshards_bit_exact(run_distributed, tmp_path):
    """bf16 with the distributed optimizer: 2 iterations at tp=2 dp=2 (each rank saves the fp32
    main copy and Adam moments of its half of its TP shard's buckets), loaded at pp=2 dp=2 (other
    buckets, other shards) and saved again at once: the reassembled fp32 main parameters, moments
    and bf16 weights are unchanged, element for element."""
    root, again = str(tmp_path / "ckpt"), str(tmp_path / "again")
    flags = ["--bf16", "--train-iters", "2"] + DISTRIBUTED_OPTIMIZER
    first = _losses(run_distributed, 4, flags + _parallel(tp=2) + ["--save", root])
    assert len(first) == 2
    _losses(run_distributed, 4, flags + _parallel(pp=2) + ["--load", root, "--save", again])
    _assert_same_global_state(root, again, 2,
                              ["exp_avg", "exp_avg_sq", "main_param", "param", "step"])


def test_other_model_shape_is_refused_on_every_rank(run_distributed, saved):
    """Same parameter shapes (8 or 2 heads instead of 4) or not (RMSNorm has no norm bias):
    refused before any weight is touched, on the resharding path (tp=4) and the same-layout
    path."""
    root, _ = saved
    same_layout = SWIGLU + _parallel(tp=2, pp=2, vpp_layers=2, sp=True)
    for world_size, argv in ((4, SWIGLU + _parallel(tp=4) + ["--num-attention-heads", "8"]),
                             (4, same_layout + ["--num-attention-heads", "2"]),
                             (2, SWIGLU + _parallel(tp=2) + ["--normalization", "RMSNorm"])):
        messages = run_distributed(world_size, pretrain_error,
                                   TINY_MODEL + argv + ["--load", root])
        for message in messages:
            assert message is not None, "every rank must fail, none may train on"
            assert "another model" in message and "num_attention_heads" in message \
                or "normalization" in message, message


def _fail_on_rank_one(folder):
    import torch.distributed as dist

    from tpfuse.checkpoint import format as checkpoint
    from tpfuse.checkpoint import reshard

    def load_resharded(*args):
        if dist.get_rank() == 1:
            raise KeyError("only rank 1 cannot reshard")
        return {"iteration": 4}

    original, reshard.load_resharded = reshard.load_resharded, load_resharded
    state = types.SimpleNamespace(tp_size=1, pp_size=1, dp_size=2, vpp_size=None,
                                  size=lambda name: 1)
    try:
        checkpoint._load_other_layout(folder, [], None, state, checkpoint._read_payload)
    except Exception as error:  # noqa: BLE001 — the test inspects which error each rank got
        return f"{type(error).__name__}: {error}"
    finally:
        reshard.load_resharded = original
    return None


def test_failure_on_one_rank_fails_every_rank(run_distributed, tmp_path):
    # a rank returning normally would go on to the training loop's collectives and hang there
    rank0, rank1 = run_distributed(2, _fail_on_rank_one, str(tmp_path))
    assert rank0 is not None and "failed on another rank" in rank0
    assert rank1 == "KeyError: 'only rank 1 cannot reshard'"
