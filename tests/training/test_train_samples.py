"""Sample-based training (``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``):
iteration counts and lr schedules against values computed by hand from Megatron-LM's rules, the
validation of mixed / missing forms, and the preset giving way to a sample-based command line."""
import json

import pytest

from support.pretrain_run import run_pretrain
from tpfuse.parallel.microbatches import MicrobatchCalculator
from tpfuse.training import arguments
from tpfuse.training.train_samples import iterations_for_samples

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "64"]


def test_iterations_without_rampup_drop_the_partial_batch():
    assert iterations_for_samples(1000, MicrobatchCalculator(32, 4, 2)) == 31     # 1000 // 32
    assert iterations_for_samples(1024, MicrobatchCalculator(32, 4, 2)) == 32


def test_iterations_follow_the_rampup():
    # ramp 16 → 32 in one increment over 64 samples (b·d = 8): batch(c) = 16 + int(c / 64)·16
    # while c ≤ 64. Ramp loop: c = 0, 16, 32, 48 take 16 each; c = 64 (still ≤ 64) takes 32 → c = 96
    # after 5 steps; then (200 − 96) // 32 = 3 full batches: 8 steps, 192 samples.
    calculator = MicrobatchCalculator(32, 8, 1, rampup_batch_size=[16, 16, 64])
    assert iterations_for_samples(200, calculator) == 8
    assert calculator.current_global_batch_size == 16          # left at consumed = 0
    # 50 samples end inside the ramp: 16 + 16 + 16 = 48 fit, the fourth 16 does not
    assert iterations_for_samples(50, calculator) == 3
    assert iterations_for_samples(96, calculator) == 5         # exactly the ramp


@pytest.mark.parametrize("flags, message", [
    ([], "--train-iters is required"),
    (["--train-iters", "4", "--train-samples", "64"],
     r"--train-iters \(4\) and --train-samples \(64\) are exclusive"),
    (["--train-samples", "64", "--lr-decay-iters", "3"],
     r"--lr-decay-iters \(3\) does not go with --train-samples: use --lr-decay-samples"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"],
     "--lr-warmup-iters .* use --lr-warmup-samples"),
    (["--train-iters", "4", "--lr-warmup-samples", "8"],
     r"--lr-warmup-samples \(8\) does not go with --train-iters: use --lr-warmup-iters"),
    (["--train-iters", "4", "--lr-decay-samples", "8"], "use --lr-decay-iters"),
    (["--train-samples", "64", "--lr-warmup-samples", "65"],
     r"--lr-warmup-samples \(65\) must not exceed the decay span .* \(64\)"),
    (["--train-samples", "64", "--lr-decay-samples", "16", "--lr-warmup-samples", "32"],
     r"--lr-warmup-samples \(32\) must not exceed the decay span --lr-decay-samples"),
    (["--train-samples", "0"], "--train-samples must be >= 1, got 0"),
    (["--train-samples", "64", "--lr-decay-samples", "-1"], "--lr-decay-samples must be >= 0"),
    (["--train-iters", "4", "--lr-wsd-decay-samples", "8"],
     r"--lr-wsd-decay-samples \(8\) does not go with --train-iters: use --lr-wsd-decay-iters"),
    (["--train-iters", "4", "--lr-decay-style", "WSD"],
     r"--lr-decay-style WSD needs --lr-wsd-decay-iters N >= 1"),
    (["--train-samples", "64", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "0"],
     r"--lr-decay-style WSD needs --lr-wsd-decay-samples N >= 1 .*got 0"),
])
def test_iteration_and_sample_forms_do_not_mix(flags, message):
    """Raised by parse_args, which every rank runs before torch.distributed is initialised."""
    with pytest.raises(ValueError, match=message):
        arguments.parse_args(TINY + flags)


