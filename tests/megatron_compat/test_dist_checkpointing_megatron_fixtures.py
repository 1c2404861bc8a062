"""Checkpoints written by megatron-core 0.16.1 itself load into the compat GPTModel: the
fixtures in tests/data/megatron_core_checkpoints/ (a dense GPT, a SwiGLU GPT with tied
embeddings, an MoE GPT with sequential SwiGLU experts, one with grouped-GEMM experts —
megatron-core's GroupedMLP layout, one chunk per ep rank; written on one rank at tp = 1 by
tests/support/write_megatron_core_fixtures.py, which keeps megatron-core's logits on a probe
batch next to each) are loaded at tp = 1 and at tp = 2 (MoE: with sequence parallelism, as
megatron-core requires) and give megatron-core's logits. megatron-core is not needed here.

Tolerance: fp32 throughout and the same weights; tpfuse's kernels and megatron-core's torch
ops order the sums differently (and tp = 2 splits the GEMMs over h/tp with an all-reduce), so
each dot product of length K ≤ 128 carries a rounding error of order K·eps(fp32) ≈ 1e-5
relative in the worst case, on O(1) logits: rtol = atol = 1e-5, as the tp_layers tests (see
tests/support/tp_testing.py). A wrong key, shard or gate/up order moves the logits by ~1e-2
or more (measured: ≤ 3.3e-7).
"""
import json
import os

import pytest
import torch

import dist_checkpointing_cases as cases

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "megatron_core_checkpoints")
CASES = ("dense", "swiglu", "moe", "moe_grouped")


def load_fixture_logits(case, tp):
    """Build the compat GPTModel of a fixture at this tp, load megatron-core's checkpoint:
    (its logits (b, s, V), the fresh model's logits, megatron-core's logits)."""
    from tpfuse.megatron_compat import dist_checkpointing, parallel_state

    folder = os.path.join(FIXTURES, case)
    with open(os.path.join(folder, "config.json")) as f:
        recorded = json.load(f)
    reference = torch.load(os.path.join(folder, "reference.pt"))
    probe = (reference["tokens"], reference["position_ids"], None)
    try:
        model = cases.megatron_case_model(recorded, tp, seed=1)
        with torch.no_grad():
            fresh = model(*probe, runtime_gather_output=True)
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(),
                                                          os.path.join(folder, "checkpoint")))
            loaded = model(*probe, runtime_gather_output=True)
        return loaded, fresh, reference["logits"]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_megatron_core_fixture_loads_with_its_logits(run_distributed, case, tp):
    for loaded, fresh, expected in run_distributed(2, load_fixture_logits, case, tp):
        assert not torch.allclose(fresh, expected, atol=1e-2)     # the load changed the model
        torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
