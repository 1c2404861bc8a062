"""Full activation recompute of transformer layers (Megatron's ``--recompute-granularity full``).

``recompute_method="uniform"``: the chunk's layers are cut into groups of ``recompute_num_layers``
consecutive layers; each group keeps only its input and is re-run during backward.
``recompute_method="block"``: the first ``recompute_num_layers`` layers of the chunk are each
recomputed; the rest keep their activations.

Recomputation must reproduce the forward's dropout masks. ``torch.utils.checkpoint`` restores the
default generator; the model-parallel RNG tracker's streams (attention dropout, dropout under
sequence parallelism) are restored here: the tracker states at the first forward are replayed
during the recomputation and the post-forward states are put back afterwards.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tpfuse.tp_layers.random import get_rng_tracker


def _run(layers, hidden, position_ids):
    for layer in layers:
        hidden = layer(hidden, position_ids)
    return hidden


def _checkpointed(layers, hidden, position_ids):
    tracker = get_rng_tracker()
    states_at_forward = tracker.get_states()
    calls = []

    def body(h):
        if not calls:                              # the real forward
            calls.append(1)
            return _run(layers, h, position_ids)
        states_after = tracker.get_states()        # the recomputation in backward
        tracker.set_states(states_at_forward)
        try:
            return _run(layers, h, position_ids)
        finally:
            tracker.set_states(states_after)

    return checkpoint(body, hidden, use_reentrant=False, preserve_rng_state=True)


def run_layers(layers, hidden, position_ids, config, training):
    """Apply ``layers`` in order, recomputing as the config says (only when grads are needed)."""
    if config.recompute_granularity != "full" or not training or not torch.is_grad_enabled():
        return _run(layers, hidden, position_ids)
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = _checkpointed(layers[start:start + n], hidden, position_ids)
        return hidden
    for index, layer in enumerate(layers):        # "block"
        if index < n:
            hidden = _checkpointed([layer], hidden, position_ids)
        else:
            hidden = layer(hidden, position_ids)
    return hidden
