"""bf16 / fp16 training through the real ``pretrain``: updates smaller than a bf16 ulp are kept
(fp32 main parameters), and an inf/nan in one rank's gradients is handled identically on every
rank — fp16 skips the step and backs the loss scale off (Megatron's hysteresis), bf16/fp32 stop
with an error naming the iteration (or skip with ``--skip-nonfinite``), and no checkpoint is
written from the bad step. The loss-curve tolerances of bf16/fp16 runs live in
test_invariance.py (``test_mixed_precision_tracks_fp32``).
"""
import json
import math
import os

import pytest
import torch

from support.pretrain_run import run_pretrain
from test_invariance import TINY_MODEL, _losses, _parallel


def _pretrain(argv, forward_step=None):
    return run_pretrain(TINY_MODEL + list(argv), forward_step=forward_step)


# -------------------------------------------------------------------- tiny learning rate
def _validation_drop(argv):
    result = _pretrain(argv)
    if not result.is_logger:
        return None
    (_, first), (_, last) = result.valid_losses[0], result.valid_losses[-1]
    return first - last


def test_bf16_keeps_updates_smaller_than_its_ulp(run_distributed):
    """lr 2e-5, constant: Adam moves each weight by ~2e-5 per step, below half a bf16 ulp of the
    typical weight (|w| ≈ 0.016 → ulp 6.1e-5) and of the norm weights (1.0 → ulp 7.8e-3).
    Stepping bf16 weights directly rounds most updates away (measured: the validation loss then
    falls 0.55× as far as fp32's); fp32 main weights keep them (measured 1.00×). The drop is
    measured on the same validation batches before and after 20 steps."""
    tiny_lr = ["--lr", "2e-5", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
               "--train-iters", "20", "--lr-decay-iters", "20", "--eval-at-start",
               "--eval-interval", "20", "--eval-iters", "2", "--clip-grad", "0"]
    (fp32,) = run_distributed(1, _validation_drop, tiny_lr)
    (bf16,) = run_distributed(1, _validation_drop, tiny_lr + ["--bf16"])
    assert fp32 > 3e-3                      # it trains measurably (vs ~3e-5 bf16 eval rounding)
    assert bf16 >= 0.85 * fp32


# -------------------------------------------------------------------- injected inf / nan
def _injecting_forward_step(rank, iterations, value, microbatches):
    """The GPT forward_step, plus: on global rank ``rank``, in each of ``iterations``, one
    micro-batch's gradient of the first layer's QKV bias (a TP-sharded parameter: only this rank
    holds it) is replaced by ``value``."""
    import torch.distributed as dist

    from tpfuse.pretrain_gpt import forward_step

    calls = [0]

    def step(data_iterator, model):
        iteration = calls[0] // microbatches + 1
        calls[0] += 1
        output, loss_func = forward_step(data_iterator, model)
        if dist.get_rank() == rank and iteration in iterations and calls[0] % microbatches == 1:
            bias = model.layers[0].self_attention.linear_qkv.bias
            handle = []
            handle.append(bias.register_hook(
                lambda g: (handle.pop().remove(), torch.full_like(g, value))[1]))
        return output, loss_func
    return step


def _run_injected(argv, rank, iterations, value, microbatches):
    step = _injecting_forward_step(rank, iterations, value, microbatches)
    try:
        result = _pretrain(argv, step)
    except FloatingPointError as error:
        return str(error)
    return result.skipped, result.loss_scales, result.train_losses


def test_fp16_overflow_on_one_rank_is_skipped_by_every_rank_and_backs_off(run_distributed,
                                                                         tmp_path):
    """tp2 × pp2; rank 1 (tp 1, pp 0) alone sees inf in iterations 3 and 4. With Megatron's
    default hysteresis 2 the first overflow only spends the hysteresis, the second halves the
    scale; both steps are skipped on all four ranks alike, and the metrics file records the scale
    and the running count of skipped steps."""
    metrics = str(tmp_path / "metrics.jsonl")
    argv = ["--fp16", "--initial-loss-scale", "4096", "--train-iters", "6",
            "--lr-decay-iters", "6", "--metrics-file", metrics] + _parallel(tp=2, pp=2)
    results = run_distributed(4, _run_injected, argv, 1, {3, 4}, math.inf, 4)
    skipped, scales, _ = results[0]
    assert skipped == [False, False, True, True, False, False]
    assert scales == [4096.0, 4096.0, 4096.0, 2048.0, 2048.0, 2048.0]
    assert all(r[:2] == (skipped, scales) for r in results)
    logged = [r[2] for r in results if r[2]]
    assert len(logged) == 1 and all(math.isfinite(loss) for loss in logged[0])
    with open(metrics) as handle:
        steps = [r for r in map(json.loads, handle) if "loss" in r]
    assert [r["loss_scale"] for r in steps] == scales
    assert [r["skipped"] for r in steps] == skipped
    assert [r["skipped_iterations"] for r in steps] == [0, 0, 1, 2, 2, 2]


