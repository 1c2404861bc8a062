"""Two devices, chosen apart: the one a collective's own tensors are made on, derived from the
process group's backend, and the one the model lives on, an explicit choice.

``collective_device(group)``: NCCL reduces, gathers and broadcasts CUDA tensors only (a CPU tensor
fails with "No backend type associated with device type cpu"); gloo takes CPU tensors. Every
flag, statistic or timer row the trainer builds for a collective alone is created there, so the
same code runs under NCCL on GPUs and gloo on a laptop.

``model_device(requested)``: where the model, its activations, gradients and optimizer state live
(the trainer's ``--device``). By default the backend's device (NCCL: the current CUDA device,
gloo: the CPU), so nothing changes unless asked. ``"cuda"`` under gloo puts every rank's model on
its current CUDA device — several ranks may share one GPU, which NCCL refuses — and the world is
then joined with ``host_staging.HOST_STAGED`` (``world_backend``), whose groups stage each
collective of a CUDA tensor through host memory. ``check_device_choice`` refuses the
combinations that cannot run, before any process group exists.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .host_staging import backend_family, is_host_staged

DEVICE_CHOICES = ("cpu", "cuda")


def collective_device(group=None) -> torch.device:
    """The current CUDA device when ``group``'s backend (default: the world's) includes NCCL,
    else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device_choice(requested: str | None, backend: str) -> None:
    """ValueError, naming the settings, for a ``--device`` that ``backend`` (a
    ``--distributed-backend`` value) cannot serve; raised before the world is joined."""
    if requested is None:
        return
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {requested!r}")
    if requested == "cpu" and backend == "nccl":
        raise ValueError("--device cpu cannot run on --distributed-backend nccl (NCCL takes "
                         "CUDA tensors only); use --distributed-backend gloo")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs CUDA, which is not available here")


def model_device(requested: str | None = None) -> torch.device:
    """The model's device in the joined world (see the module docstring); ``requested``: None,
    "cpu" or "cuda"."""
    backend = str(dist.get_backend())
    if requested is None:
        return collective_device()
    check_device_choice(requested, "nccl" if "nccl" in backend.lower() else "gloo")
    if requested == "cpu":
        return torch.device("cpu")
    if backend_family(backend) == "gloo" and not is_host_staged(backend):
        raise ValueError(f"--device cuda on a {backend!r} world: gloo's send / recv read host "
                         "memory only; join the world through "
                         "runtime.initialize.initialize_distributed(..., device='cuda'), which "
                         "uses the host-staged gloo backend")
    return torch.device("cuda", torch.cuda.current_device())


def cuda_index_for(local_rank: int) -> int:
    """The CUDA device of local rank ``local_rank``: one each while there are enough, shared
    round-robin beyond (two ranks of a gloo job on a one-GPU machine both get device 0)."""
    return local_rank % torch.cuda.device_count()
