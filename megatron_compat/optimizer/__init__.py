"""megatron-core 0.16's ``optimizer``: ``OptimizerConfig``, ``get_megatron_optimizer`` over
tpfuse's mixed-precision AdamW (``tpfuse.training.optimizer``).

``get_megatron_optimizer(config, model_chunks)``: the chunks are ``DistributedDataParallel``
modules (their gradient buffers hold ``main_grad``; with a virtual pipeline one per model
chunk, each with its own buffers, and one optimizer over all of them:
``chunk_buffers.ChunkBuffers``); the optimizer is Adam with decoupled weight decay (AdamW),
``clip_grad`` global-norm clipping, a dynamic loss scaler for fp16 (or a constant
``loss_scale``), and with ``use_distributed_optimizer`` (which must match the DDP
config's) main parameters and moments sharded over the data-parallel group.
"""
from __future__ import annotations

from tpfuse.training.grad_scaler import build_grad_scaler
from tpfuse.training.optimizer import MixedPrecisionOptimizer

from .chunk_buffers import ChunkBuffers
from .optimizer import (DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer,
                        MegatronOptimizer)
from .optimizer_config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig

__all__ = ["OptimizerConfig", "AdamOptimizerConfig", "SGDOptimizerConfig",
           "get_megatron_optimizer", "MegatronOptimizer", "FP32Optimizer",
           "Float16OptimizerWithFloat16Params", "DistributedOptimizer",
           "OptimizerParamScheduler"]


def __getattr__(name):
    if name == "OptimizerParamScheduler":
        from ..optimizer_param_scheduler import OptimizerParamScheduler
        return OptimizerParamScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ddp_chunks(model_chunks) -> list:
    """The DistributedDataParallel chunks (one per virtual pipeline stage, or one)."""
    from ..distributed import DistributedDataParallel

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("get_megatron_optimizer needs at least one model chunk")
    for chunk in chunks:
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError("get_megatron_optimizer needs every model chunk wrapped in "
                             "distributed.DistributedDataParallel (its buffers hold main_grad), "
                             f"got {type(chunk).__name__}")
    return chunks


def get_megatron_optimizer(config: OptimizerConfig, model_chunks, config_overrides=None,
                           use_gloo_process_groups: bool = True, pg_collection=None,
                           dump_param_to_param_group_map=None) -> MegatronOptimizer:
    for name, value in (("config_overrides", config_overrides), ("pg_collection", pg_collection),
                        ("dump_param_to_param_group_map", dump_param_to_param_group_map)):
        if value is not None:
            raise ValueError(f"get_megatron_optimizer({name}=...) is not supported by tpfuse")
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is required")
    ddps = _ddp_chunks(model_chunks)
    for ddp in ddps:
        if config.use_distributed_optimizer != ddp.ddp_config.use_distributed_optimizer:
            raise ValueError(f"OptimizerConfig.use_distributed_optimizer="
                             f"{config.use_distributed_optimizer} but the DistributedDataParallel"
                             f"Config has {ddp.ddp_config.use_distributed_optimizer}")
    from ..distributed.distributed_data_parallel import native_chunk

    scaler = build_grad_scaler(config.fp16, config.loss_scale, config.initial_loss_scale,
                               config.min_loss_scale, int(config.loss_scale_window),
                               config.hysteresis)
    buffers = ddps[0].native_buffers if len(ddps) == 1 else ChunkBuffers(ddps)
    native = MixedPrecisionOptimizer(
        [native_chunk(ddp.module) for ddp in ddps], buffers, ddps[0].state, lr=config.lr,
        weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps, clip_grad=config.clip_grad, grad_scaler=scaler)
    if config.use_distributed_optimizer:
        cls = DistributedOptimizer
    elif config.fp16 or config.bf16:
        cls = Float16OptimizerWithFloat16Params
    else:
        cls = FP32Optimizer
    return cls(native, config, ddps)
