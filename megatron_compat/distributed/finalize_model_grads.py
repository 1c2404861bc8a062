"""megatron-core 0.16's ``finalize_model_grads(model, num_tokens=None, pg_collection=None,
force_all_reduce=False)``: after the backward passes of a step, before the optimizer.

    1. every chunk's ``finish_grad_sync()``: the data-parallel reduction of ``main_grad``
    2. tensor-parallel replicated weights (norms, row-parallel biases under sequence
       parallelism): tpfuse's layers already all-reduce their gradients over tp in backward
       (``tp_layers/norm.py``, ``linear.py``), so nothing is left to do here
    3. the tied word embedding: first + last pipeline stage's gradients summed over the
       embedding group (``tpfuse.models.gpt.allreduce_embedding_grads``)
    4. with ``num_tokens`` (per-token loss): the token count summed over the pipeline's last
       stage and the data-parallel group, every gradient scaled by 1 / that count
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.models.gpt import allreduce_embedding_grads
from tpfuse.parallel.state import resolve_state_or_none

from .distributed_data_parallel import native_chunk


def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    if pg_collection is not None:
        raise ValueError("pg_collection is not supported: tpfuse uses parallel_state's groups")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not hasattr(chunk, "finish_grad_sync"):
            raise ValueError(f"finalize_model_grads needs DistributedDataParallel chunks, got "
                             f"{type(chunk).__name__} (wrap the model in "
                             "distributed.DistributedDataParallel)")
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    state = resolve_state_or_none()
    allreduce_embedding_grads([native_chunk(c) for c in chunks], state)
    if num_tokens is not None:
        _scale_by_token_count(chunks, num_tokens, state)


def _scale_by_token_count(chunks, num_tokens, state) -> None:
    """Megatron: broadcast the last stage's count over the pipeline, sum over dp, scale."""
    count = num_tokens.detach().clone().to(torch.float32)
    if state is not None and state.pp_size > 1:
        last = dist.get_global_rank(state.pp_group, state.pp_size - 1)
        dist.broadcast(count, src=last, group=state.pp_group)
    if state is not None and state.size("dp-cp") > 1:
        dist.all_reduce(count, group=state.dp_cp_group)
    factor = 1.0 / max(count.item(), 1.0)
    for chunk in chunks:
        chunk.scale_gradients(factor)
