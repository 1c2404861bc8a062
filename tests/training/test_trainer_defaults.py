"""The trainer's flags: Megatron-LM's defaults, validation of every number, tokenizers, blends, and
the surprising cases of a Megatron user's first command run through ``tpfuse-train``."""
import json
import math
import os
import subprocess
import sys

import pytest

from tpfuse.data.config import blend_from_cli
from tpfuse.data.indexed import write_indexed_dataset
from tpfuse.training import arguments

# Megatron-LM's defaults (megatron/training/arguments.py), by argparse dest.
MEGATRON_DEFAULTS = {
    "micro_batch_size": None, "global_batch_size": None, "rampup_batch_size": None,
    "train_iters": None, "lr": None, "min_lr": 0.0, "lr_warmup_iters": 0, "lr_decay_iters": None,
    "lr_decay_style": "linear", "weight_decay": 0.01, "clip_grad": 1.0, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_eps": 1e-8, "split": None, "tokenizer_type": None,
    "eval_interval": 1000, "eval_iters": 100, "log_interval": 100, "save_interval": None,
    "distributed_timeout_minutes": 10, "exit_interval": None, "exit_duration_in_mins": None,
    "exit_signal_handler": False, "tensorboard_log_interval": 1, "wandb_project": "",
    "profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [0], "async_save": False,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": None, "sequence_parallel": False, "seed": 1234,
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "make_vocab_size_divisible_by": 128,
    "init_method_std": 0.02, "vocab_size": None, "lr_wsd_decay_style": "exponential",
    "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None, "manual_gc": False,
    "manual_gc_interval": 0, "manual_gc_eval": True,
}
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-5"]


