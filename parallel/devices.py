"""The device a collective's tensors must live on, derived from the process group's backend.

NCCL reduces, gathers and broadcasts CUDA tensors only (a CPU tensor fails with "No backend type
associated with device type cpu"); gloo takes CPU tensors. Every flag, statistic or timer row the
trainer builds for a collective is created on ``collective_device(group)``, so the same code runs
under NCCL on GPUs and gloo on a laptop. (Tensors already on the model's device — losses,
gradients — need nothing: under NCCL the model lives on the current CUDA device too.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The current CUDA device when ``group``'s backend (default: the world's) includes NCCL,
    else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
