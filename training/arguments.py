"""Megatron-style command-line flags: the model's (TransformerConfig) plus the training loop's.

``parse_args(argv, defaults)`` returns ``(config, args)``: ``config`` is the validated
TransformerConfig, ``args`` an ``argparse.Namespace`` with the training flags below. Flags map to
names by dash ↔ underscore, with Megatron's names (``--micro-batch-size`` ↔ ``micro_batch_size``).
"""
from __future__ import annotations

import argparse

from tpfuse.models.cli import add_config_arguments, config_from_args
from tpfuse.training.precision_args import (add_precision_and_ddp_arguments,
                                            validate_precision_and_ddp_args)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    batch = parser.add_argument_group("batch")
    batch.add_argument("--micro-batch-size", type=int, default=1,
                       help="samples per micro-batch on one data-parallel rank")
    batch.add_argument("--global-batch-size", type=int, default=None,
                       help="samples per optimizer step over all DP ranks (default: micro × dp)")
    batch.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT over SAMPLES samples")

    opt = parser.add_argument_group("optimizer and schedule")
    opt.add_argument("--train-iters", type=int, default=100, help="optimizer steps to run")
    opt.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    opt.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed lr")
    opt.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    opt.add_argument("--lr-decay-iters", type=int, default=None,
                     help="steps over which the lr decays (default: --train-iters)")
    opt.add_argument("--lr-decay-style", default="cosine", choices=["cosine", "linear", "constant"])
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--clip-grad", type=float, default=1.0,
                     help="clip the global gradient norm to this (0 disables)")
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.95)
    opt.add_argument("--adam-eps", type=float, default=1e-8)

    data = parser.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true", help="synthetic deterministic tokens")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="indexed dataset prefix(es), optionally weighted: [W1] P1 [W2 P2 ...]")
    data.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    data.add_argument("--data-cache-path", default=None,
                      help="where dataset indices (and the default corpus) are cached")
    data.add_argument("--tokenizer-type", default="byte",
                      help="byte, or the path of a HuggingFace tokenizer.json")
    data.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-doc tokens")
    data.add_argument("--reset-position-ids", action="store_true")
    data.add_argument("--reset-attention-mask", action="store_true")

    run = parser.add_argument_group("evaluation, checkpoints and logging")
    run.add_argument("--eval-interval", type=int, default=50, help="evaluate every N steps")
    run.add_argument("--eval-iters", type=int, default=5, help="validation batches per eval")
    run.add_argument("--eval-at-start", action="store_true",
                     help="also evaluate once before the first step (the curve's starting point)")
    run.add_argument("--save", default=None, help="checkpoint directory to write")
    run.add_argument("--save-interval", type=int, default=None, help="save every N steps")
    run.add_argument("--load", default=None, help="checkpoint directory to resume from")
    run.add_argument("--log-interval", type=int, default=10, help="print a log line every N steps")
    run.add_argument("--metrics-file", default=None, help="append one JSON object per iteration")
    run.add_argument("--no-progress-bar", action="store_true")
    run.add_argument("--no-layout-table", action="store_true",
                     help="do not print the rank layout at start-up")

    dist = parser.add_argument_group("distributed")
    dist.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                      help="default: nccl when CUDA is available, else gloo")
    dist.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                      help="a collective waiting longer than this fails the job")
    add_precision_and_ddp_arguments(parser)


def build_parser(prog: str = "tpfuse.pretrain_gpt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Pretrain a GPT with tpfuse.")
    add_config_arguments(parser)
    add_training_arguments(parser)
    return parser


def validate_training_args(args) -> None:
    """Errors naming the flag, raised on every rank before any collective."""
    positive = ["micro_batch_size", "train_iters", "log_interval", "eval_iters"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    if args.eval_interval is not None and args.eval_interval < 1:
        raise ValueError(f"--eval-interval must be >= 1, got {args.eval_interval}")
    if args.save_interval is not None:
        if args.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {args.save_interval}")
        if not args.save:
            raise ValueError("--save-interval needs --save DIR")
    decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters > decay_iters:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must not exceed the decay "
                         f"span --lr-decay-iters / --train-iters ({decay_iters})")
    if args.reset_attention_mask:
        raise ValueError("--reset-attention-mask is not supported: tpfuse's attention is causal over "
                         "the whole sample (flash attention takes no arbitrary mask)")
    if args.mock_data and args.data_path:
        raise ValueError("give either --mock-data or --data-path, not both")
    if not args.mock_data and not args.data_path:
        raise ValueError("no data: give --data-path PREFIX (see tpfuse-preprocess) or --mock-data")
    validate_precision_and_ddp_args(args)


def parse_args(argv=None, defaults: dict | None = None):
    parser = build_parser()
    if defaults:
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    validate_training_args(args)
    config = config_from_args(args)
    return config, args
