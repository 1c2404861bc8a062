"""Megatron's ``TikTokenizer``: byte-level BPE ranks from a local file, run by the ``tiktoken``
library (the ``tiktoken`` extra), laid out as Megatron-core 0.16.1 lays it out.

The rank file (``--tokenizer-model``) is either Megatron's JSON (a list whose entry ``i`` is
``{"rank": i, "token_bytes": base64, "token_str": text}``, the first 256 the single bytes in
order) or tiktoken's own text format (one ``base64-token rank`` pair a line, every single byte
among the tokens). Ids:

- ``0 .. S-1`` (``S = --tiktoken-num-special-tokens``, default 1000) are special tokens: the named
  ones (``--tokenizer-special-tokens``, default ``<unk> <s> </s> <mask> <pad> <cls> <sep>``, which
  any list must include) then fillers ``<SPECIAL_k>`` up to ``S``;
- ``S + r`` is the token of rank ``r``, for the ranks ``r < V - S`` (``V = --vocab-size``, default
  131072; the file must hold at least ``V - S`` ranks, later ones are cut).

``tokenize`` is tiktoken's ``encode(text, allowed_special="all")`` with the pre-tokenizer regex
``--tiktoken-pattern`` (``v1`` or ``v2``, default ``v2``; special tokens written in the text
become their ids, as in Megatron); EOD is ``</s>``'s id, BOS ``<s>``'s; ``vocab_size`` is ``V``.
"""
from __future__ import annotations

import base64
import binascii
import json
import os

from tpfuse._optional import import_optional

DEFAULT_VOCAB_SIZE = 2**17
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
FILLER_TOKEN = "<SPECIAL_{}>"
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


def _megatron_json_ranks(path: str) -> list[bytes]:
    """The tokens of Megatron's JSON rank file, in rank order."""
    with open(path, encoding="utf-8") as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"--tokenizer-model {path}: not JSON ({err.msg})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model {path}: Megatron's TikTokenizer JSON is a list of "
                         "{rank, token_bytes, token_str} entries")
    tokens = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be {{'rank': {i}, "
                             "'token_bytes': ..., 'token_str': ...}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be the single byte {i} "
                             "(the first 256 ranks are the bytes in order)")
        tokens.append(token)
    return tokens


def _tiktoken_text_ranks(path: str) -> list[bytes]:
    """The tokens of a tiktoken BPE file (``base64 rank`` lines), in rank order."""
    ranks = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[int(rank)] = base64.b64decode(token, validate=True)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{number}: expected 'base64-token rank' (tiktoken's BPE "
                                 "file format)") from None
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: the ranks must be 0..{len(ranks) - 1}, each "
                         "once")
    return [ranks[r] for r in range(len(ranks))]


def read_rank_file(path: str) -> list[bytes]:
    """The BPE tokens of ``path`` in rank order (Megatron's ``.json`` or tiktoken's text file)."""
    tokens = _megatron_json_ranks(path) if path.endswith(".json") else _tiktoken_text_ranks(path)
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"--tokenizer-model {path}: a token appears under two ranks")
    return tokens


def special_token_list(special_tokens, num_special_tokens: int, vocab_size: int) -> list[str]:
    """The ``num_special_tokens`` special tokens, id order: the named ones, then fillers."""
    named = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    if len(set(named)) != len(named):
        raise ValueError(f"--tokenizer-special-tokens must be unique, got {named}")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in named]
    if missing:
        raise ValueError(f"--tokenizer-special-tokens must include "
                         f"{' '.join(REQUIRED_SPECIAL_TOKENS)} (Megatron's TikTokenizer); missing "
                         f"{' '.join(missing)}")
    if not len(named) <= num_special_tokens < vocab_size:
        raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                         f"{len(named)} named special tokens and below --vocab-size {vocab_size}")
    return named + [FILLER_TOKEN.format(k) for k in range(len(named), num_special_tokens)]


class TikTokenizer:
    """Megatron's TikTokenizer over a local rank file (see the module docstring)."""

    def __init__(self, path: str, pattern: str, vocab_size: int | None, num_special_tokens: int,
                 special_tokens, spec: str):
        tiktoken = import_optional("tiktoken", extra="tiktoken",
                                   feature="--tokenizer-type TikTokenizer")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        specials = special_token_list(special_tokens, num_special_tokens, vocab_size)
        tokens = read_rank_file(path)
        inner = vocab_size - num_special_tokens
        if len(tokens) < inner:
            raise ValueError(
                f"--tokenizer-model {path} holds {len(tokens)} ranks; --vocab-size {vocab_size} "
                f"with {num_special_tokens} special tokens needs {inner} (give --vocab-size "
                f"{len(tokens) + num_special_tokens} to use the whole file)")
        tokens = tokens[:inner]
        missing = sorted(set(range(256)) - {t[0] for t in tokens if len(t) == 1})
        if missing:
            raise ValueError(f"--tokenizer-model {path}: byte {missing[0]} has no rank (every "
                             "single byte must be a token of a byte-level BPE)")
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "tpfuse",
            pat_str=PATTERNS[pattern],
            mergeable_ranks={t: num_special_tokens + r for r, t in enumerate(tokens)},
            special_tokens={t: i for i, t in enumerate(specials)})
        self.special_tokens = specials
        self.vocab_size = vocab_size
        self.eod = specials.index("</s>")
        self.bos = specials.index("<s>")
        self.name = spec

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def __repr__(self):
        return f"TikTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
