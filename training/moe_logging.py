"""The router losses and expert loads of an MoE model, per training step, for the log.

Each chunk's ``router_losses`` tracker holds, per global layer, the partials this rank computed
(divided by their coefficients) summed over the step's m micro-batches, and the tokens it routed
to each expert. One all-reduce over the world adds up the partials of a micro-batch's sequence
partition (tp × cp), the pipeline stages (each layer lives on one) and the data-parallel replicas;
then, as Megatron-core logs them::

    load_balancing_loss, z_loss = Σ_layers value / (m · dp · number of MoE layers)
    tokens_per_expert[layer]    = tokens of the whole global batch routed to each expert

Only the losses whose coefficient is set are reported. A collective: every rank calls it once per
step; it clears the trackers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.models.moe_config import is_moe_layer
from tpfuse.moe.aux_losses import LOSS_NAMES


def _tracker(chunk):
    while not hasattr(chunk, "router_losses") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.router_losses


def reported_losses(config) -> tuple[str, ...]:
    """The router losses a config computes (their coefficient set)."""
    names = []
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type != "none":
        names.append("load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return tuple(names)


def router_metrics(model_chunks, config, state, num_microbatches: int, device) -> dict:
    """``{"load_balancing_loss": float, "z_loss": float, "tokens_per_expert": {layer: [n_e]}}``
    (the losses that are on; {} for a dense model)."""
    if config.num_moe_experts is None:
        return {}
    layers, experts = config.num_layers + (config.mtp_num_layers or 0), config.num_moe_experts
    # gathered on the device, one all-reduce, one device -> host copy
    losses = torch.zeros(len(LOSS_NAMES), layers, dtype=torch.float64, device=device)
    tokens = torch.zeros(layers, experts, dtype=torch.float64, device=device)
    for chunk in model_chunks:
        tracker = _tracker(chunk)
        for i, name in enumerate(LOSS_NAMES):
            for layer, value in tracker.values.get(name, {}).items():
                losses[i, layer] += value.reshape(()).to(device=device, dtype=torch.float64)
        for layer, counts in tracker.tokens_per_expert.items():
            tokens[layer] += counts.to(device=device, dtype=torch.float64)
        tracker.clear()
    stats = torch.cat([losses.reshape(-1), tokens.reshape(-1)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    stats = stats.cpu()
    losses = stats[:losses.numel()].view_as(losses) / (num_microbatches * state.dp_size)
    tokens = stats[losses.numel():].view_as(tokens)
    moe_layers = [i for i in range(layers) if is_moe_layer(config, i)]   # MTP's included
    metrics = {name: losses[LOSS_NAMES.index(name), moe_layers].sum().item() / len(moe_layers)
               for name in reported_losses(config)}
    metrics["tokens_per_expert"] = {layer: [int(n) for n in tokens[layer].tolist()]
                                    for layer in moe_layers}
    return metrics
