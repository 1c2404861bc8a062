"""Megatron's tokenizer flags and the tokenizer they name, for ``tpfuse-preprocess`` and
``tpfuse-train`` alike.

``TokenizerOptions`` holds Megatron-LM's tokenizer flags (``--tokenizer-type``,
``--tokenizer-model``, ``--vocab-file``, ``--merge-file``, ``--vocab-size``, ``--tiktoken-*``,
``--tokenizer-special-tokens``, ``--tokenizer-hf-*``) with Megatron's defaults;
``build_megatron_tokenizer(options)`` returns the tokenizer, each built on the library that
defines it (Megatron-core 0.16.1's default tokenizer system gives the ids and special ids):

==========================  ======================  =============================================
``--tokenizer-type``        library                 ids, EOD, vocab_size
==========================  ======================  =============================================
``GPT2BPETokenizer``        ``tokenizers``          GPT-2 byte-level BPE of ``--vocab-file``
                                                    (vocab.json) + ``--merge-file`` (merges.txt);
                                                    EOD ``<|endoftext|>``; the vocab's size
``SentencePieceTokenizer``  ``sentencepiece``       ``encode_as_ids`` of ``--tokenizer-model``;
``GPTSentencePieceTok...``                          EOD the model's eos id; its piece count
``Llama2Tokenizer``
``TikTokenizer``            ``tiktoken``            a BPE rank file (``--tokenizer-model``),
                                                    ranks shifted past the special tokens;
                                                    EOD ``</s>``; ``--vocab-size`` (2**17)
``HuggingFaceTokenizer``    ``transformers`` /      a local tokenizer folder (AutoTokenizer,
                            ``tokenizers``          EOD its eos token) or a ``tokenizer.json``
``NullTokenizer``           (built in)              ids ``0..N-1``, EOD ``N`` (``--vocab-size N``)
``ByteTokenizer``           (built in, tpfuse's)    bytes, EOD 256, 257 ids
==========================  ======================  =============================================

Megatron's other types (``MEGATRON_ONLY_TYPES``: BERT word pieces, multimodal, SFT) are refused
with an error naming them. A tokenizer's ``name`` is its *spec*, the string
``data.tokenizer.build_tokenizer`` rebuilds it from (what checkpoints record): ``"byte"``,
``"null:N"``, ``"hf:"`` + a tokenizer.json's path as before, and for the library types the JSON
object of the options that differ from the defaults, file paths absolute (``options.spec()``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, fields

TOKENIZER_TYPES = ("NullTokenizer", "ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "TikTokenizer")
MEGATRON_ONLY_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
                       "NullMultimodalTokenizer", "SFTTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TIKTOKEN_PATTERNS = ("v1", "v2")
_PATH_FIELDS = ("tokenizer_model", "vocab_file", "merge_file")


@dataclass(frozen=True, kw_only=True)
class TokenizerOptions:
    """Megatron's tokenizer flags (field ``x_y`` ↔ flag ``--x-y``), Megatron's defaults."""

    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: tuple[str, ...] | None = None
    tokenizer_hf_use_fast: bool = False
    tokenizer_hf_include_special_tokens: bool = False

    @classmethod
    def from_values(cls, values: dict, **overrides) -> "TokenizerOptions":
        """The options among ``values`` (an argparse namespace's ``vars`` or a settings group's
        fields; other names ignored). Megatron's deprecated ``tiktoken_special_tokens`` stands in
        for ``tokenizer_special_tokens`` when that is not given."""
        values = {**values, **overrides}
        if values.get("tokenizer_special_tokens") is None:
            values["tokenizer_special_tokens"] = values.get("tiktoken_special_tokens")
        chosen = {f.name: values[f.name] for f in fields(cls) if f.name in values}
        if chosen.get("tokenizer_special_tokens") is not None:
            chosen["tokenizer_special_tokens"] = tuple(chosen["tokenizer_special_tokens"])
        return cls(**chosen)

    def spec(self) -> str:
        """The JSON object of the options that differ from the defaults (paths absolute)."""
        chosen = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                chosen[f.name] = (os.path.abspath(value) if f.name in _PATH_FIELDS
                                  else list(value) if isinstance(value, tuple) else value)
        return json.dumps(chosen, sort_keys=True)

    @classmethod
    def from_spec(cls, spec: str) -> "TokenizerOptions":
        try:
            values = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ValueError(f"tokenizer spec {spec!r} is not a JSON object ({err.msg})") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or not set(values) <= known:
            raise ValueError(f"tokenizer spec {spec!r}: expected a JSON object of {sorted(known)}")
        return cls.from_values(values)


# ---------------------------------------------------------------------------- command line
_HELP = {
    "tokenizer_type": "Megatron's tokenizer type: " + ", ".join(TOKENIZER_TYPES),
    "tokenizer_model": "SentencePiece model file, TikTokenizer BPE file (Megatron's JSON ranks "
                       "or a .tiktoken file), HuggingFaceTokenizer folder or tokenizer.json",
    "vocab_file": "GPT2BPETokenizer: the vocab.json",
    "merge_file": "GPT2BPETokenizer: the merges.txt",
    "vocab_size": "NullTokenizer: ids before EOD; TikTokenizer: the vocabulary, special tokens "
                  "included (default 131072)",
    "tiktoken_pattern": "TikTokenizer's pre-tokenizer regex: v1 or v2 (default v2)",
    "tiktoken_num_special_tokens": "TikTokenizer: ids 0..N-1 are special tokens (default 1000)",
    "tokenizer_special_tokens": "TikTokenizer: the named special tokens (must include <unk> <s> "
                                "</s> <mask> <pad> <cls> <sep>); HuggingFaceTokenizer: tokens "
                                "added to the vocabulary",
    "tiktoken_special_tokens": "deprecated spelling of --tokenizer-special-tokens (Megatron's)",
    "tokenizer_hf_use_fast": "HuggingFaceTokenizer: load the fast (Rust) tokenizer",
    "tokenizer_hf_include_special_tokens": "HuggingFaceTokenizer: ids include the special "
                                           "tokens the tokenizer adds (e.g. BOS)",
}


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags (tpfuse-preprocess; tpfuse-train's come from DataSettings)."""
    group = parser.add_argument_group("tokenizer (Megatron's flags)")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES + MEGATRON_ONLY_TYPES,
                       default=None, help=_HELP["tokenizer_type"])
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        group.add_argument("--" + name.replace("_", "-"), default=None, help=_HELP[name])
    group.add_argument("--vocab-size", type=int, default=None, help=_HELP["vocab_size"])
    group.add_argument("--tiktoken-pattern", default=None, choices=TIKTOKEN_PATTERNS,
                       help=_HELP["tiktoken_pattern"])
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help=_HELP["tiktoken_num_special_tokens"])
    for name in ("tokenizer_special_tokens", "tiktoken_special_tokens"):
        group.add_argument("--" + name.replace("_", "-"), nargs="+", default=None,
                           help=_HELP[name])
    for name in ("tokenizer_hf_use_fast", "tokenizer_hf_include_special_tokens"):
        group.add_argument("--" + name.replace("_", "-"), action="store_true", help=_HELP[name])


