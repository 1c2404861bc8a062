"""Choosing the next token from full-vocabulary logits: greedy, or sampling with temperature,
top-k and top-p (nucleus), in that order (HuggingFace's and Megatron's order).

    logits (b, V) fp32, ids ≥ vocab_size set to −inf (padded vocabulary rows never win)
    greedy:  argmax
    else:    logits / T → keep the k largest → keep the smallest prefix of the sorted
             distribution whose mass reaches p (the most likely token always stays) → softmax →
             one draw per row from ``generator``

Every TP rank holds the same full logits (all-gathered) and a generator seeded alike, so all of
them draw the same token without communicating.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """greedy, or temperature T > 0, top_k ≥ 0 (0: off), 0 < top_p ≤ 1 (1: off)."""
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature} must be a finite number > 0 (use "
                             "greedy=True for argmax decoding; a huge temperature is uniform "
                             "sampling)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")
        if self.greedy and (self.temperature != 1.0 or self.top_k or self.top_p != 1.0):
            raise ValueError("greedy=True cannot be combined with temperature / top_k / top_p")


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits (b, V_padded)`` with the padded ids (≥ vocab_size) at −inf, in fp32."""
    logits = logits.float()
    if vocab_size < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_size:] = float("-inf")
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]                 # (b, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop the tokens after the sorted cumulative probability first reaches ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p                    # mass before it ≥ p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next_tokens(logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None) -> torch.Tensor:
    """``(b,)`` int64 next tokens from full-vocabulary fp32 logits ``(b, V)``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_top_p(filter_top_k(logits / params.temperature, params.top_k), params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).reshape(-1)
