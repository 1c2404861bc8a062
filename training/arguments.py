"""Megatron-style command-line flags: the model's (TransformerConfig) plus the training loop's.

``parse_args(argv, defaults)`` returns ``(config, args)``: ``config`` is the validated
TransformerConfig, ``args`` an ``argparse.Namespace`` with the training flags below. Flags map to
names by dash ↔ underscore, with Megatron's names (``--micro-batch-size`` ↔ ``micro_batch_size``).

Every flag defaults to Megatron-LM's default (``megatron/training/arguments.py``), so a Megatron
command line means the same here; Megatron's required settings (``--micro-batch-size``,
``--train-iters`` or ``--train-samples``, ``--lr``, the model shape) are required. Precedence,
lowest first: those defaults, the caller's ``defaults`` (Megatron's ``args_defaults``), a
``--preset`` (``training/presets.py``), the command line. Deliberate differences:
``--distributed-backend`` defaults to nccl only where CUDA is available (gloo otherwise), and the
trainer's own additions
(``--preset``, ``--metrics-file``, ``--keep-last-checkpoints``, ``--peak-tflops``, ...) are listed
by ``tpfuse-train --help-trainer``.

The tokenizer (``--tokenizer-type``) is built here, because it fixes the model's vocabulary:
``config.vocab_size`` is the tokenizer's size (EOD included), as Megatron pads
``tokenizer.vocab_size``. Mock data without ``--tokenizer-type`` uses ``NullTokenizer`` sized by
``--vocab-size``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from tpfuse.models.cli import add_config_arguments, config_from_args
from tpfuse.parallel.comm_options import REDUCE_SCATTER_STRATEGIES, CommOptions
from tpfuse.training import presets
from tpfuse.training.garbage_collection import add_gc_arguments, check_gc_arguments
from tpfuse.training.sample_args import add_sample_arguments, check_sample_arguments
from tpfuse.training.scheduler import DECAY_STYLES, WSD_DECAY_STYLES
from tpfuse.training.timers import add_timing_arguments
from tpfuse.training.train_samples import (add_sample_based_arguments, check_iterations_or_samples,
                                           check_wsd_arguments)
from tpfuse.training.precision_args import (add_precision_and_ddp_arguments,
                                            validate_precision_and_ddp_args)


def _add_batch_arguments(parser) -> None:
    batch = parser.add_argument_group("batch")
    batch.add_argument("--micro-batch-size", type=int, default=None,
                       help="samples per micro-batch on one data-parallel rank (required)")
    batch.add_argument("--global-batch-size", type=int, default=None,
                       help="samples per optimizer step over all DP ranks (default: micro × dp)")
    batch.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT over SAMPLES samples")


def _add_optimizer_arguments(parser) -> None:
    opt = parser.add_argument_group("optimizer and schedule")
    opt.add_argument("--train-iters", type=int, default=None,
                     help="optimizer steps (this or --train-samples is required)")
    opt.add_argument("--lr", type=float, default=None, help="peak learning rate (required)")
    opt.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed lr")
    opt.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    opt.add_argument("--lr-decay-iters", type=int, default=None,
                     help="steps over which the lr decays (default: --train-iters)")
    opt.add_argument("--lr-decay-style", default="linear", choices=list(DECAY_STYLES),
                     help="the decay after the warm-up (training/scheduler.py has the formulas)")
    opt.add_argument("--lr-wsd-decay-style", default="exponential", choices=list(WSD_DECAY_STYLES),
                     help="with --lr-decay-style WSD: the shape of the final anneal")
    opt.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                     help="with --lr-decay-style WSD: iterations of the final anneal (ending at "
                          "--lr-decay-iters)")
    add_sample_based_arguments(opt)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--clip-grad", type=float, default=1.0,
                     help="clip the global gradient norm to this (0 disables)")
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.999)
    opt.add_argument("--adam-eps", type=float, default=1e-8)


def _add_data_arguments(parser) -> None:
    data = parser.add_argument_group("data and tokenizer")
    data.add_argument("--mock-data", action="store_true", help="synthetic deterministic tokens")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="indexed dataset prefix(es), Megatron's forms: P | P1 P2 ... (weighted by "
                           "their sizes) | W1 P1 W2 P2 ... (e.g. 0.7 A 0.3 B), cut by --split")
    for split in ("train", "valid", "test"):
        data.add_argument(f"--{split}-data-path", nargs="*", default=None,
                          help=f"the {split} split's own blend (same forms; exclusive with "
                               "--data-path)")
    data.add_argument("--split", default=None,
                      help="train,valid,test proportions (default with --data-path: 969,30,1)")
    data.add_argument("--data-cache-path", default=None,
                      help="where dataset indices are cached (default: built in memory)")
    data.add_argument("--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES),
                      help="NullTokenizer (ids 0..vocab-size-1 + EOD; the default with --mock-data), "
                           "ByteTokenizer (bytes + EOD, 257 ids), HuggingFaceTokenizer "
                           "(--tokenizer-model: a local tokenizer.json or a folder holding one)")
    data.add_argument("--tokenizer-model", default=None,
                      help="HuggingFaceTokenizer: a local tokenizer.json (or its folder)")
    data.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-doc tokens")
    data.add_argument("--reset-position-ids", action="store_true",
                      help="positions restart at 0 after every end-of-document token")
    data.add_argument("--reset-attention-mask", action="store_true",
                      help="attend only within a document (document ids from the EOD tokens)")


def _add_run_arguments(parser) -> None:
    run = parser.add_argument_group("evaluation and logging")
    run.add_argument("--eval-interval", type=int, default=1000, help="evaluate every N steps")
    run.add_argument("--eval-iters", type=int, default=100,
                     help="validation batches per evaluation (0: no evaluation)")
    run.add_argument("--eval-at-start", action="store_true",
                     help="also evaluate once before the first step (the curve's starting point)")
    run.add_argument("--log-interval", type=int, default=100, help="print a log line every N steps")
    run.add_argument("--metrics-file", default=None,
                     help="append one JSON object per iteration (and a loss-curve PNG beside it "
                          "at the end of the run)")
    run.add_argument("--no-progress-bar", action="store_true")
    run.add_argument("--no-layout-table", action="store_true",
                     help="do not print the rank layout at start-up")


def _add_checkpoint_arguments(parser) -> None:
    ckpt = parser.add_argument_group("checkpoints and exit")
    ckpt.add_argument("--save", default=None, help="checkpoint directory to write")
    ckpt.add_argument("--save-interval", type=int, default=None, help="save every N steps")
    ckpt.add_argument("--load", default=None,
                      help="checkpoint directory to resume from (empty or missing: start fresh "
                           "with a warning, so a restarted command resumes when it can)")
    ckpt.add_argument("--finetune", action="store_true",
                      help="with --load: take only the model's weights (any layout, e.g. a "
                           "tpfuse-convert checkpoint); optimizer, scheduler, RNG and iteration "
                           "start fresh (Megatron's)")
    ckpt.add_argument("--exit-on-missing-checkpoint", action="store_true",
                      help="with --load: fail instead of starting fresh when it holds no checkpoint")
    ckpt.add_argument("--async-save", action="store_true",
                      help="write checkpoints beside training (at most one in flight, published "
                           "atomically, waited for at exit)")
    ckpt.add_argument("--keep-last-checkpoints", type=int, default=None, metavar="N",
                      help="after each save delete all but the newest N checkpoints "
                           "(default: keep all)")
    ckpt.add_argument("--exit-interval", type=int, default=None,
                      help="save and exit once the iteration is a multiple of this")
    ckpt.add_argument("--exit-duration-in-mins", type=float, default=None,
                      help="save and exit once training has run this many minutes")
    ckpt.add_argument("--exit-signal-handler", action="store_true",
                      help="on SIGTERM: save at the next iteration boundary, then exit 0")


def _add_observability_arguments(parser) -> None:
    obs = parser.add_argument_group("observability")
    obs.add_argument("--tensorboard-dir", default=None,
                     help="write TensorBoard scalars here (optional extra: tensorboard)")
    obs.add_argument("--tensorboard-log-interval", type=int, default=1)
    obs.add_argument("--wandb-project", default="",
                     help="log to this Weights & Biases project (optional extra: wandb)")
    obs.add_argument("--wandb-exp-name", default="", help="the wandb run name")
    obs.add_argument("--wandb-save-dir", default="", help="wandb's local folder")
    obs.add_argument("--log-throughput", action="store_true",
                     help="print TFLOP/s per rank (and MFU with --peak-tflops) in the log line")
    obs.add_argument("--peak-tflops", type=float, default=None,
                     help="peak dense TFLOP/s of one device in the training precision; MFU = "
                          "achieved / this (default: MFU not reported)")
    obs.add_argument("--profile", action="store_true",
                     help="record a torch.profiler Chrome trace of steps [start, end)")
    obs.add_argument("--use-pytorch-profiler", action="store_true",
                     help="accepted for Megatron compatibility: --profile always uses torch.profiler")
    obs.add_argument("--profile-step-start", type=int, default=10)
    obs.add_argument("--profile-step-end", type=int, default=12)
    obs.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                     help="global ranks that record a trace")
    obs.add_argument("--profile-dir", default=None,
                     help="where traces go (default: --tensorboard-dir, else ./profile)")


def _add_distributed_arguments(parser) -> None:
    dist = parser.add_argument_group("distributed")
    dist.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                      help="default: nccl when CUDA is available (Megatron's), else gloo")
    dist.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                      help="a collective waiting longer than this fails the job")
    dist.add_argument("--reduce-scatter-strategy", default="native",
                      choices=list(REDUCE_SCATTER_STRATEGIES),
                      help="how tensor-parallel reduce-scatters run: native reduce_scatter_tensor, "
                           "or all_reduce then keep this rank's slice (for backends without it)")
    dist.add_argument("--fused-comm-min-flops", type=float, default=None,
                      help="per-rank GEMM FLOPs from which sequence-parallel linears run the "
                           "ring-overlapped comm+GEMM pipeline (0: always, inf: never; default: "
                           "per device, 4e9 on CPU, 1e11 on CUDA)")
    dist.add_argument("--symm-mem-all-gather-matmul", action="store_true",
                      help="on CUDA, the all-gather+GEMM forward through symmetric memory "
                           "(every rank of the TP group on this node)")
    add_precision_and_ddp_arguments(parser)


def comm_options_from_args(args) -> CommOptions:
    """The three communication flags above as the ParallelState's ``comm_options``."""
    flops = args.fused_comm_min_flops
    if flops is not None and not flops >= 0:
        raise ValueError(f"--fused-comm-min-flops must be >= 0 (FLOPs), got {flops}")
    return CommOptions(reduce_scatter=args.reduce_scatter_strategy, fused_min_flops=flops,
                       symm_mem=args.symm_mem_all_gather_matmul)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    presets.add_preset_argument(parser)
    for add in (_add_batch_arguments, _add_optimizer_arguments, _add_data_arguments,
                _add_run_arguments, _add_checkpoint_arguments, _add_observability_arguments,
                _add_distributed_arguments, add_sample_arguments, add_gc_arguments):
        add(parser)


