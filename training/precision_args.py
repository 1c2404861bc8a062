"""Flags of mixed precision, loss scaling, data-parallel gradient reduction and the distributed
optimizer (Megatron's names and defaults; ``--skip-nonfinite`` is tpfuse's).

``--bf16`` / ``--fp16`` themselves are model-config flags (``TransformerConfig.bf16/fp16``).
Gradient dtype, as Megatron: bf16 accumulates and reduces gradients in fp32 unless
``--grad-reduce-in-bf16``; fp16 does so only with ``--accumulate-allreduce-grads-in-fp32``.
"""
from __future__ import annotations

import argparse

import torch

from .data_parallel import DistributedDataParallelConfig


def add_precision_and_ddp_arguments(parser: argparse.ArgumentParser) -> None:
    prec = parser.add_argument_group("mixed precision and loss scaling")
    prec.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                      help="accumulate and reduce gradients in fp32 (always on for --bf16 unless "
                           "--grad-reduce-in-bf16)")
    prec.add_argument("--grad-reduce-in-bf16", action="store_true",
                      help="with --bf16: keep gradient buffers and their reduction in bf16")
    prec.add_argument("--loss-scale", type=float, default=None,
                      help="static loss scale (default: dynamic scaling with --fp16, none else)")
    prec.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                      help="first dynamic loss scale")
    prec.add_argument("--min-loss-scale", type=float, default=1.0,
                      help="the dynamic loss scale never falls below this")
    prec.add_argument("--loss-scale-window", type=int, default=1000,
                      help="clean steps after which the dynamic loss scale doubles")
    prec.add_argument("--hysteresis", type=int, default=2,
                      help="overflows tolerated before the dynamic loss scale halves")
    prec.add_argument("--skip-nonfinite", action="store_true",
                      help="skip (and count) a step whose loss or gradient norm is inf/nan instead "
                           "of stopping with an error (bf16/fp32; fp16 always skips overflows)")

    ddp = parser.add_argument_group("data-parallel gradients and distributed optimizer")
    ddp.add_argument("--use-distributed-optimizer", action="store_true",
                     help="shard fp32 main parameters and Adam state over the data-parallel group "
                          "(ZeRO-1): reduce-scatter gradients, all-gather parameters")
    ddp.add_argument("--overlap-grad-reduce", action="store_true",
                     help="reduce each gradient bucket as soon as backward has produced it")
    ddp.add_argument("--overlap-param-gather", action="store_true",
                     help="all-gather updated parameters during the next forward "
                          "(needs --use-distributed-optimizer)")
    ddp.add_argument("--ddp-bucket-size", type=int, default=None,
                     help="elements per gradient bucket (default max(40M, 1M x dp))")


def validate_precision_and_ddp_args(args) -> None:
    """ValueErrors naming the flag, raised on every rank before any collective."""
    if args.grad_reduce_in_bf16 and not getattr(args, "bf16", False):
        raise ValueError("--grad-reduce-in-bf16 needs --bf16")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ValueError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 "
                         "contradict each other; give one")
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise ValueError(f"--loss-scale must be > 0, got {args.loss_scale}")
    if not args.initial_loss_scale > 0:
        raise ValueError(f"--initial-loss-scale must be > 0, got {args.initial_loss_scale}")
    if not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale "
                         f"{args.initial_loss_scale}], got {args.min_loss_scale}")
    for flag in ("loss_scale_window", "hysteresis"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ValueError(f"--ddp-bucket-size must be >= 1 elements, got {args.ddp_bucket_size}")


def grad_reduce_in_fp32(args, config) -> bool:
    """fp32 gradient buffers? (fp32 parameters have fp32 gradients either way.)"""
    if config.params_dtype == torch.bfloat16:
        return not args.grad_reduce_in_bf16
    return bool(args.accumulate_allreduce_grads_in_fp32) or config.params_dtype == torch.float32


def ddp_config_from_args(args, config) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32(args, config),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size)
