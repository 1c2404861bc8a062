"""Activation recomputation over a chunk's layers (Megatron's ``--recompute-granularity full``).

``run_layers`` applies a chunk's layers; with full recompute (training, gradients enabled):
``recompute_method="uniform"`` cuts them into groups of ``recompute_num_layers`` consecutive
layers, each group keeping only its input and re-run in backward; ``"block"`` recomputes each of
the first ``recompute_num_layers`` layers of the chunk and keeps the others' activations. With
``distribute_saved_activations`` (tp > 1, no sequence parallelism) each kept input is stored
1/tp per TP rank and all-gathered in backward. The mechanism (random state replayed, the
model-parallel RNG tracker included) is ``tpfuse.tp_layers.checkpointing.checkpoint``.

Selective recompute (``recompute_granularity="selective"``, ``recompute_modules``) lives in the
layers: ``TransformerLayer(recompute_modules=...)``.
"""
from __future__ import annotations

import torch

from tpfuse.tp_layers.checkpointing import checkpoint


def _run(layers, hidden, position_ids, rotary_pos_emb, document_ids=None,
         dropout_coordinates=None):
    for layer in layers:
        hidden = layer(hidden, position_ids, rotary_pos_emb=rotary_pos_emb,
                       document_ids=document_ids, dropout_coordinates=dropout_coordinates)
    return hidden


def _distribute_group(config, layers):
    if not getattr(config, "distribute_saved_activations", False):
        return None
    return layers[0].tp.group


def run_layers(layers, hidden, position_ids, config, training, rotary_pos_emb=None,
               document_ids=None, dropout_coordinates=None):
    """Apply ``layers`` in order, with full recompute as the config says (only when gradients
    are needed)."""
    if config.recompute_granularity != "full" or not training or not torch.is_grad_enabled():
        return _run(layers, hidden, position_ids, rotary_pos_emb, document_ids,
                    dropout_coordinates)
    n, group = config.recompute_num_layers, _distribute_group(config, layers)

    def group_of(chunk):
        return lambda h: _run(chunk, h, position_ids, rotary_pos_emb, document_ids,
                              dropout_coordinates)

    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = checkpoint(group_of(layers[start:start + n]), hidden,
                                distribute_group=group)
        return hidden
    for index, layer in enumerate(layers):        # "block"
        if index < n:
            hidden = checkpoint(group_of([layer]), hidden, distribute_group=group)
        else:
            hidden = layer(hidden, position_ids, rotary_pos_emb=rotary_pos_emb,
                           document_ids=document_ids, dropout_coordinates=dropout_coordinates)
    return hidden
