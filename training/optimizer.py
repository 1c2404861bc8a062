"""AdamW over a rank's model chunks, and gradient clipping by the global norm across every group.

Parameter groups follow Megatron: biases and 1-D parameters (norm weights) get no weight decay.

Global gradient norm, counted once per distinct parameter element::

    ‖g‖² = Σ_pp Σ_tp  Σ_{p on this rank, counted}  ‖g_p‖²

A parameter is counted on a rank if it is sharded over TP (``tensor_model_parallel``), or, when
replicated across the TP group, only on TP rank 0; the last stage's copy of the tied embedding
(``shared_embedding``) is skipped. The sum is all-reduced over the model-parallel (tp × pp) group;
data-parallel replicas already hold identical (all-reduced) gradients, so DP adds nothing.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def parameter_groups(model_chunks, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model_chunks, lr: float, weight_decay: float = 0.01,
                    betas=(0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameter_groups(model_chunks, weight_decay), lr=lr, betas=betas,
                             eps=eps, weight_decay=weight_decay)


def _counted_on_this_rank(param, tp_rank: int) -> bool:
    if getattr(param, "shared_embedding", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def global_grad_norm(params, state) -> float:
    """The L2 norm of the whole model's gradient (every layout gives the same number)."""
    squares = torch.zeros(1, dtype=torch.float64)
    for param in params:
        if param.grad is not None and _counted_on_this_rank(param, state.tp_rank):
            squares += param.grad.detach().double().pow(2).sum().cpu()
    group = state.group("tp-pp")
    if dist.get_world_size(group) > 1:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        squares = squares.to(device)
        dist.all_reduce(squares, group=group)
    return math.sqrt(squares.item())


def clip_grad_norm(params, max_norm: float, state) -> float:
    """Scale gradients so their global norm is at most ``max_norm`` (0 = no clipping).

    Returns the norm before clipping; raises when it is not finite (a silent NaN step would
    corrupt every later iteration).
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, state)
    if not math.isfinite(norm):
        raise FloatingPointError(f"the global gradient norm is {norm}: the loss diverged")
    if max_norm > 0:
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            for param in params:
                param.grad.mul_(coeff)
    return norm