def build_parser(prog: str = "tpfuse.pretrain_gpt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Pretrain a GPT with tpfuse.",
                                     allow_abbrev=False)
    add_config_arguments(parser)
    add_training_arguments(parser)
    add_timing_arguments(parser)
    return parser


# ---------------------------------------------------------------------------- tokenizer
TOKENIZER_TYPES = ("NullTokenizer", "ByteTokenizer", "HuggingFaceTokenizer")


def build_tokenizer_from_args(args):
    """The tokenizer ``--tokenizer-type`` names (NullTokenizer for mock data without one)."""
    from tpfuse.data.tokenizer import ByteTokenizer, HFTokenizer, NullTokenizer

    kind = args.tokenizer_type or ("NullTokenizer" if args.mock_data else None)
    if kind is None:
        raise ValueError("--tokenizer-type is required with --data-path (NullTokenizer, "
                         "ByteTokenizer or HuggingFaceTokenizer with --tokenizer-model)")
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise ValueError("NullTokenizer (the tokenizer of --mock-data) needs --vocab-size")
        return NullTokenizer(args.vocab_size)
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH "
                         "(a local tokenizer.json or a folder holding one)")
    path = args.tokenizer_model
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {args.tokenizer_model}: no tokenizer.json there")
    return HFTokenizer(path)


