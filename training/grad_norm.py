"""The global gradient norm, every parameter element counted exactly once, with one device→host
synchronisation per step.

    ‖g‖² = Σ_dense  + Σ_expert        over the whole model

Megatron sums dense squares over the tp × pp group and expert squares over the etp × ep × pp group
(data-parallel replicas hold identical reduced gradients and are left out). Here each rank sums the
squares of the gradients it *counts*, and one all-reduce over the world adds them up, which is the
same sum when a rank counts:

- a dense parameter only on data(+context)-parallel rank 0 (an expert one on expert-data rank 0),
  unless the distributed optimizer owns disjoint shards (then every rank counts its own shard;
  with hybrid sharding, ``--num-distributed-optimizer-instances`` > 1, only in the first
  instance: the others hold copies of the same shards);
- a parameter replicated over the tensor-parallel group (``tensor_model_parallel`` False: norm
  weights, row-parallel biases) only on TP rank 0 (expert: expert-TP rank 0);
- never the last stage's copy of the tied word embedding (``shared_embedding``).

The reduced vector also carries a non-finite-loss flag, so one ``tolist()`` tells every rank the
norm and whether anything in the step was inf/nan: an inf or nan anywhere makes the norm non-finite.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .data_parallel import is_expert


def counted_on_this_rank(param, state, sharded: bool) -> bool:
    """Does this rank count ``param``'s gradient (or, ``sharded``, its own shard of it)?"""
    if getattr(param, "shared_embedding", False):
        return False
    expert = is_expert(param)
    if not sharded and (state.rank_in("edp" if expert else "dp-cp") or 0) != 0:
        return False
    if sharded and (state.rank_in("inter-edp" if expert else "inter-dp-cp") or 0) != 0:
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (state.rank_in("etp" if expert else "tp") or 0) == 0


def _sum_of_squares(grads: list, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads)                    # fp32, one per tensor
    return torch.stack(norms).double().square().sum()


def global_norm_stats(dense: list, expert: list, loss_nonfinite, device) -> tuple:
    """(dense ‖g‖², expert ‖g‖², any loss non-finite) over the world, from this rank's counted
    fp32 gradients; ``loss_nonfinite`` a 0-dim tensor (1 = non-finite) or None."""
    flag = torch.zeros((), dtype=torch.float64, device=device)
    if loss_nonfinite is not None:
        flag = loss_nonfinite.to(device=device, dtype=torch.float64).reshape(())
    stats = torch.stack([_sum_of_squares(dense, device), _sum_of_squares(expert, device), flag])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    dense_sq, expert_sq, bad_loss = stats.tolist()        # the one device → host sync
    return dense_sq, expert_sq, bad_loss > 0


def norm_from_squares(dense_sq: float, expert_sq: float) -> float:
    """sqrt of the sum (inf and nan pass through)."""
    return math.sqrt(dense_sq + expert_sq)
