"""The sample printed at the end of training (``--sample-prompt``): its settings and checks.

Decoding is greedy unless a sampling flag is given; then it samples as ``tpfuse-generate`` does
(temperature → top-k → top-p, one draw per token from a generator seeded with ``--sample-seed``,
the same on every rank), so a run prints the same sample each time. A small model decoded
greedily tends to fall into its most frequent continuation (for source code: runs of spaces);
sampling shows what it has learnt instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from .settings_fields import SettingsGroup, setting

SAMPLING_FLAGS = ("sample_temperature", "sample_top_k", "sample_top_p")


@dataclass(frozen=True, kw_only=True)
class SampleSettings(SettingsGroup):
    """The prompt and decoding of the end-of-training sample (checked only with a prompt)."""
    TITLE = "sample at the end of training"

    sample_prompt: str | None = setting(
        None, "print this prompt's continuation by the trained model (text for "
              "--tokenizer-type; default: no sample)")
    sample_max_new_tokens: int = setting(64, "length of that continuation in tokens", minimum=0)
    sample_temperature: float | None = setting(
        None, "sample at this temperature (default: greedy decoding unless a --sample-* "
              "sampling flag is given, then 1.0)")
    sample_top_k: int | None = setting(None, "sample among the k likeliest tokens (0: all)")
    sample_top_p: float | None = setting(
        None, "sample from the smallest set of tokens holding this probability mass (1: all)")
    sample_seed: int = setting(1234, "seed of the sampling generator (the same on every rank)")

    def check(self) -> None:
        if not self.sample_prompt:
            return
        temperature, top_k, top_p = (getattr(self, name) for name in SAMPLING_FLAGS)
        if temperature is not None and not temperature > 0:
            raise ValueError(f"--sample-temperature must be > 0, got {temperature} (omit the "
                             "sampling flags for greedy decoding)")
        if top_k is not None and top_k < 0:
            raise ValueError(f"--sample-top-k must be >= 0 (0: all tokens), got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"--sample-top-p must be in (0, 1], got {top_p}")


def is_greedy(sample: SampleSettings) -> bool:
    return all(getattr(sample, name) is None for name in SAMPLING_FLAGS)


def sampling_kwargs(sample: SampleSettings) -> dict:
    """``generate``'s decoding keywords for the trainer's sample."""
    if is_greedy(sample):
        return {"greedy": True}
    return {"temperature": 1.0 if sample.sample_temperature is None else sample.sample_temperature,
            "top_k": sample.sample_top_k or 0,
            "top_p": 1.0 if sample.sample_top_p is None else sample.sample_top_p,
            "seed": sample.sample_seed}


def describe_sampling(sample: SampleSettings) -> str:
    """How the sample was decoded, for its header line."""
    if is_greedy(sample):
        return "greedy"
    chosen = sampling_kwargs(sample)
    return (f"temperature {chosen['temperature']:g}, top-k {chosen['top_k']}, "
            f"top-p {chosen['top_p']:g}, seed {chosen['seed']}")


def check_sample_prompt(sample: SampleSettings, tokenizer, config=None) -> None:
    """The prompt must be text the tokenizer takes, its ids inside the model's vocabulary and,
    for learned positions, no longer than ``max_position_embeddings`` (checked before any
    training, on every rank: a sample that cannot be generated fails now, not after the run)."""
    if not sample.sample_prompt:
        return
    try:
        ids = tokenizer.tokenize(sample.sample_prompt)
    except ValueError:
        ids = []
    if not ids:
        raise ValueError(f"--sample-prompt {sample.sample_prompt!r} gives no tokens with "
                         f"{tokenizer!r} (NullTokenizer takes ids: \"1 2 3\")")
    if config is None:
        return
    outside = [int(t) for t in ids if not 0 <= int(t) < config.vocab_size]
    if outside:
        raise ValueError(f"--sample-prompt {sample.sample_prompt!r}: token ids {outside[:5]} lie "
                         f"outside the model's vocabulary [0, {config.vocab_size}) (--vocab-size)")
    if config.position_embedding_type == "learned_absolute" and \
            len(ids) > config.max_position_embeddings:
        raise ValueError(f"--sample-prompt is {len(ids)} tokens long, more than the model's "
                         f"{config.max_position_embeddings} positions "
                         "(--max-position-embeddings)")