def _apply_tokenizer(args, tokenizer) -> None:
    """The model's vocabulary is the tokenizer's (Megatron: padded from tokenizer.vocab_size)."""
    given = args.vocab_size
    if args.tokenizer_type not in (None, "NullTokenizer") and given not in (None,
                                                                            tokenizer.vocab_size):
        raise ValueError(f"--vocab-size {given} disagrees with --tokenizer-type "
                         f"{args.tokenizer_type} ({tokenizer.vocab_size} ids); omit --vocab-size "
                         f"(the tokenizer defines the vocabulary)")
    args.vocab_size = tokenizer.vocab_size


# ---------------------------------------------------------------------------- validation
REQUIRED = ("micro_batch_size", "lr")       # and --train-iters or --train-samples
POSITIVE_INTS = ("micro_batch_size", "train_iters", "log_interval", "eval_interval",
                 "global_batch_size", "save_interval", "exit_interval", "keep_last_checkpoints",
                 "tensorboard_log_interval")
NON_NEGATIVE_INTS = ("eval_iters", "lr_warmup_iters", "lr_decay_iters", "profile_step_start",
                     "sample_max_new_tokens")
# float flag -> (lowest allowed, lowest inclusive?, highest allowed, highest inclusive?)
FLOAT_RANGES = {
    "lr": (0.0, True, None, False), "min_lr": (0.0, True, None, False),
    "weight_decay": (0.0, True, None, False), "clip_grad": (0.0, True, None, False),
    "adam_beta1": (0.0, True, 1.0, False), "adam_beta2": (0.0, True, 1.0, False),
    "adam_eps": (0.0, False, None, False), "distributed_timeout_minutes": (0.0, False, None, False),
    "exit_duration_in_mins": (0.0, False, None, False), "peak_tflops": (0.0, False, None, False),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_numbers(args) -> None:
    for name in REQUIRED:
        if getattr(args, name) is None:
            raise ValueError(f"{_flag(name)} is required (Megatron has no default for it)")
    for name, value in sorted(vars(args).items()):   # every float flag: finite
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_flag(name)} must be a finite number, got {value}")
    for name in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
    for name in NON_NEGATIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"{_flag(name)} must be >= 0, got {value}")
    for name, (low, low_ok, high, high_ok) in FLOAT_RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        if value < low or (value == low and not low_ok) or (
                high is not None and (value > high or (value == high and not high_ok))):
            bounds = f"{'[' if low_ok else '('}{low}, {high if high is not None else '∞'}" \
                     f"{']' if high_ok else ')'}"
            raise ValueError(f"{_flag(name)} must be in {bounds}, got {value}")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")


