"""Throughput against a hand count, the profiler trace, the loss-curve PNG, metrics after a resume,
and the optional TensorBoard / wandb extras (their clear error when missing, their output when
installed)."""
import json
import os

import pytest

from support.pretrain_run import run_pretrain
from tpfuse.models import TransformerConfig
from tpfuse.training import observability
from tpfuse.training.logging_utils import truncate_metrics
from tpfuse.training.throughput import flops_per_iteration, throughput

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--eval-iters", "1",
        "--eval-interval", "2", "--log-interval", "1", "--no-progress-bar", "--no-layout-table"]


def test_flops_by_hand():
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                               vocab_size=100, make_vocab_size_divisible_by=128)
    # per token and layer: qkv 2·8·24 = 384, attention 2·2·4·8 = 128, proj 2·8·8 = 128,
    # mlp (gelu, f = 32) 2·8·32·2 = 1024 → 1664; × 2 layers + logits 2·8·128 = 2048 → 5376
    assert flops_per_iteration(config, 3) == 3 * 3 * 4 * 5376
    measured = throughput(config, 3, seconds=0.5, world_size=2, peak_tflops=1e-6)
    assert measured["tflops_per_rank"] == pytest.approx(3 * 3 * 4 * 5376 / 0.5 / 2 / 1e12)
    assert measured["mfu"] == pytest.approx(measured["tflops_per_rank"] / 1e-6)


def test_metrics_after_a_resume_never_repeat_an_iteration(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [{"iteration": 0, "valid_loss": 9}] + [{"iteration": i, "loss": i} for i in
                                                     range(1, 7)] + [{"iteration": 4,
                                                                      "valid_loss": 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert truncate_metrics(str(path), 4, drop_valid_at_start=True) == 3
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == records[:5]      # iterations 5, 6 and the validation at 4 go


def _profiled_run(argv):
    return run_pretrain(argv).valid_losses


def test_profiler_trace_loss_curve_and_throughput(run_distributed, tmp_path):
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    valid, = run_distributed(1, _profiled_run, TINY + [
        "--train-iters", "4", "--metrics-file", metrics, "--profile", "--profile-step-start",
        "2", "--profile-step-end", "4", "--profile-dir", str(tmp_path / "prof"),
        "--peak-tflops", "100"])
    trace = json.loads((tmp_path / "prof" / "trace_rank0_iters2-4.json").read_text())
    assert trace["traceEvents"], "the Chrome trace holds events"
    png = tmp_path / "run" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in open(metrics)]
    train = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and len(valid) == 2
    for record in train:    # tokens/s and TFLOP/s are two views of the same step time
        assert record["mfu"] == pytest.approx(record["tflops_per_rank"] / 100)


def test_missing_optional_extras_are_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] in ("tensorboard", "wandb"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(ImportError, match="--tensorboard-dir needs the optional package "
                                          "'tensorboard'"):
        observability.TensorBoardWriter("unused")
    with pytest.raises(ImportError, match="--wandb-project needs the optional package 'wandb'"):
        observability.WandbWriter("p", "", "", {})


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = observability.TensorBoardWriter(str(tmp_path), interval=1)
    writer.log(1, {"loss": 2.5, "lr": 0.1})
    writer.log(2, {"valid_loss": 2.0})
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [s.value for s in events.Scalars("lm loss")] == [2.5]
    assert [s.value for s in events.Scalars("lm loss validation")] == [2.0]


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    writer = observability.WandbWriter("tpfuse-test", "run", str(tmp_path), {"lr": 0.1})
    writer.log(1, {"loss": 2.5})
    writer.close()
    assert os.listdir(tmp_path / "wandb")


def test_trimming_the_metrics_file_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": i}) + "\n" for i in range(1, 5)))
    os.symlink(victim, str(path) + ".truncating")      # the old predictable temporary name
    assert truncate_metrics(str(path), 2, drop_valid_at_start=False) == 2
    assert victim.read_text() == "precious"
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"iteration": 1, "loss": 1.0}) + "\n" + '{"iteration": 2, "lo')
    assert truncate_metrics(str(path), 5, drop_valid_at_start=False) == 0
    assert str(path) in capsys.readouterr().err
    assert path.read_text() == json.dumps({"iteration": 1, "loss": 1.0}) + "\n"
