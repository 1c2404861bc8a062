"""Megatron's ``HuggingFaceTokenizer`` from a local transformers tokenizer folder (one holding a
``tokenizer_config.json``, as ``save_pretrained`` writes it), run by ``transformers`` (the ``hf``
extra), as Megatron-core 0.16.1's default tokenizer system runs it.

``AutoTokenizer.from_pretrained(folder)`` loads it (local files only: nothing is downloaded, no
remote code runs). Ids are ``convert_tokens_to_ids(tokenize(text))`` — no BOS / EOS added — or,
with ``--tokenizer-hf-include-special-tokens``, ``tokenizer(text).input_ids`` (what the tokenizer
adds around the text included). EOD is the eos token's id (the sep token where the tokenizer has
no eos, as Megatron sets it); ``vocab_size`` is ``len(tokenizer)`` (added tokens included);
``--tokenizer-special-tokens`` are added as additional special tokens, growing it.

A folder holding only a ``tokenizer.json`` (no ``tokenizer_config.json``) is read by the
``tokenizers`` library instead (``data.tokenizer_builtin.HFTokenizer``, its EOD guessed).
"""
from __future__ import annotations

import os

from tpfuse._optional import import_optional

CONFIG_FILE = "tokenizer_config.json"


def is_transformers_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


class HuggingFaceAutoTokenizer:
    """transformers' AutoTokenizer of a local folder; EOD its eos (else sep) token."""

    def __init__(self, folder: str, use_fast: bool, include_special_tokens: bool,
                 special_tokens, spec: str):
        transformers = import_optional("transformers", extra="hf",
                                       feature="--tokenizer-type HuggingFaceTokenizer with a "
                                               "tokenizer folder")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(
                folder, use_fast=use_fast, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--tokenizer-model {folder}: transformers cannot load this "
                             f"tokenizer folder ({err})") from None
        if special_tokens:
            self._tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        eod_token = self._tok.eos_token or self._tok.sep_token
        if eod_token is None:
            raise ValueError(f"--tokenizer-model {folder}: the tokenizer has neither an eos nor a "
                             "sep token, and Megatron's end of document is the eos token")
        self.include_special_tokens = include_special_tokens
        self.vocab_size = len(self._tok)
        self.eod = self._tok.convert_tokens_to_ids(eod_token)
        self.bos = self._tok.bos_token_id
        self.name = spec

    def tokenize(self, text: str) -> list[int]:
        if self.include_special_tokens:
            return list(self._tok(text).input_ids)
        return self._tok.convert_tokens_to_ids(self._tok.tokenize(text))

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self):
        return f"HuggingFaceAutoTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
