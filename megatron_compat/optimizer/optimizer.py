"""megatron-core 0.16's optimizer classes over tpfuse's ``MixedPrecisionOptimizer``.

``step()`` returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``: on a
step skipped for inf/nan gradients (fp16 overflow) ``(False, None, None)``, else
``(True, global grad norm before clipping, None)`` (counting zeros is not implemented:
``log_num_zeros_in_grad`` is refused by the config). The param groups carry Megatron's
``wd_mult`` / ``lr_mult`` (no weight decay for biases and 1-D parameters), which
``OptimizerParamScheduler`` reads.
"""
from __future__ import annotations

import torch

from . import sharded_state


class MegatronOptimizer:
    # how sharded_state_dict nests the state (Megatron's per-class layouts: sharded_state.py)
    sharded_nesting = sharded_state.MAIN_COPY_NESTING

    def __init__(self, native, config, model_chunks):
        self.native, self.config, self.model_chunks = native, config, model_chunks
        decay_group, no_decay_group = native.param_groups
        decay_group.update(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False,
                           is_decoupled_lr=False, max_lr=config.lr, min_lr=config.min_lr or 0.0)
        no_decay_group.update(wd_mult=0.0, lr_mult=1.0, is_expert_parallel=False,
                              is_decoupled_lr=False, max_lr=config.lr,
                              min_lr=config.min_lr or 0.0)

    @property
    def param_groups(self):
        return self.native.param_groups

    @property
    def optimizer(self):
        """The torch optimizer doing the update (AdamW over the fp32 main pieces)."""
        return self.native.adam

    def get_parameters(self):
        return list(self.native.model_params)

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor([self.native.loss_scale], dtype=torch.float32)

    def scale_loss(self, loss):
        return loss * self.native.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The main gradients are the DDP buffers (``zero_grad_buffer``); stray ``.grad``s of
        the model parameters are dropped."""
        for param in self.native.model_params:
            param.grad = None

    @torch.no_grad()
    def step(self):
        result = self.native.step()
        if not result.success:
            return False, None, None
        return True, result.grad_norm, None

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model parameters (after loading weights)."""
        for piece in self.native.pieces:
            if piece.separate_main:
                piece.main.copy_(piece.model_view().float())

    def state_dict(self):
        return self.native.state_dict()

    def load_state_dict(self, state_dict) -> None:
        if sharded_state.is_sharded_format(state_dict):      # what dist_checkpointing loaded
            return sharded_state.load_sharded_optimizer_state(self, state_dict)
        self.native.load_state_dict(state_dict)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        return sharded_state.optimizer_sharded_state_dict(self, model_sharded_state_dict,
                                                          is_loading, **kwargs)


class FP32Optimizer(MegatronOptimizer):
    """fp32 parameters, no separate main copy."""

    sharded_nesting = sharded_state.TORCH_NESTING


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16 / fp16 parameters with fp32 main copies (fp16: loss scaling)."""


class DistributedOptimizer(MegatronOptimizer):
    """Main parameters and Adam moments for this rank's 1/dp shard of every bucket."""

    sharded_nesting = sharded_state.DISTRIBUTED_NESTING