def _check_schedule_and_exit(args) -> None:
    check_iterations_or_samples(args)
    check_wsd_arguments(args)
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save DIR")
    if args.async_save and not args.save:
        raise ValueError("--async-save needs --save DIR")
    if args.exit_on_missing_checkpoint and not args.load:
        raise ValueError("--exit-on-missing-checkpoint needs --load DIR")
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise ValueError(f"--profile-step-end ({args.profile_step_end}) must be greater than "
                         f"--profile-step-start ({args.profile_step_start})")


def _check_data(args) -> None:
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    sources = sum([bool(args.mock_data), bool(args.data_path), any(p for p in per_split)])
    if sources > 1:
        raise ValueError("give one of --mock-data, --data-path or --train/valid/test-data-path")
    if sources == 0:
        raise ValueError("no data: give --data-path PREFIX (see tpfuse-preprocess), "
                         "--train-data-path ..., or --mock-data")
    if args.split is None:
        if args.data_path and _is_rank_zero():
            print("WARNING: --split not given with --data-path; using Megatron's legacy default "
                  "969,30,1", flush=True)
        args.split = "969,30,1"


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def validate_training_args(args) -> None:
    """Errors naming the flag, raised on every rank before any collective."""
    _check_numbers(args)
    _check_schedule_and_exit(args)
    _check_data(args)
    validate_precision_and_ddp_args(args)
    check_gc_arguments(args)
    comm_options_from_args(args)


def parse_args(argv=None, defaults: dict | None = None):
    """``(config, args)``; ``args.tokenizer`` holds the built tokenizer (None: the preset's or
    the caller's datasets provider needs none)."""
    parser = build_parser()
    if defaults:
        parser.set_defaults(**defaults)
    preset = presets.preset_from_argv(argv)
    if preset is not None:
        parser.set_defaults(**preset.flags)
    args = parser.parse_args(argv)
    if preset is not None:
        presets.fill_preset_data(args, preset)
        given = sys.argv[1:] if argv is None else argv
        for note in (presets.fit_interleaving(args, preset, given),
                     presets.fit_run_length(args, preset, given)):
            if note and _is_rank_zero():
                print(note, flush=True)
    validate_training_args(args)
    args.tokenizer = build_tokenizer_from_args(args)
    _apply_tokenizer(args, args.tokenizer)
    check_sample_arguments(args)
    config = config_from_args(args)
    return config, args
