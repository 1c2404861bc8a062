"""Model + optimizer state through dist_checkpointing (``optimizer.sharded_state_dict``): saved
after two training steps at one layout and resumed at another, the next two steps' losses are
those of the uninterrupted run; resuming with a fresh optimizer instead (the model only) gives
another second loss, so the loaded moments (and step) are what makes them equal.

Tolerance (fp32): the resumed run holds bit-identical weights and moments but computes in
another layout, whose sums are ordered differently (partial GEMMs over h/tp summed by an
all-reduce, pipeline stages): rel 1e-5 on the losses, the tp_layers tolerance (see
tests/support/tp_testing.py); one Adam step moves each weight by about lr = 3e-3, so a missing
or wrong moment changes the next loss by far more (the fresh optimizer's second loss must miss
by more than 10× the tolerance; measured 80× for the MoE model, over 100× for the dense ones).
bf16 resumed in the same layout: the same bytes (fp32 main copies restored exactly, the same
sums): exact.
"""
import pytest
import torch

import dist_checkpointing_cases as cases


def _last_stage(results):
    """(uninterrupted, resumed, model only) losses, each from a rank on its run's last stage."""
    return tuple(next(r[i] for r in results if r[i] is not None) for i in range(3))


def _check_resumed(uninterrupted, resumed, model_only, rel):
    assert resumed == pytest.approx(uninterrupted, rel=rel, abs=0)
    assert model_only[0] == pytest.approx(uninterrupted[0], rel=rel, abs=0)  # the same weights
    assert abs(model_only[1] - uninterrupted[1]) > 10 * rel * abs(uninterrupted[1])


def test_fp32_optimizer_saved_at_tp2_resumes_at_pp2(run_distributed, tmp_path):
    uninterrupted, resumed, model_only = _last_stage(run_distributed(
        2, cases.resume_at_another_layout, str(tmp_path / "ckpt"), {"tp": 2}, {"pp": 2},
        overrides=cases.SWIGLU))
    _check_resumed(uninterrupted, resumed, model_only, rel=1e-5)


def test_distributed_optimizer_saved_at_dp2_resumes_at_tp2(run_distributed, tmp_path):
    uninterrupted, resumed, model_only = _last_stage(run_distributed(
        2, cases.resume_at_another_layout, str(tmp_path / "ckpt"), {}, {"tp": 2},
        distributed=True))
    _check_resumed(uninterrupted, resumed, model_only, rel=1e-5)


def test_bf16_distributed_optimizer_resumes_exactly_at_dp2(run_distributed, tmp_path):
    uninterrupted, resumed, model_only = _last_stage(run_distributed(
        2, cases.resume_at_another_layout, str(tmp_path / "ckpt"), {}, {},
        dtype=torch.bfloat16, distributed=True))
    assert resumed == uninterrupted
    assert model_only[1] != uninterrupted[1]


def test_moe_model_and_optimizer_saved_at_ep2_resume_at_tp2(run_distributed, tmp_path):
    """Experts over ep 2 (the optimizer's expert moments in the expert-data-parallel buffers)
    → tp 2 with sequence parallelism, experts cut over etp 2."""
    moe = dict(cases.MOE, moe_grouped_gemm=True, add_bias_linear=False)
    uninterrupted, resumed, model_only = _last_stage(run_distributed(
        2, cases.resume_at_another_layout, str(tmp_path / "ckpt"), {"ep": 2}, {"tp": 2},
        overrides=moe))
    _check_resumed(uninterrupted, resumed, model_only, rel=1e-5)
