"""megatron-core 0.16's ``OptimizerConfig`` (and ``AdamOptimizerConfig``): every field with
Megatron's name and default; ``_fields`` marks what tpfuse's optimizer
(``tpfuse.training.optimizer.MixedPrecisionOptimizer``: AdamW on fp32 main parameters, global
norm clipping, loss scaling) uses, accepts, or refuses unless default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .._fields import _free, _only, _used, check_default_only


@dataclass
class OptimizerConfig:
    lr: Optional[float] = _used(None)
    min_lr: Optional[float] = _free(None)
    decoupled_lr: Optional[float] = _only(None)
    decoupled_min_lr: Optional[float] = _only(None)
    weight_decay: float = _used(0.01)
    apply_wd_to_qk_layernorm: bool = _free(False)
    fp8_recipe: Optional[str] = _only(None)
    fp16: bool = _used(False)
    bf16: bool = _used(False)
    reuse_grad_buf_for_mxfp8_param_ag: bool = _only(False)
    params_dtype: torch.dtype = _free(torch.float32)
    use_precision_aware_optimizer: bool = _only(False)
    store_param_remainders: bool = _free(True)
    main_grads_dtype: torch.dtype = _only(torch.float32)
    main_params_dtype: torch.dtype = _only(torch.float32)
    exp_avg_dtype: torch.dtype = _only(torch.float32)
    exp_avg_sq_dtype: torch.dtype = _only(torch.float32)
    optimizer: str = _only('adam')
    loss_scale: Optional[float] = _used(None)
    initial_loss_scale: float = _used(2 ** 32)
    min_loss_scale: float = _used(1.0)
    loss_scale_window: float = _used(1000)
    hysteresis: int = _used(2)
    adam_beta1: float = _used(0.9)
    adam_beta2: float = _used(0.999)
    adam_eps: float = _used(1e-08)
    decoupled_weight_decay: bool = _only(True)
    sgd_momentum: float = _free(0.9)
    muon_momentum: float = _free(0.95)
    muon_split_qkv: bool = _free(True)
    muon_use_nesterov: bool = _free(False)
    muon_scale_mode: str = _free("spectral")
    muon_fp32_matmul_prec: str = _free("medium")
    muon_num_ns_steps: int = _free(5)
    muon_tp_mode: str = _free("blockwise")
    muon_extra_scale_factor: float = _free(1.0)
    use_distributed_optimizer: bool = _used(False)
    overlap_param_gather: bool = _free(False)
    overlap_param_gather_with_optimizer_step: bool = _only(False)
    optimizer_cpu_offload: bool = _only(False)
    optimizer_offload_fraction: float = _free(0.0)
    use_torch_optimizer_for_cpu_offload: bool = _only(False)
    overlap_cpu_optimizer_d2h_h2d: bool = _only(False)
    pin_cpu_grads: bool = _free(True)
    pin_cpu_params: bool = _free(True)
    clip_grad: float = _used(1.0)
    log_num_zeros_in_grad: bool = _only(False)
    timers: Optional[Callable] = _free(None)
    config_logger_dir: str = _only("")

    def __post_init__(self):
        check_default_only(self)
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16=True and bf16=True are mutually exclusive")


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    optimizer: str = _only('adam')


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    optimizer: str = _only('sgd')

    def __post_init__(self):
        raise ValueError("SGDOptimizerConfig: tpfuse's optimizer is Adam(W) only")
