"""Settings of mixed precision, loss scaling, data-parallel gradient reduction and the distributed
optimizer (Megatron's flags and defaults; ``--skip-nonfinite`` is tpfuse's).

``--bf16`` / ``--fp16`` themselves are model-config flags (``TransformerConfig.bf16/fp16``).
Gradient dtype, as Megatron: bf16 accumulates and reduces gradients in fp32 unless
``--grad-reduce-in-bf16``; fp16 does so only with ``--accumulate-allreduce-grads-in-fp32``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .data_parallel import DistributedDataParallelConfig
from .settings_fields import SettingsGroup, setting


@dataclass(frozen=True, kw_only=True)
class PrecisionSettings(SettingsGroup):
    """Loss scaling and the dtype of gradient accumulation."""
    TITLE = "mixed precision and loss scaling"

    accumulate_allreduce_grads_in_fp32: bool = setting(
        False, "accumulate and reduce gradients in fp32 (always on for --bf16 unless "
               "--grad-reduce-in-bf16)")
    grad_reduce_in_bf16: bool = setting(
        False, "with --bf16: keep gradient buffers and their reduction in bf16")
    loss_scale: float | None = setting(
        None, "static loss scale (default: dynamic scaling with --fp16, none else)")
    initial_loss_scale: float = setting(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = setting(1.0, "the dynamic loss scale never falls below this")
    loss_scale_window: int = setting(
        1000, "clean steps after which the dynamic loss scale doubles", minimum=1)
    hysteresis: int = setting(
        2, "overflows tolerated before the dynamic loss scale halves", minimum=1)
    skip_nonfinite: bool = setting(
        False, "skip (and count) a step whose loss or gradient norm is inf/nan instead of "
               "stopping with an error (bf16/fp32; fp16 always skips overflows)")
    max_consecutive_skipped_steps: int = setting(
        100, "stop with an error after this many skipped (inf/nan) steps in a row (an "
             "always-overflowing loss scale, a diverged run)", minimum=1, metavar="N")

    def check(self) -> None:
        if self.grad_reduce_in_bf16 and self.accumulate_allreduce_grads_in_fp32:
            raise ValueError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 "
                             "contradict each other; give one")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if not self.initial_loss_scale > 0:
            raise ValueError(f"--initial-loss-scale must be > 0, got {self.initial_loss_scale}")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale "
                             f"{self.initial_loss_scale}], got {self.min_loss_scale}")


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")


def fsdp_strategy(data_parallel) -> str:
    """What ``--use-torch-fsdp2`` shards by. Megatron's torch FSDP2 reads only
    ``--torch-fsdp2-no-reshard-after-forward``: re-shard after forward (ZeRO-3,
    ``optim_grads_params``) unless it is given (ZeRO-2, ``optim_grads``); the default strategy
    ``no_shard`` leaves that choice. ``optim_grads`` / ``optim_grads_params`` name it outright
    (Megatron-FSDP's meaning of the values; Megatron's torch FSDP2 ignores the flag)."""
    strategy = data_parallel.data_parallel_sharding_strategy
    if strategy in FSDP_STRATEGIES:
        return strategy
    return "optim_grads_params" if data_parallel.torch_fsdp2_reshard_after_forward \
        else "optim_grads"


def check_sharding_strategy(data_parallel) -> None:
    """``--use-torch-fsdp2`` excludes the ZeRO-1 path (Megatron's refusal) and takes a strategy
    FSDP can shard by, consistent with ``--torch-fsdp2-no-reshard-after-forward``."""
    strategy = data_parallel.data_parallel_sharding_strategy
    if not data_parallel.use_torch_fsdp2:
        if strategy not in ("no_shard", "optim"):
            raise ValueError(f"--data-parallel-sharding-strategy {strategy} needs "
                             "--use-torch-fsdp2 (tpfuse shards gradients and parameters with "
                             "PyTorch's fully_shard)")
        if strategy == "optim" and not data_parallel.use_distributed_optimizer:
            raise ValueError("--data-parallel-sharding-strategy optim is the distributed "
                             "optimizer: pass --use-distributed-optimizer")
        if not data_parallel.torch_fsdp2_reshard_after_forward:
            raise ValueError("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
        return
    if data_parallel.use_distributed_optimizer:
        raise ValueError("--use-torch-fsdp2 is not supported with --use-distributed-optimizer "
                         "(Megatron's refusal): FSDP shards the optimizer state itself (drop "
                         "--use-distributed-optimizer, or drop --use-torch-fsdp2 for ZeRO-1)")
    if strategy == "optim":
        raise ValueError("--use-torch-fsdp2 with --data-parallel-sharding-strategy optim: FSDP "
                         "shards gradients too (optim_grads, optim_grads_params, or no_shard "
                         "to leave it to --torch-fsdp2-no-reshard-after-forward); optim alone "
                         "is --use-distributed-optimizer without --use-torch-fsdp2")
    if strategy == "optim_grads_params" and not data_parallel.torch_fsdp2_reshard_after_forward:
        raise ValueError("--data-parallel-sharding-strategy optim_grads_params re-shards "
                         "parameters after forward, --torch-fsdp2-no-reshard-after-forward "
                         "keeps them: give one")
    for flag, given in (("--overlap-grad-reduce", data_parallel.overlap_grad_reduce),
                        ("--overlap-param-gather", data_parallel.overlap_param_gather),
                        ("--ddp-bucket-size", data_parallel.ddp_bucket_size is not None)):
        if given:
            raise ValueError(f"{flag} belongs to the bucketed data-parallel buffers; "
                             "--use-torch-fsdp2 reduces and gathers per FSDP unit (drop it)")


def check_instances_shard(data_parallel) -> None:
    """More than one distributed-optimizer instance needs something to shard inside each
    (Megatron's ``--num-distributed-optimizer-instances`` is the distributed optimizer's; tpfuse
    reads it for FSDP2's hybrid mesh too). That N divides the data-parallel sizes is checked
    with the layout, before any group (``check_distributed_optimizer_instances``)."""
    instances = data_parallel.num_distributed_optimizer_instances
    if instances > 1 and not (data_parallel.use_distributed_optimizer
                              or data_parallel.use_torch_fsdp2):
        raise ValueError(f"--num-distributed-optimizer-instances {instances} needs a sharded "
                         "mode to replicate: --use-distributed-optimizer or --use-torch-fsdp2 "
                         "(plain data parallelism already replicates everything)")


@dataclass(frozen=True, kw_only=True)
class DataParallelSettings(SettingsGroup):
    """How gradients are reduced over the data-parallel group and where optimizer state lives."""
    TITLE = "data-parallel gradients and distributed optimizer"

    use_distributed_optimizer: bool = setting(
        False, "shard fp32 main parameters and Adam state over the data-parallel group (ZeRO-1): "
               "reduce-scatter gradients, all-gather parameters")
    overlap_grad_reduce: bool = setting(
        False, "reduce each gradient bucket as soon as backward has produced it")
    overlap_param_gather: bool = setting(
        False, "all-gather updated parameters during the next forward "
               "(needs --use-distributed-optimizer)")
    ddp_bucket_size: int | None = setting(
        None, "elements per gradient bucket (default max(40M, 1M x dp))")
    use_torch_fsdp2: bool = setting(
        False, "shard the model over the data-parallel (dp x cp) group with PyTorch's "
               "fully_shard (FSDP2), one unit per transformer layer plus the embedding/output; "
               "parameters, gradients and optimizer state (ZeRO-3) unless "
               "--torch-fsdp2-no-reshard-after-forward")
    torch_fsdp2_reshard_after_forward: bool = setting(
        True, "with --use-torch-fsdp2: keep parameters gathered after forward (ZeRO-2: "
              "gradients and optimizer state sharded)",
        flag="--torch-fsdp2-no-reshard-after-forward")
    data_parallel_sharding_strategy: str = setting(
        "no_shard", "optim_grads (ZeRO-2) or optim_grads_params (ZeRO-3) with "
                    "--use-torch-fsdp2 (no_shard: as --torch-fsdp2-no-reshard-after-forward "
                    "says); without it no_shard is plain data parallelism, optim the "
                    "distributed optimizer",
        choices=SHARDING_STRATEGIES)
    num_distributed_optimizer_instances: int = setting(
        1, "hybrid sharding: cut the data-parallel (dp x cp) group into this many replicas, "
           "each sharding optimizer state (--use-distributed-optimizer) or the model "
           "(--use-torch-fsdp2, a (replicate, shard) mesh) over its own ranks; gradients are "
           "reduce-scattered inside a replica and all-reduced across replicas",
        minimum=1, metavar="N")

    @property
    def fsdp_strategy(self) -> str:
        """The strategy ``--use-torch-fsdp2`` shards by (``fsdp_strategy``)."""
        return fsdp_strategy(self)

    def check(self) -> None:
        check_sharding_strategy(self)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        check_instances_shard(self)
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 elements, got "
                             f"{self.ddp_bucket_size}")


def check_model_precision(precision: PrecisionSettings, bf16: bool) -> None:
    """The precision settings against the model's dtype flag (``--bf16``)."""
    if precision.grad_reduce_in_bf16 and not bf16:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16")


def grad_reduce_in_fp32(precision: PrecisionSettings, config) -> bool:
    """fp32 gradient buffers? (fp32 parameters have fp32 gradients either way.)"""
    if config.params_dtype == torch.bfloat16:
        return not precision.grad_reduce_in_bf16
    return bool(precision.accumulate_allreduce_grads_in_fp32) or \
        config.params_dtype == torch.float32


def ddp_config_from_settings(precision: PrecisionSettings, data_parallel: DataParallelSettings,
                             config) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32(precision, config),
        overlap_grad_reduce=data_parallel.overlap_grad_reduce,
        overlap_param_gather=data_parallel.overlap_param_gather,
        use_distributed_optimizer=data_parallel.use_distributed_optimizer,
        bucket_size=data_parallel.ddp_bucket_size)
