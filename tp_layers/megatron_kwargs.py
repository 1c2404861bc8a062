"""Megatron's keyword forms on the native TP layers: ``config=``, ``is_expert=``, ``tp_group=``.

``config`` (a Megatron-style ``ModelParallelConfig`` / ``TransformerConfig``, or tpfuse's
``TransformerConfig``) supplies ``sequence_parallel`` and ``params_dtype`` unless they are given
explicitly (a disagreement is a ValueError); Megatron's ``perform_initialization=False`` leaves the
weights zero without drawing from the generator. ``sequence_parallel`` at tp = 1 is switched off,
as Megatron does.

``is_expert=True`` (Megatron's MoE expert layers): the layer is sharded over the expert
tensor-parallel group, and when experts communicate outside the layer (etp > 1 or ep > 1,
Megatron's ``explicit_expert_comm``) the forward does no tensor-parallel collective of its own;
with ep > 1 the parameters carry ``allreduce = False`` (reduced over the expert data-parallel
group).
"""
from __future__ import annotations

import warnings

import torch

from tpfuse.parallel.state import resolve_state_or_none

from ._group import TPGroup


def layer_settings(config, sequence_parallel, params_dtype, tp_size: int):
    """(sequence_parallel, params_dtype, perform_initialization) from the keywords and config."""
    if config is not None:
        for name, given in (("sequence_parallel", sequence_parallel),
                            ("params_dtype", params_dtype)):
            value = getattr(config, name, None)
            if given is not None and value is not None and given != value:
                raise ValueError(f"{name}={given!r} disagrees with config.{name}={value!r}")
        if sequence_parallel is None:
            sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if params_dtype is None:
            params_dtype = getattr(config, "params_dtype", None)
    sequence_parallel = bool(sequence_parallel)
    if sequence_parallel and tp_size == 1 and config is not None:
        warnings.warn("sequence_parallel=True with a tensor-parallel size of 1: disabled, as "
                      "Megatron does")
        sequence_parallel = False
    initialize = bool(getattr(config, "perform_initialization", True))
    return sequence_parallel, params_dtype or torch.float32, initialize


def expert_parallel(config, state, is_expert: bool) -> bool:
    """Megatron's ``is_expert and expert_parallel``: an expert layer with more than one
    expert-parallel rank (from the config, else the state)."""
    if not is_expert:
        return False
    size = getattr(config, "expert_model_parallel_size", None)
    if size is None:
        state = resolve_state_or_none(state)
        size = state.ep_size if state is not None else 1
    return size > 1


def communication_group(tp: TPGroup, is_expert: bool, expert_parallel_: bool) -> TPGroup:
    """The group the forward communicates over: a size-1 view for experts whose communication
    happens outside the layer (Megatron's ``explicit_expert_comm``)."""
    if is_expert and (tp.size > 1 or expert_parallel_):
        return TPGroup(None, 1, 0)
    return tp


def mark_allreduce(params, is_expert: bool, expert_parallel_: bool) -> None:
    """Megatron's ``param.allreduce``: False for expert parameters with ep > 1."""
    for param in params:
        if param is not None:
            param.allreduce = not (is_expert and expert_parallel_)
