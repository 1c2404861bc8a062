"""GPTDatasetConfig: what a GPT dataset is built from, validated at construction.

Megatron-core's field names. ``blend`` is a list of ``(path_prefix, weight)`` pairs, Megatron's
flat ``[w1, p1, w2, p2, ...]`` form, or a list of prefixes (weight 1 each). ``blend_per_split``
gives the train / valid / test splits their own blends (then ``split`` is ignored). ``split`` is
Megatron's ``"969,30,1"``: relative sizes of the train / valid / test document ranges of every file.
``path_to_cache=None`` builds the dataset indices in memory only (no files written).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from tpfuse.parallel.checks import is_int, is_real

SPLIT_NAMES = ("train", "valid", "test")


def parse_blend(blend) -> list[tuple[str, float]] | None:
    """Normalises a blend to ``[(prefix, weight), ...]`` (weights as given, not yet normalised)."""
    if blend is None:
        return None
    if isinstance(blend, str):
        blend = [blend]
    if not isinstance(blend, (list, tuple)) or len(blend) == 0:
        raise ValueError(f"blend: expected a non-empty list, got {blend!r}")
    if all(isinstance(item, (list, tuple)) for item in blend):
        pairs = [tuple(item) for item in blend]
    elif all(isinstance(item, str) for item in blend):
        pairs = [(prefix, 1.0) for prefix in blend]
    else:  # Megatron's flat form: weight, prefix, weight, prefix, ...
        if len(blend) % 2:
            raise ValueError(f"blend: the flat form [w1, p1, w2, p2, ...] needs pairs, got {blend!r}")
        weights = [float(w) if isinstance(w, str) and re.fullmatch(r"[0-9.eE+-]+", w) else w
                   for w in blend[0::2]]
        pairs = list(zip(blend[1::2], weights))
    result = []
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or not is_real(pair[1]):
            raise ValueError(f"blend: entry {pair!r} is not a (path_prefix, weight) pair")
        prefix, weight = pair
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"blend: weight of {prefix!r} must be a positive finite number, got {weight!r}")
        result.append((prefix, float(weight)))
    return result


def _float_or_none(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value


def blend_from_cli(values: list[str] | None) -> list[tuple[str, float]] | None:
    """Megatron's ``--data-path`` forms → ``[(prefix, weight), ...]`` (None for no flag).

    ``P`` (one prefix); ``W1 P1 W2 P2 ...`` (an even count whose every other item, from the
    first, is a number: ``0.7 A 0.3 B``); otherwise a list of prefixes, weighted as Megatron
    infers them, by each file's size (here: its token count). A mix of numbers and names in the
    weight positions is an error naming the item.
    """
    if values is None:
        return None
    if not values:
        raise ValueError("--data-path: expected a prefix or weight-prefix pairs, got nothing")
    weights = [_float_or_none(item) for item in values[0::2]]
    if len(values) % 2 == 0 and all(w is not None for w in weights):
        return parse_blend(list(zip(values[1::2], weights)))
    numbers = [item for item in values if _float_or_none(item) is not None]
    if numbers:
        raise ValueError(f"--data-path {' '.join(values)}: {numbers[0]!r} looks like a weight; use "
                         f"either prefixes only or WEIGHT PREFIX pairs throughout")
    if len(values) == 1:
        return [(values[0], 1.0)]
    from .indexed import IndexedDataset

    sizes = [float(IndexedDataset(prefix).sequence_lengths.sum()) for prefix in values]
    return parse_blend(list(zip(values, sizes)))


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` → normalised ``[0.969, 0.03, 0.001]`` (missing parts are 0)."""
    if not isinstance(split, str):
        raise ValueError(f"split: expected a string like '969,30,1', got {split!r}")
    parts = [p.strip() for p in re.split(r"[,/]", split) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split: {split!r} must be up to 3 comma-separated numbers") from None
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split: {split!r} must be 1 to 3 non-negative numbers with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Document ranges ``[begin, end)`` of train / valid / test: ``round(cumulative share × N)``."""
    shares = parse_split(split)
    bounds = [0.0]
    for share in shares:
        bounds.append(bounds[-1] + share)
    edges = [int(round(b * num_documents)) for b in bounds]
    edges[-1] = num_documents
    return [(edges[i], edges[i + 1]) for i in range(3)]


@dataclass
class GPTDatasetConfig:
    random_seed: int
    sequence_length: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Megatron's dense (1, s, s) attention_mask beside document_ids (default off here: the
    # attention takes document ids, and the dense mask costs s² bytes per sample)
    create_attention_mask: bool = False
    tokenizer: object = None
    blend: object = None
    blend_per_split: object = None
    split: str = "969,30,1"
    path_to_cache: str | None = None
    mock: bool = False
    # MockGPTDataset's synthetic corpus: this many documents of 1..max length tokens (from the seed)
    mock_num_documents: int = 4096
    mock_max_document_length: int = 1024
    # Megatron's: samples of sequence_length + 1 tokens (labels = the next token of each); False:
    # windows of sequence_length tokens, the last label a pad (-100) with loss_mask 0
    add_extra_token_to_sequence: bool = True
    blend_pairs: list = field(init=False, repr=False, default=None)
    blend_per_split_pairs: list = field(init=False, repr=False, default=None)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not is_int(self.random_seed) or not 0 <= self.random_seed < 2**32:
            raise ValueError(f"random_seed must be an int in [0, 2**32), got {self.random_seed!r}")
        if not is_int(self.sequence_length) or self.sequence_length < 1:
            raise ValueError(f"sequence_length must be a positive int, got {self.sequence_length!r}")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "mock",
                     "add_extra_token_to_sequence", "create_attention_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("vocab_size", "eod"):
            if not isinstance(getattr(self.tokenizer, name, None), int):
                raise ValueError(f"tokenizer must have an int '{name}' (ByteTokenizer, NullTokenizer, "
                                 f"HFTokenizer), got {self.tokenizer!r}")
        if not 0 <= self.tokenizer.eod < self.tokenizer.vocab_size:
            raise ValueError(f"tokenizer: eod {self.tokenizer.eod} outside [0, {self.tokenizer.vocab_size})")
        parse_split(self.split)
        self.blend_pairs = parse_blend(self.blend)
        self._validate_blend_per_split()
        if not self.mock and self.blend_pairs is None and self.blend_per_split_pairs is None:
            raise ValueError("blend: give blend (or blend_per_split) with the data path prefixes, or mock=True")
        if self.path_to_cache is not None and not isinstance(self.path_to_cache, str):
            raise ValueError(f"path_to_cache must be a directory path or None, got {self.path_to_cache!r}")
        for name in ("mock_num_documents", "mock_max_document_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def _validate_blend_per_split(self) -> None:
        if self.blend_per_split is None:
            self.blend_per_split_pairs = None
            return
        if self.blend is not None:
            raise ValueError("blend and blend_per_split are exclusive; give one of them")
        if not isinstance(self.blend_per_split, (list, tuple)) or len(self.blend_per_split) != 3:
            raise ValueError(f"blend_per_split must be [train, valid, test] blends (None for an unused "
                             f"split), got {self.blend_per_split!r}")
        self.blend_per_split_pairs = [parse_blend(b) for b in self.blend_per_split]
