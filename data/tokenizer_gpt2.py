"""Megatron's ``GPT2BPETokenizer``: GPT-2's byte-level BPE from a ``vocab.json`` and a
``merges.txt``, run by the ``tokenizers`` library (the ``hf`` extra).

Ids are GPT-2's: text split by GPT-2's pre-tokenizer regex, each piece's UTF-8 bytes mapped to
GPT-2's printable byte alphabet, merged by ``merges.txt``'s ranks, looked up in ``vocab.json``
(no prefix space; the text is taken literally, so ``<|endoftext|>`` written in a document is
plain text, as in Megatron's GPT-2 tokenizer, which knows no special tokens). EOD is
``vocab["<|endoftext|>"]``; ``vocab_size`` is the number of entries of ``vocab.json``.
"""
from __future__ import annotations

import json

from tpfuse._optional import import_optional

GPT2_EOD_TOKEN = "<|endoftext|>"


def _read_vocab(vocab_file: str) -> dict:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--vocab-file {vocab_file}: not a readable JSON vocabulary ({err})") \
            from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object token -> id "
                         "(GPT-2's vocab.json)")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"--vocab-file {vocab_file}: the ids must be 0..{len(vocab) - 1}, each "
                         "once (GPT2BPETokenizer's vocab_size is the number of entries)")
    return vocab


class GPT2BPETokenizer:
    """GPT-2 BPE over ``vocab_file`` + ``merge_file``; EOD ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str, spec: str):
        tokenizers = import_optional("tokenizers", extra="hf",
                                     feature="--tokenizer-type GPT2BPETokenizer")
        vocab = _read_vocab(vocab_file)
        if GPT2_EOD_TOKEN not in vocab:
            raise ValueError(f"--vocab-file {vocab_file}: GPT2BPETokenizer's end of document "
                             f"{GPT2_EOD_TOKEN!r} is not in the vocabulary")
        try:
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:     # the library's parse errors carry no common type
            raise ValueError(f"--merge-file {merge_file}: not GPT-2 merges for --vocab-file "
                             f"{vocab_file} ({err})") from None
        self._tok = tokenizers.Tokenizer(model)
        self._tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = tokenizers.decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = vocab[GPT2_EOD_TOKEN]
        self.name = spec

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self):
        return f"GPT2BPETokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
