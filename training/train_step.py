"""The optimizer side of a training step: building the gradient buffers and the optimizer from the
settings, scaling the loss, and what happens to a step whose loss or gradients are inf/nan.

    buffers.zero_grad_buffer(); buffers.begin_step(m)
    forward_backward(loss_scaled(forward_step, optimizer), ...)    # loss · scale / m backward
    buffers.finish_grad_sync()                                     # DP reduce (bucketed)
    tied-embedding gradient sum                                    # first ↔ last stage
    result = optimizer.step(loss_nonfinite(loss_dicts))            # unscale, norm, clip, AdamW
    policy.after_step(iteration, result)                           # skip / stop on inf, nan

Non-finite steps: with a loss scaler (fp16, or ``--loss-scale``) an overflow is expected and the
step is skipped (the scale backs off); otherwise (bf16/fp32) training stops with a
FloatingPointError naming the iteration, unless ``--skip-nonfinite`` asks to skip and count such
steps; ``--max-consecutive-skipped-steps N`` (default 100) stops training with an error once N
steps in a row were skipped (a loss scale that always overflows, a run that diverged). Every
rank reaches the same decision (the norm and the loss flag are all-reduced over the
world), so no rank goes on alone into a collective. A skipped step changes no parameter, moment or
lr, so nothing non-finite can reach a checkpoint.
"""
from __future__ import annotations

import math

import torch

from .data_parallel import DataParallelBuffers
from .fsdp import FsdpConfig, FullyShardedModel
from .fsdp_optimizer import FullyShardedOptimizer
from .grad_scaler import build_grad_scaler
from .memory import peak_allocated_mib
from .muon import MuonConfig
from .optimizer import MixedPrecisionOptimizer
from .precision_args import ddp_config_from_settings


def build_buffers_and_optimizer(model_chunks, config, state, *, optimizer, precision,
                                data_parallel, lr: float):
    """(DataParallelBuffers, MixedPrecisionOptimizer) for ``model_chunks``: the buffers from
    ``precision`` and ``data_parallel`` (PrecisionSettings, DataParallelSettings), the optimizer
    (``--optimizer`` adam / sgd / muon) from ``optimizer`` (OptimizerSettings) starting at ``lr`` (``--lr``; the scheduler sets it each
    step). With ``--use-torch-fsdp2`` (``data_parallel.use_torch_fsdp2``) the chunks are
    sharded in place by ``FullyShardedModel`` and the optimizer steps on FSDP's shards."""
    scaler = build_grad_scaler(config.fp16, precision.loss_scale, precision.initial_loss_scale,
                               precision.min_loss_scale, precision.loss_scale_window,
                               precision.hysteresis)
    adam_settings = dict(lr=lr, weight_decay=optimizer.weight_decay,
                         betas=(optimizer.adam_beta1, optimizer.adam_beta2),
                         eps=optimizer.adam_eps, clip_grad=optimizer.clip_grad,
                         grad_scaler=scaler, optimizer=optimizer.optimizer,
                         sgd_momentum=optimizer.sgd_momentum,
                         muon=MuonConfig.from_settings(optimizer))
    if data_parallel.use_torch_fsdp2:
        fsdp = FullyShardedModel(model_chunks, FsdpConfig(
            data_parallel.fsdp_strategy, config.params_dtype,
            deferred_weight_grads=config.pipeline_schedule == "zb-h1"), state)
        return fsdp, FullyShardedOptimizer(model_chunks, fsdp, state, **adam_settings)
    buffers = DataParallelBuffers(model_chunks,
                                  ddp_config_from_settings(precision, data_parallel, config), state)
    adam = MixedPrecisionOptimizer(model_chunks, buffers, state, **adam_settings)
    return buffers, adam


def loss_scaled(forward_step, optimizer):
    """``forward_step`` whose loss function returns the loss times the current loss scale (its
    logged values untouched); ``forward_step`` itself when there is no scaler."""
    if optimizer.grad_scaler is None:
        return forward_step

    def scaled_forward_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        scale = optimizer.loss_scale
        _set_aux_loss_grad_scale(model, scale)

        def scaled_loss_func(output_tensor):
            loss, logs = loss_func(output_tensor)
            return loss * scale, logs
        return output, scaled_loss_func
    return scaled_forward_step


def _set_aux_loss_grad_scale(chunk, scale) -> None:
    """Router (auxiliary) losses injected in backward take the loss scale too (MoE models)."""
    while not hasattr(chunk, "set_aux_loss_grad_scale") and hasattr(chunk, "module"):
        chunk = chunk.module
    if hasattr(chunk, "set_aux_loss_grad_scale"):
        chunk.set_aux_loss_grad_scale(float(scale))


def loss_nonfinite(loss_dicts, device, key: str = "lm loss"):
    """A 0-dim tensor, 1 when any micro-batch loss of this rank is inf/nan (no host sync); None on
    ranks without losses."""
    if not loss_dicts:
        return None
    values = torch.stack([d[key].detach().float().reshape(()) for d in loss_dicts])
    return (~torch.isfinite(values.sum())).to(device=device, dtype=torch.float32)


class NonFinitePolicy:
    """Skip or stop on a step the optimizer refused (see the module docstring)."""

    def __init__(self, has_scaler: bool, skip_nonfinite: bool,
                 max_consecutive_skipped: int | None = None):
        self.has_scaler, self.skip_nonfinite = has_scaler, skip_nonfinite
        self.max_consecutive_skipped = max_consecutive_skipped
        self.skipped_iterations, self.consecutive_skipped = 0, 0

    def after_step(self, iteration: int, result, optimizer, device) -> dict:
        """The step's log fields (grad norm, skipped, loss scale, CUDA peak memory); raises when
        a refused step may not be skipped."""
        if not result.success:
            if not (self.has_scaler or self.skip_nonfinite):
                what = "loss" if result.loss_nonfinite else "global gradient norm"
                value = "inf/nan" if result.loss_nonfinite else result.grad_norm
                raise FloatingPointError(
                    f"iteration {iteration}: the {what} is {value}; training stops (nothing of "
                    f"this step is applied or saved). Pass --skip-nonfinite to skip such steps "
                    f"instead.")
            self.skipped_iterations += 1
        self.consecutive_skipped = self.consecutive_skipped + 1 if not result.success else 0
        if self.max_consecutive_skipped and self.consecutive_skipped >= \
                self.max_consecutive_skipped:
            raise FloatingPointError(
                f"iteration {iteration}: {self.consecutive_skipped} steps in a row were skipped "
                f"(inf/nan loss or gradients); training stops (--max-consecutive-skipped-steps "
                f"{self.max_consecutive_skipped})")
        fields = {"grad_norm": result.grad_norm if math.isfinite(result.grad_norm) else None,
                  "skipped": not result.success, "skipped_iterations": self.skipped_iterations}
        if optimizer.grad_scaler is not None:
            fields["loss_scale"] = optimizer.loss_scale
        peak = peak_allocated_mib(device)
        if peak is not None:
            fields["peak_memory_mib"] = peak
        return fields
