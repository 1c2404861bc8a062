"""Tokenizers for tpfuse's data pipeline.

Every tokenizer offers the same small surface (Megatron's names):
``vocab_size`` (number of ids, EOD included), ``eod`` (the end-of-document id), ``name`` (a short
string recorded in dataset cache descriptions), ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``.

The tokenizers a spec names directly, defined in ``tokenizer_builtin.py`` and importable from
here: :class:`ByteTokenizer` (the UTF-8 bytes, EOD 256, no dependency), :class:`NullTokenizer`
(Megatron's null tokenizer, for ``--mock-data --vocab-size N``) and :class:`HFTokenizer` (a
``tokenizer.json``, needs the optional ``tokenizers`` package).

``build_tokenizer(spec)``: ``"byte"`` → ByteTokenizer, ``"null:N"`` → NullTokenizer(N), a path to a
``tokenizer.json`` → HFTokenizer, a JSON object of Megatron's tokenizer flags (what a tokenizer
of ``tokenizer_options.build_megatron_tokenizer`` has as its ``name``) → that tokenizer. A
tokenizer's ``name`` is the spec it is rebuilt from (HFTokenizer's: ``hf:`` + its file's path).

Megatron's tokenizer types (GPT-2 BPE, SentencePiece, TikToken, transformers folders) are in
``tokenizer_options.py`` and one module per library (``tokenizer_gpt2.py``, ...).

The model's embedding table must have at least ``vocab_size`` rows (Megatron pads it further to a
multiple of 128 × tp; that padding is the model's business, not the tokenizer's).
"""
from __future__ import annotations

import os

from .tokenizer_builtin import ByteTokenizer, HFTokenizer, NullTokenizer
from .tokenizer_options import tokenizer_from_spec


def build_tokenizer(spec: str, eod_token: str | None = None):
    """``"byte"`` | ``"null:N"`` | path to a tokenizer.json | a JSON object of Megatron's
    tokenizer flags → a tokenizer object."""
    if isinstance(spec, str) and spec.startswith("{"):
        if eod_token is not None:
            raise ValueError("--eod-token applies to a tokenizer.json only (Megatron's tokenizer "
                             "types define their own EOD)")
        return tokenizer_from_spec(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer: expected 'byte', 'null:N' or a tokenizer.json path, got {spec!r}")
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("null:"):
        count = spec[len("null:"):]
        if not count.isdigit():
            raise ValueError(f"tokenizer: {spec!r} must look like 'null:N' with N a positive integer")
        return NullTokenizer(int(count))
    if not os.path.isfile(spec):
        raise ValueError(
            f"tokenizer: {spec!r} is neither 'byte', 'null:N' nor an existing tokenizer.json file")
    return HFTokenizer(spec, eod_token=eod_token)
