"""The compat model half against the native engine, on gloo.

Tolerances. ``1e-6`` relative for compat vs native losses: both sides run the same tpfuse
modules, kernels and collectives in the same order; the only difference is the loss reduction
(Megatron's Σ(loss·mask)/Σmask vs a mean: a few ulps of fp32, ~1e-7) over 3 AdamW steps, which
Adam's normalised update does not amplify at this size. Logits after a checkpoint reload in the
same layout are compared exactly (the same bytes come back). Across layouts (tp2·pp1 → tp1·pp2)
the weights are bit-identical but the forward sums differ in order (partial GEMMs over h/tp
summed by an all-reduce): the tp_layers tolerance, rtol = atol = 1e-5 (see tests/support/tp_testing.py).
"""
import math

import pytest
import torch

import megatron_compat_gpt_cases as cases


def test_megatron_flow_tp2_trains_and_reloads(run_distributed, tmp_path):
    results = run_distributed(2, cases.flow_tp2, str(tmp_path / "ckpt"))
    losses, steps, before, after = results[0]
    assert losses[0] == pytest.approx(math.log(cases.VOCAB), abs=0.3)
    assert losses[-1] < losses[0] - 0.05, losses                # it trains
    for success, grad_norm, num_zeros in steps:                 # Megatron's step() triple
        assert success is True and num_zeros is None
        assert math.isfinite(grad_norm) and grad_norm > 0
    assert before.shape == (cases.MICRO, cases.SEQ, cases.VOCAB)
    assert torch.equal(before, after)
    assert results[1][0] == losses and torch.equal(results[1][3], after)


def test_model_provider_tp2_pp2_matches_native_losses(run_distributed):
    results = run_distributed(4, cases.compat_and_native_tp2_pp2)
    last_stage = [r for r in results if r[0]]
    assert len(last_stage) == 2                                 # pp rank 1, tp ranks 0 and 1
    compat, native, steps = last_stage[0]
    assert len(compat) == cases.STEPS
    assert compat == pytest.approx(native, rel=1e-6)
    assert all(step[0] for step in steps)


def test_virtual_pipeline_pp2_vpp2_matches_native_losses(run_distributed):
    """One model_provider call and one DDP per virtual chunk, tied embeddings across the first
    and last chunk (finalize_model_grads), one optimizer over both chunks, the interleaved
    schedule over the chunk list: the native vpp run's losses (the same engine, rel 1e-6 as
    above)."""
    results = run_distributed(2, cases.compat_and_native_pp2_vpp2)
    for rank, (last, compat, native, steps, entered, layers, older) in enumerate(results):
        assert last == (rank == 1)
        assert entered == [cases.STEPS, cases.STEPS]            # every chunk's no_sync, per step
        assert all(step[0] for step in steps)
        # virtual stage c·pp + r holds global layer c·pp + r (one layer per chunk)
        assert layers == [[rank], [2 + rank]]
        assert older == [([rank], rank == 0, False), ([2 + rank], False, rank == 1)]
    compat, native = results[1][1], results[1][2]
    assert len(compat) == cases.STEPS
    assert compat == pytest.approx(native, rel=1e-6)


def test_per_token_loss_scaling_in_finalize_model_grads(run_distributed):
    """Every micro-batch has the same token count T, so Σ loss / (m·T) after finalize equals the
    mean of the per-micro-batch means: the same gradient norms and steps (rel 1e-6, the order
    of the sums; a missing or doubled division moves the norm by a factor m·T = 32)."""
    (losses, norms), (mean_losses, mean_norms) = run_distributed(2, cases.per_token_and_mean_tp2)[0]
    assert norms == pytest.approx(mean_norms, rel=1e-6)
    assert losses == pytest.approx(mean_losses, rel=1e-6)


def test_checkpoint_saved_at_tp2_loads_at_pp2(run_distributed, tmp_path):
    results = run_distributed(2, cases.reshard_tp2_to_pp2, str(tmp_path / "ckpt"))
    saved, fresh, loaded = results[0][0], results[1][1], results[1][2]   # pp1: rank 0, pp2: 1
    assert not torch.allclose(fresh, saved, atol=1e-3)          # another seed: other weights
    torch.testing.assert_close(loaded, saved, rtol=1e-5, atol=1e-5)


def test_mismatched_and_corrupted_checkpoints_are_refused(run_distributed, tmp_path):
    results = run_distributed(2, cases.refused_loads, str(tmp_path / "ckpt"))
    for messages in results:
        assert len(messages) == 2, messages
        mismatch, corrupted = messages
        assert "decoder.layers.mlp.linear_fc1.weight" in mismatch and "shape" in mismatch
        assert "corrupted" in corrupted and cases.CORRUPTED_KEY in corrupted


def test_bf16_distributed_optimizer_and_fp16_loss_scaling_dp2(run_distributed):
    """The steps apply (parameters move) and leave both data-parallel replicas identical (the
    distributed optimizer all-gathers its updated shards; exact: the same bytes)."""
    ranks = run_distributed(2, cases.precision_and_sharding_dp2)
    runs = ranks[0]
    for name in ("bf16", "fp16"):
        before, after = runs[name][4:]
        assert not torch.equal(before, after) and torch.equal(after, ranks[1][name][5])
    bf16_losses, bf16_steps, bf16_class = runs["bf16"][:3]
    assert bf16_class == "DistributedOptimizer"
    assert all(step[0] for step in bf16_steps) and all(map(math.isfinite, bf16_losses))
    fp16_losses, fp16_steps, fp16_class, scale = runs["fp16"][:4]
    assert fp16_class == "Float16OptimizerWithFloat16Params"
    for success, grad_norm, num_zeros in fp16_steps:            # Megatron's skipped-step triple
        assert (success, num_zeros) == (True, None) or (grad_norm, num_zeros) == (None, None)
    assert any(step[0] for step in fp16_steps) and 1.0 <= scale <= 2.0 ** 12
    assert all(math.isfinite(loss) for loss in fp16_losses)


def test_sequence_parallel_config_gives_the_same_training(run_distributed):
    """config.sequence_parallel reaches the engine and the schedule's tensor shapes: the same
    losses as without it (rel 1e-5: reduce-scatter / all-gather instead of all-reduce reorder
    the fp32 sums, as in the tp_layers tests)."""
    with_sp, without = run_distributed(2, cases.sequence_parallel_and_plain_tp2)[0]
    assert with_sp == pytest.approx(without, rel=1e-5)
