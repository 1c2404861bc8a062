"""Context parallelism in the trainer: this cp rank's share of a batch, and the loss over the whole
sequence.

``get_batch_on_this_cp_rank(batch)`` (Megatron's name) keeps, of every ``(b, s, ...)`` tensor of
a micro-batch (tokens, labels, loss_mask, position_ids, document_ids), this cp rank's two
load-balanced chunks (parallel/context_split.py). The ranks of one cp group read the same
micro-batch (the sampler splits over dp only).

``sequence_mean_loss(losses, loss_mask)``: each cp rank holds the per-token losses of s/cp tokens.
The loss of the micro-batch is the mean over the kept tokens of the *whole* sequence,

    L = Σ_cp Σ_local loss·mask / Σ_cp Σ_local mask                 (one all-reduce of [sum, count])

Every cp rank back-propagates ``cp · Σ_local loss·mask / Σ_cp mask``: the gradients of a
parameter from the cp ranks sum to cp · ∇L (the ring carries each rank's share of dK/dV home),
and the data-parallel reduction averages over dp·cp (Megatron's 1/dp_cp scaling), leaving
∇L averaged over dp — the same gradient as one process on the whole sequence.
"""
from __future__ import annotations

import torch

from tpfuse.parallel.context_sequence import masked_sequence_mean
from tpfuse.parallel.context_split import split_sequence


def _cp_size_rank(state):
    from tpfuse.parallel.state import resolve_state_or_none

    state = resolve_state_or_none(state)
    return (1, 0) if state is None else (state.cp_size, state.cp_rank)


def get_batch_on_this_cp_rank(batch: dict, state=None) -> dict:
    """``batch`` with every ``(b, s, ...)`` tensor cut to this cp rank's ``(b, s/cp, ...)``
    (chunks r and 2·cp−1−r); unchanged when cp = 1. A dense ``attention_mask`` cannot be cut
    this way: ValueError (the attention takes ``document_ids``)."""
    cp_size, cp_rank = _cp_size_rank(state)
    if cp_size == 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism splits the sequence, not a dense (b, 1, s, s) "
                         "attention_mask: build the dataset without create_attention_mask (the "
                         "attention uses document_ids)")
    seq = batch["tokens"].shape[1]
    return {name: split_sequence(value, cp_size, cp_rank, dim=1)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq
            else value for name, value in batch.items()}


def sequence_mean_loss(losses: torch.Tensor, loss_mask: torch.Tensor, state=None):
    """``(loss to back-propagate, the micro-batch's mean loss (detached))`` for this rank's
    per-token ``losses`` and ``loss_mask`` (same shape, any); see the module docstring
    (``parallel.context_sequence.masked_sequence_mean`` over the state's cp group)."""
    cp_size = _cp_size_rank(state)[0]
    if cp_size == 1:
        return masked_sequence_mean(losses, loss_mask)
    from tpfuse.parallel.state import resolve_state

    return masked_sequence_mean(losses, loss_mask, resolve_state(state).cp_group, cp_size)
