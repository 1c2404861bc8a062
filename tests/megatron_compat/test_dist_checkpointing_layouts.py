"""dist_checkpointing across layouts for the sharded layouts Megatron stores specially: a gated
(SwiGLU) MLP's fc1 at tp > 1 and MoE experts over ep / etp. Each checkpoint is saved at one
layout and loaded at another into a model built from another seed.

Tolerance: the loaded weights are bit-identical to the saved ones; the two layouts order the
fp32 sums differently (partial GEMMs over h/tp summed by an all-reduce, experts computed on
other ranks and combined in another order): rtol = atol = 1e-5, the tp_layers tolerance (see
tests/support/tp_testing.py). The fresh model (another seed) must differ by far more.
"""
import torch

import dist_checkpointing_cases as cases


def _check(results):
    for saved, fresh, loaded, common in results:
        assert not torch.allclose(fresh, saved, atol=1e-3)       # another seed: other weights
        torch.testing.assert_close(loaded, saved, rtol=1e-5, atol=1e-5)
        assert common == {}              # every entry is sharded: nothing left in common.pt


def test_swiglu_fc1_saved_at_tp2_loads_at_tp1(run_distributed, tmp_path):
    overrides = dict(cases.SWIGLU, add_bias_linear=True)
    _check(run_distributed(2, cases.save_then_load, str(tmp_path / "ckpt"), {"tp": 2},
                           {"tp": 1}, overrides))


def test_swiglu_fc1_saved_at_tp1_loads_at_tp2(run_distributed, tmp_path):
    _check(run_distributed(2, cases.save_then_load, str(tmp_path / "ckpt"), {"tp": 1},
                           {"tp": 2}, cases.SWIGLU))


def test_moe_experts_saved_at_ep2_load_at_etp2_and_into_the_other_expert_module(
        run_distributed, tmp_path):
    """Sequential experts at ep 2 → grouped-GEMM experts at tp 2 · etp 2 (the two expert
    modules store the same global tensors)."""
    sequential = dict(cases.MOE, add_bias_linear=False)
    grouped = dict(sequential, moe_grouped_gemm=True)
    _check(run_distributed(2, cases.save_then_load, str(tmp_path / "ckpt"), {"ep": 2},
                           {"tp": 2, "etp": 2}, sequential, grouped))


def test_moe_with_shared_expert_saved_at_tp2_etp2_loads_at_ep2(run_distributed, tmp_path):
    overrides = dict(cases.MOE, moe_grouped_gemm=True, add_bias_linear=True,
                     moe_shared_expert_intermediate_size=2 * cases.HIDDEN)
    _check(run_distributed(2, cases.save_then_load, str(tmp_path / "ckpt"), {"tp": 2, "etp": 2},
                           {"ep": 2}, overrides))


def test_apply_swiglu_sharded_factory_builds_megatrons_pieces():
    """tp rank 1 of 2, a layer axis prepended: the local [gate_1; up_1] (2 + 2 rows) is stored
    as rows 2..3 (gate) and 6..7 (up) of the (L, 8, 3) global [gate; up], as megatron-core's
    apply_swiglu_sharded_factory builds it."""
    from tpfuse.megatron_compat.dist_checkpointing import ShardedTensor
    from tpfuse.megatron_compat.transformer.mlp import apply_swiglu_sharded_factory

    local = torch.arange(12.0).view(4, 3)
    layer = (0, 1, 2)
    column = ShardedTensor.from_rank_offsets("fc1", local, layer, (1, 1, 2), replica_id=(0, 0, 0),
                                             prepend_axis_num=1)
    gate, up = apply_swiglu_sharded_factory(column, (layer,)).build()
    assert (gate.global_shape, gate.global_offset) == ((2, 8, 3), (1, 2, 0))
    assert (up.global_shape, up.global_offset) == ((2, 8, 3), (1, 6, 0))
    assert torch.equal(gate.data, local[:2]) and torch.equal(up.data, local[2:])