def test_every_flag_defaults_to_megatron():
    parsed = vars(arguments.build_parser().parse_args([]))
    assert {name: parsed[name] for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def test_required_settings_are_named():
    for missing in ("--micro-batch-size", "--train-iters", "--lr"):
        argv = list(TINY) + ["--mock-data", "--vocab-size", "128"]
        at = argv.index(missing)
        del argv[at:at + 2]
        with pytest.raises(ValueError, match=f"{missing} is required"):
            arguments.parse_args(argv)


@pytest.mark.parametrize("flag, value, message", [
    ("--min-lr", "nan", "--min-lr must be a finite number"),
    ("--lr", "inf", "--lr must be a finite number"),
    ("--hidden-dropout", "nan", "--hidden-dropout must be a finite number"),
    ("--init-method-std", "inf", "--init-method-std must be a finite number"),
    ("--distributed-timeout-minutes", "0", r"--distributed-timeout-minutes must be in \(0.0"),
    ("--clip-grad", "-1", r"--clip-grad must be in \[0.0"),
    ("--adam-beta2", "1.0", r"--adam-beta2 must be in \[0.0, 1.0\)"),
    ("--adam-eps", "0", r"--adam-eps must be in \(0.0"),
    ("--weight-decay", "-0.1", "--weight-decay must be in"),
    ("--min-lr", "1e-3", r"--min-lr \(0.001\) must not exceed --lr"),
    ("--exit-duration-in-mins", "-5", "--exit-duration-in-mins must be in"),
    ("--peak-tflops", "0", "--peak-tflops must be in"),
    ("--eval-iters", "-1", "--eval-iters must be >= 0"),
    ("--keep-last-checkpoints", "0", "--keep-last-checkpoints must be >= 1"),
])
def test_every_number_is_validated(flag, value, message):
    with pytest.raises(ValueError, match=message):
        arguments.parse_args(TINY + ["--mock-data", "--vocab-size", "128", flag, value])


def test_tokenizer_types(tmp_path):
    config, args = arguments.parse_args(TINY + ["--mock-data", "--vocab-size", "128"])
    # mock data needs no tokenizer flag: NullTokenizer(128) = ids 0..127 + EOD, Megatron's sizes
    assert (args.tokenizer.name, config.vocab_size, config.padded_vocab_size) == ("null:128",
                                                                                  129, 256)
    config, args = arguments.parse_args(TINY + ["--mock-data", "--tokenizer-type",
                                                "ByteTokenizer"])
    assert (args.tokenizer.name, config.vocab_size) == ("byte", 257)
    with pytest.raises(ValueError, match="--vocab-size 300 disagrees with --tokenizer-type"):
        arguments.parse_args(TINY + ["--mock-data", "--tokenizer-type", "ByteTokenizer",
                                     "--vocab-size", "300"])
    with pytest.raises(ValueError, match="--tokenizer-type is required with --data-path"):
        arguments.parse_args(TINY + ["--data-path", "x"])
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        arguments.parse_args(TINY + ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer"])


def test_huggingface_tokenizer_from_a_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # optional extra (the test extra carries it)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.save(str(tmp_path / "tokenizer.json"))
    config, args = arguments.parse_args(TINY + ["--mock-data", "--tokenizer-type",
                                                "HuggingFaceTokenizer", "--tokenizer-model",
                                                str(tmp_path)])
    assert config.vocab_size == 4 and args.tokenizer.eod == 3
    assert args.tokenizer.tokenize("hello world") == [1, 2]


def test_weighted_blends_in_megatron_syntax(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_indexed_dataset(a, [[1, 2, 3], [4, 5, 6]], vocab_size=10)    # 6 tokens
    write_indexed_dataset(b, [[1, 2]], vocab_size=10)                  # 2 tokens
    assert blend_from_cli(["0.7", a, "0.3", b]) == [(a, 0.7), (b, 0.3)]
    assert blend_from_cli([a]) == [(a, 1.0)]
    assert blend_from_cli([a, b]) == [(a, 6.0), (b, 2.0)]   # Megatron: weighted by size
    with pytest.raises(ValueError, match="'0.3' looks like a weight"):
        blend_from_cli([a, "0.3", b])
    _, args = arguments.parse_args(TINY + ["--tokenizer-type", "ByteTokenizer", "--data-path",
                                           "0.7", a, "0.3", b])
    assert args.data.data_path == ["0.7", a, "0.3", b] and args.data.split == "969,30,1"
    with pytest.raises(ValueError, match="give one of --mock-data, --data-path or"):
        arguments.parse_args(TINY + ["--mock-data", "--vocab-size", "8", "--train-data-path", a])


def test_first_megatron_command_runs_as_written(tmp_path):
    """One process, tiny model, mock data with --vocab-size 128, lr 3e-5, 6 iterations: tp, vpp,
    tokenizer, min-lr and warm-up defaults no longer get in the way, and the metrics file starts
    with the first training iteration."""
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tpfuse.training.launcher", "--nproc-per-node", "1", *TINY,
         "--mock-data", "--vocab-size", "128", "--metrics-file", str(metrics),
         "--no-progress-bar"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TPFUSE_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "memory_bytes" not in r]   # the start-up memory record
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6] and "loss" in records[0]
    # Megatron's schedule defaults: no warm-up, linear decay to min-lr 0 over --train-iters
    assert [r["lr"] for r in records] == pytest.approx([3e-5 * (1 - n / 6) for n in range(6)])
    assert all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.parametrize("flag, value, message", [
    ("--sample-temperature", "0", "--sample-temperature must be > 0, got 0.0"),
    ("--sample-top-k", "-1", "--sample-top-k must be >= 0"),
    ("--sample-top-p", "1.5", r"--sample-top-p must be in \(0, 1\], got 1.5"),
    ("--sample-top-p", "0", r"--sample-top-p must be in \(0, 1\], got 0.0"),
])
def test_sample_settings_are_validated(flag, value, message):
    with pytest.raises(ValueError, match=message):
        arguments.parse_args(TINY + ["--mock-data", "--vocab-size", "128", "--sample-prompt",
                                     "1 2", flag, value])


def test_sample_decoding_follows_the_flags():
    from tpfuse.training.sample_args import describe_sampling, sampling_kwargs

    base = TINY + ["--mock-data", "--vocab-size", "128", "--sample-prompt", "1 2"]
    _, args = arguments.parse_args(base)
    assert sampling_kwargs(args.sample) == {"greedy": True} and \
        describe_sampling(args.sample) == "greedy"
    _, args = arguments.parse_args(base + ["--sample-top-k", "40", "--sample-seed", "5"])
    assert sampling_kwargs(args.sample) == {"temperature": 1.0, "top_k": 40, "top_p": 1.0,
                                            "seed": 5}
    _, args = arguments.parse_args(base + ["--sample-temperature", "0.7", "--sample-top-p", "0.9"])
    assert sampling_kwargs(args.sample) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9,
                                            "seed": 1234}
    assert describe_sampling(args.sample) == "temperature 0.7, top-k 0, top-p 0.9, seed 1234"


@pytest.mark.parametrize("prompt, message", [
    ("200 3", r"token ids \[200\] lie outside the model's vocabulary \[0, 129\)"),   # 128 + EOD
    (" ".join(["5"] * 17), "17 tokens long, more than the model's 16 positions"),
])
def test_a_sample_prompt_that_cannot_be_generated_is_refused_before_training(prompt, message):
    with pytest.raises(ValueError, match=message):
        arguments.parse_args(TINY + ["--mock-data", "--vocab-size", "128", "--sample-prompt",
                                     prompt])