# ---------------------------------------------------------------------------- building
def check_tokenizer_type(kind: str) -> None:
    """ValueError for a type tpfuse does not build (naming Megatron's that it leaves out)."""
    if kind in MEGATRON_ONLY_TYPES:
        raise ValueError(f"--tokenizer-type {kind} is a Megatron tokenizer tpfuse does not "
                         f"implement (it leaves out {', '.join(MEGATRON_ONLY_TYPES)}); "
                         f"implemented: {', '.join(TOKENIZER_TYPES)}")
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {kind!r} is unknown; implemented: "
                         f"{', '.join(TOKENIZER_TYPES)}")


def _refuse_flags(options: TokenizerOptions, names, kind: str) -> None:
    """The flags that mean nothing to ``kind`` must be left at their defaults."""
    defaults = {f.name: f.default for f in fields(options)}
    for name in names:
        if getattr(options, name) != defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --tokenizer-type "
                             f"{kind}")


def _need(options: TokenizerOptions, **needed: str) -> list[str]:
    """The paths ``needed`` names (field → what it holds): each given, then each existing."""
    for name, what in needed.items():
        if not getattr(options, name):
            raise ValueError(f"--tokenizer-type {options.tokenizer_type} needs "
                             f"--{name.replace('_', '-')} ({what})")
    for name in needed:
        if not os.path.exists(getattr(options, name)):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(options, name)}: no such file "
                             "or folder")
    return [getattr(options, name) for name in needed]


