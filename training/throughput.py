"""Achieved TFLOP/s per rank and MFU of one training iteration, for ``--log-throughput``.

The FLOP count is ``tpfuse.models.flops`` (its docstring states the formula); the plain-PyTorch
peer of the GPU session counts with the same functions, so the two MFUs compare.
"""
from __future__ import annotations

from tpfuse.models.flops import flops_per_iteration, forward_flops_per_token, utilisation

__all__ = ["flops_per_iteration", "forward_flops_per_token", "throughput"]


def throughput(config, global_batch_size: int, seconds: float, world_size: int,
               peak_tflops: float | None = None) -> dict:
    """``{"tflops_per_rank": ..., "mfu": ... (only with a peak)}`` for one iteration."""
    return utilisation(flops_per_iteration(config, global_batch_size), seconds, world_size,
                       peak_tflops)