def test_preset_length_gives_way_to_train_samples(capsys):
    _, args = arguments.parse_args(["--preset", "stdlib-demo", "--mock-data",
                                    "--train-samples", "640", "--lr-warmup-samples", "64"])
    assert (args.training.train_iters, args.scheduler.lr_warmup_iters,
            args.training.train_samples) == (None, 0, 640)
    assert "sample-based run, so its --train-iters, --lr-warmup-iters are not used" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match="are exclusive"):        # the user's own iterations
        arguments.parse_args(["--preset", "stdlib-demo", "--mock-data", "--train-samples", "640",
                              "--train-iters", "5"])


def test_sample_based_run_with_rampup_by_hand(run_distributed, tmp_path):
    """dp 2, micro 2 (b·d = 4), global 8, ramp 4 → 8 over 16 samples, 48 samples: batch(c) =
    4 + int(c / 16)·4 while c ≤ 16, so the batches are 4, 4, 4, 4, 8 (at c = 16), then
    (48 − 24) // 8 = 3 more of 8: 8 iterations. lr (linear, peak 1e-3, warm-up 8 samples, decay
    until 48) at the samples consumed before each step, c = 0, 4, 8, 12, 16, 24, 32, 40:
    c / 8 during warm-up, then 1 − (c − 8) / 40 (× 1e-3)."""
    metrics = tmp_path / "m.jsonl"
    run_distributed(2, run_pretrain, TINY + [
        "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "16", "--train-samples",
        "48", "--lr-warmup-samples", "8", "--lr-decay-samples", "48", "--lr-decay-style",
        "linear", "--eval-iters", "0", "--log-interval", "100", "--no-progress-bar",
        "--no-layout-table", "--metrics-file", str(metrics)])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["global_batch_size"] for r in train] == [4, 4, 4, 4, 8, 8, 8, 8]
    assert [r["consumed_samples"] for r in train] == [4, 8, 12, 16, 24, 32, 40, 48]
    expected = [0.0, 0.5, 1.0, 0.9, 0.8, 0.6, 0.4, 0.2]
    # the scheduler's own float arithmetic on exact integers: 1e-15 covers the rounding
    assert [r["lr"] for r in train] == pytest.approx([1e-3 * v for v in expected], abs=1e-15)


def test_a_schedule_in_samples_resumes_only_in_samples():
    import torch

    from tpfuse.training.scheduler import LRScheduler

    def scheduler(unit):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return LRScheduler(optimizer, 1.0, 0.0, 8, 48, "linear", unit)

    samples = scheduler("samples")
    for batch in (4, 4, 8):                   # 16 samples consumed: 1 − (16 − 8) / 40
        samples.step(batch)
    assert samples.lr == pytest.approx(0.8, abs=1e-15)
    resumed = scheduler("samples")
    resumed.load_state_dict(samples.state_dict())
    assert resumed.lr == samples.lr
    with pytest.raises(ValueError, match="counts samples and this run's counts iterations"):
        scheduler("iterations").load_state_dict(samples.state_dict())
    older = scheduler("iterations").state_dict()
    del older["unit"]                         # a checkpoint written before the unit was recorded
    scheduler("iterations").load_state_dict(older)


def test_wsd_run_in_samples_by_hand(run_distributed, tmp_path):
    """One rank, global batch 4, 24 samples (6 steps), warm-up 4 samples, decay until 24, WSD with
    a linear anneal over the last 8 samples: lr before each step at c = 0, 4, ..., 20 consumed is
    c / 4 in the warm-up, 1 while c ≤ 24 − 8 = 16, then 1 − (c − 16) / 8 (× 1e-3)."""
    metrics = tmp_path / "m.jsonl"
    run_distributed(1, run_pretrain, TINY + [
        "--global-batch-size", "4", "--train-samples", "24", "--lr-warmup-samples", "4",
        "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-samples",
        "8", "--eval-iters", "0", "--log-interval", "100", "--no-progress-bar",
        "--no-layout-table", "--metrics-file", str(metrics)])
    train = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert [r["lr"] for r in train] == pytest.approx(
        [1e-3 * v for v in (0.0, 1.0, 1.0, 1.0, 1.0, 0.5)], abs=1e-15)