def test_log_line_shows_loss_scale_and_skipped_steps_of_the_interval(capsys):
    """Megatron's line: the loss scale, and the steps skipped since the previous line (the
    interval's count, 1 in each of 1-3 and 4-6 when steps 3 and 4 are skipped)."""
    from tpfuse.training.logging_utils import TrainingLogger

    logger = TrainingLogger(True, 6, 0, None, progress_bar=False)
    for iteration, (skip, scale) in enumerate(zip([0, 0, 1, 1, 0, 0], [8, 8, 8, 4, 4, 4]), 1):
        record = {"consumed_samples": 8 * iteration, "ms_per_iter": 1.0, "lr": 1e-3,
                  "global_batch_size": 8, "loss": 4.0, "loss_scale": float(scale),
                  "grad_norm": None if skip else 0.5, "skipped": bool(skip),
                  "skipped_iterations": [0, 0, 1, 2, 2, 2][iteration - 1], "tokens_per_s": 1.0}
        logger.iteration(iteration, record, log_now=iteration % 3 == 0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "loss scale: 8.0 | grad norm: nan | number of skipped iterations:   1 |" in lines[0]
    assert "loss scale: 4.0 | grad norm: 0.500 | number of skipped iterations:   1 |" in lines[1]


def test_bf16_nan_stops_every_rank_naming_the_iteration_and_saves_nothing_of_it(
        run_distributed, tmp_path):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    argv = ["--bf16", "--train-iters", "4", "--lr-decay-iters", "4"] + _parallel(pp=2) + save
    messages = run_distributed(2, _run_injected, argv, 0, {2}, math.nan, 4)
    for message in messages:
        assert isinstance(message, str) and "iteration 2" in message
        assert "--skip-nonfinite" in message
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000001",
                                                     "latest_checkpointed_iteration.txt"]


def test_skip_nonfinite_skips_and_counts(run_distributed):
    argv = ["--bf16", "--skip-nonfinite", "--train-iters", "4", "--lr-decay-iters", "4"] + \
        _parallel(pp=2)
    for skipped, scales, _ in run_distributed(2, _run_injected, argv, 0, {2}, math.nan, 4):
        assert skipped == [False, True, False, False]
        assert scales == [1.0] * 4


# -------------------------------------------------------------------- memory record
def _memory_record(argv, path):
    _pretrain(argv + ["--metrics-file", path])
    import json
    with open(path) as handle:
        return json.loads(handle.readline()) if os.path.exists(path) else None


@pytest.mark.parametrize("precision, bytes_per", [([], (4, 0, 4, 8)),
                                                   (["--bf16"], (2, 4, 4, 8))])
def test_memory_record_before_the_first_iteration(run_distributed, tmp_path, precision,
                                                  bytes_per):
    """Bytes per parameter held by one process: fp32 keeps no main copy; bf16 2-byte weights,
    a 4-byte main copy, fp32 gradients, two fp32 Adam moments."""
    path = str(tmp_path / "m.jsonl")
    (record,) = run_distributed(1, _memory_record, precision + ["--train-iters", "1"], path)
    assert record["iteration"] == 0
    held = record["memory_bytes"]
    numel = held["gradients"] // 4
    assert numel > 0
    expected = dict(zip(("parameters", "main_parameters", "gradients", "optimizer_state"),
                        (b * numel for b in bytes_per)))
    assert held == expected


# -------------------------------------------------------------------- runs that went bad
def test_consecutive_skipped_steps_stop_training_naming_the_flag(run_distributed):
    argv = ["--bf16", "--skip-nonfinite", "--train-iters", "6", "--lr-decay-iters", "6",
            "--max-consecutive-skipped-steps", "3"]
    (message,) = run_distributed(1, _run_injected, argv, 0, {2, 3, 4, 5}, math.nan, 4)
    assert isinstance(message, str) and "iteration 4" in message
    assert "--max-consecutive-skipped-steps 3" in message


def test_the_skipped_steps_limit_has_a_default():
    from tpfuse.training.precision_args import PrecisionSettings

    assert PrecisionSettings().max_consecutive_skipped_steps == 100


def _poisoning_forward_step(iteration_to_poison, microbatches):
    """The GPT forward_step; from ``iteration_to_poison`` on, a weight holds NaN."""
    from tpfuse.pretrain_gpt import forward_step

    calls = [0]

    def step(data_iterator, model):
        calls[0] += 1
        if calls[0] // microbatches + 1 >= iteration_to_poison:
            with torch.no_grad():
                model.layers[0].self_attention.linear_qkv.bias.fill_(math.nan)
        return forward_step(data_iterator, model)
    return step


def _run_poisoned(argv):
    try:
        _pretrain(argv, _poisoning_forward_step(3, 4))
    except FloatingPointError as error:
        return str(error)
    return None


def test_a_run_ending_with_non_finite_weights_fails(run_distributed):
    argv = ["--skip-nonfinite", "--train-iters", "3", "--lr-decay-iters", "3"]
    (message,) = run_distributed(1, _run_poisoned, argv)
    assert message and "non-finite" in message and "iteration 3" in message
