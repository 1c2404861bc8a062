"""The multi-token prediction losses of a training step, for the log (Megatron's
``MTPLossLoggingHelper.track_mtp_metrics``).

The chunk holding the output layer (last pipeline stage) keeps, per MTP depth k, its loss summed
over the step's m micro-batches (``models/multi_token_prediction.py``; every TP rank holds the
same value). The last stage's ranks sum it over the data-parallel group, and::

    mtp_k loss = Σ_{micro-batches, dp} loss_k / (m · dp)

the mean the lm loss is logged as. A collective over the data-parallel group of the last pipeline
stage only (its ranks call it once per step); it clears the trackers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _mtp_block(chunk):
    while not hasattr(chunk, "mtp") and hasattr(chunk, "module"):
        chunk = chunk.module
    return getattr(chunk, "mtp", None)


def mtp_metric_names(config) -> tuple[str, ...]:
    """``("mtp_1 loss", ..., "mtp_D loss")`` (empty without MTP)."""
    return tuple(f"mtp_{k + 1} loss" for k in range(config.mtp_num_layers or 0))


def mtp_metrics(model_chunks, config, state, num_microbatches: int, device) -> dict:
    """``{"mtp_k loss": float}`` on the last pipeline stage's ranks; {} elsewhere or without MTP."""
    names = mtp_metric_names(config)
    blocks = [block for block in map(_mtp_block, model_chunks) if block is not None]
    if not names or not state.is_pipeline_last_stage():
        for block in blocks:
            block.losses.clear()
        return {}
    values = torch.zeros(len(names), dtype=torch.float64, device=device)
    for block in blocks:
        for depth, value in block.losses.values.items():
            values[depth] += value.to(device=device, dtype=torch.float64)
        block.losses.clear()
    if state.dp_size > 1:
        dist.all_reduce(values, group=state.dp_group)
    values = (values / (num_microbatches * state.dp_size)).tolist()
    return dict(zip(names, values))