def _null_or_byte(options: TokenizerOptions):
    from .tokenizer_builtin import ByteTokenizer, NullTokenizer

    if options.tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if options.vocab_size is None:
        raise ValueError("NullTokenizer (the tokenizer of --mock-data) needs --vocab-size")
    return NullTokenizer(options.vocab_size)


def _gpt2_bpe(options: TokenizerOptions):
    from .tokenizer_gpt2 import GPT2BPETokenizer

    _refuse_flags(options, ("tokenizer_model", "tokenizer_special_tokens"), "GPT2BPETokenizer")
    vocab, merges = _need(options, vocab_file="GPT-2's vocab.json",
                          merge_file="GPT-2's merges.txt")
    return GPT2BPETokenizer(vocab, merges, spec=options.spec())


def _sentencepiece(options: TokenizerOptions):
    from .tokenizer_sentencepiece import SentencePieceTokenizer

    if options.tokenizer_special_tokens:
        raise ValueError(f"--tokenizer-special-tokens does not apply to --tokenizer-type "
                         f"{options.tokenizer_type} (Megatron: special tokens belong in the "
                         "SentencePiece model, given when it is trained)")
    (model,) = _need(options, tokenizer_model="a SentencePiece .model file")
    return SentencePieceTokenizer(model, spec=options.spec())


def _tiktoken(options: TokenizerOptions):
    from .tokenizer_tiktoken import TikTokenizer

    (path,) = _need(options, tokenizer_model="a BPE rank file: Megatron's JSON or .tiktoken")
    return TikTokenizer(path, pattern=options.tiktoken_pattern or "v2",
                        vocab_size=options.vocab_size,
                        num_special_tokens=options.tiktoken_num_special_tokens,
                        special_tokens=options.tokenizer_special_tokens, spec=options.spec())


def _huggingface(options: TokenizerOptions):
    from .tokenizer_builtin import HFTokenizer
    from .tokenizer_hf import HuggingFaceAutoTokenizer, is_transformers_folder

    if not options.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH "
                         "(a local tokenizer folder, or a tokenizer.json)")
    path = options.tokenizer_model
    if os.path.isdir(path) and is_transformers_folder(path):
        _refuse_flags(options, ("vocab_file", "merge_file"), "HuggingFaceTokenizer")
        return HuggingFaceAutoTokenizer(
            path, use_fast=options.tokenizer_hf_use_fast,
            include_special_tokens=options.tokenizer_hf_include_special_tokens,
            special_tokens=options.tokenizer_special_tokens, spec=options.spec())
    _refuse_flags(options, ("vocab_file", "merge_file", "tokenizer_special_tokens",
                            "tokenizer_hf_include_special_tokens"),
                  "HuggingFaceTokenizer with a bare tokenizer.json")
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {options.tokenizer_model}: no tokenizer.json there "
                         "(and no tokenizer_config.json: not a transformers tokenizer folder)")
    return HFTokenizer(path)


_BUILDERS = {"NullTokenizer": _null_or_byte, "ByteTokenizer": _null_or_byte,
             "GPT2BPETokenizer": _gpt2_bpe, "TikTokenizer": _tiktoken,
             "HuggingFaceTokenizer": _huggingface,
             **{kind: _sentencepiece for kind in SENTENCEPIECE_TYPES}}


def build_megatron_tokenizer(options: TokenizerOptions):
    """The tokenizer ``options.tokenizer_type`` names (see the module docstring); ValueError
    naming the flag for a missing or wrong one, ImportError naming the package it needs."""
    if options.tokenizer_type is None:
        raise ValueError(f"--tokenizer-type is required (one of {', '.join(TOKENIZER_TYPES)})")
    check_tokenizer_type(options.tokenizer_type)
    if options.tiktoken_pattern is not None and options.tiktoken_pattern not in TIKTOKEN_PATTERNS:
        raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {options.tiktoken_pattern!r}")
    if options.tokenizer_type != "TikTokenizer":
        _refuse_flags(options, ("tiktoken_pattern", "tiktoken_num_special_tokens"),
                      options.tokenizer_type)
    if options.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        # --vocab-size sizes only these two (the trainer checks it against the others' own size)
        options = dataclasses.replace(options, vocab_size=None)
    return _BUILDERS[options.tokenizer_type](options)


def tokenizer_from_spec(spec: str):
    """The tokenizer a JSON spec (``TokenizerOptions.spec()``) records."""
    return build_megatron_tokenizer(TokenizerOptions.from_spec(spec))

