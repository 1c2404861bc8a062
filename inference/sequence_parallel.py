"""Sequence parallelism during generation: which steps run split over TP, and switching it off for
the others.

A model loaded with ``sequence_parallel=True`` at tp > 1 splits every step's (s, b, h) hidden
states over the TP ranks along s (s/tp rows each, as in training). The rule ``generate`` follows:

    a step runs with SP   when its new-token count s is a multiple of tp
    otherwise             with SP off for that step (every TP rank holds the whole (s, b, h))

and ``generate`` left-pads the prompts to a multiple of tp (the extra pads are masked like any
left padding, positions counted from each prompt's first token), so the prefill always runs
with SP, while a decode step (s = 1 < tp) runs without — what Megatron-core's static inference
engine does: its decode runs the dense layers with SP off (``set_model_to_sequence_parallel``).
Both regimes compute the same function: SP changes where the rows of (s, b, h) live, not the
values (the KV cache holds [b, g/tp, S, d] either way, filled by the full-sequence K / V the
QKV GEMM produces after SP's all-gather). An MoE layer without SP routes the replicated tokens
on every TP rank, which is exact in eval (``loading.py``).

``sequence_parallel_disabled(chunks)`` turns SP off in place for a ``with`` block — every
module's ``sequence_parallel`` flag and the configs the modules read — and restores it after.
"""
from __future__ import annotations

import contextlib


def model_sequence_parallel(chunks, tp: int) -> bool:
    """Was the model built to split its sequence over tp > 1 ranks?"""
    return tp > 1 and bool(chunks[0].config.sequence_parallel)


def step_splits(num_tokens: int, tp: int) -> bool:
    """A step of ``num_tokens`` new tokens per sequence runs with SP when tp divides it."""
    return num_tokens % tp == 0


def prompt_length_multiple(chunks, tp: int) -> int:
    """The multiple ``generate`` pads the prompt length to: tp under SP (so the prefill splits),
    else 1."""
    return tp if model_sequence_parallel(chunks, tp) else 1


def _flagged(chunks):
    """(owner, current value) of every ``sequence_parallel`` flag the chunks' modules read."""
    owners, seen = [], set()
    for chunk in chunks:
        for module in chunk.modules():
            for owner in (module, getattr(module, "config", None)):
                if owner is None or id(owner) in seen:
                    continue
                value = getattr(owner, "sequence_parallel", None)
                if isinstance(value, bool):
                    seen.add(id(owner))
                    owners.append((owner, value))
    return owners


@contextlib.contextmanager
def sequence_parallel_disabled(chunks, flagged=None):
    """SP off in the chunks for the ``with`` block (a no-op for a model without SP);
    ``flagged``: the chunks' ``_flagged`` owners when already collected."""
    if flagged is None:
        flagged = _flagged(chunks)
    flagged = [(owner, value) for owner, value in flagged if value]
    for owner, _ in flagged:
        owner.sequence_parallel = False
    try:
        yield
    finally:
        for owner, value in flagged:
            owner.sequence_parallel = value


class StepContexts:
    """``contexts(num_tokens)``: the ``with`` context of one step: as the model is, or SP off
    (the rule above). The flags SP is switched by are collected once, at construction, not on
    every decode step."""

    def __init__(self, chunks, tp: int):
        self.chunks, self.tp = chunks, tp
        self.flagged = _flagged(chunks) if model_sequence_parallel(chunks, tp) else None

    def __call__(self, num_tokens: int):
        if self.flagged is not None and not step_splits(num_tokens, self.tp):
            return sequence_parallel_disabled(self.chunks, self.flagged)
        return contextlib.nullcontext()
