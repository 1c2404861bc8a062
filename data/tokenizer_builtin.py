"""The tokenizers a spec string names directly: ``"byte"``, ``"null:N"`` and a ``tokenizer.json``.

- :class:`ByteTokenizer` (built in, no dependency): ids ``0..255`` are the UTF-8 bytes of the text,
  id ``256`` is EOD; ``vocab_size == 257``. Round trips every byte string exactly.
- :class:`NullTokenizer` (for ``--mock-data --vocab-size N``): Megatron's null tokenizer — ids
  ``0..N-1`` carry no text, EOD is ``N``, ``vocab_size == N + 1``.
- :class:`HFTokenizer` (optional): a HuggingFace ``tokenizers`` BPE/WordPiece/... model loaded from a
  ``tokenizer.json``. Needs the ``tokenizers`` package, imported only when this class is used.

Each has the surface of ``tokenizer.py``'s docstring; ``tokenizer.build_tokenizer`` builds them
from their spec, ``tokenizer_options.py`` for Megatron's ``NullTokenizer`` / ``ByteTokenizer`` /
``HuggingFaceTokenizer`` types.
"""
from __future__ import annotations

import os

import numpy as np

from tpfuse._optional import import_optional

BYTE_VOCAB = 256
BYTE_EOD = 256

# tokens a tokenizer.json commonly uses to end a document, tried in this order
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """Byte-level tokenizer: id = byte value (0..255), EOD = 256, vocab_size = 257."""

    name = "byte"
    vocab_size = BYTE_VOCAB + 1
    eod = BYTE_EOD

    def tokenize(self, text: str | bytes) -> list[int]:
        return self.tokenize_array(text).tolist()

    def tokenize_array(self, text: str | bytes) -> np.ndarray:
        """The ids as a uint8 array (zero-copy for ``bytes`` input)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) != self.eod]
        bad = [i for i in ids if not 0 <= i < BYTE_VOCAB]
        if bad:
            raise ValueError(f"ByteTokenizer.detokenize: ids {bad[:5]} are outside 0..255")
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer(vocab_size=257, eod=256)"


class NullTokenizer:
    """Megatron's null tokenizer: ids 0..N-1 are opaque, EOD = N, vocab_size = N + 1."""

    def __init__(self, vocab_size: int):
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"NullTokenizer: vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.name = f"null:{vocab_size}"

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self):
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


class HFTokenizer:
    """A HuggingFace ``tokenizers`` model from a tokenizer.json (optional dependency).

    EOD: ``eod_token`` if given, else the first of ``<|endoftext|>``, ``</s>``, ... present in the
    vocabulary, else a new id one past the vocabulary (then ``vocab_size`` grows by one).
    """

    def __init__(self, path: str, eod_token: str | None = None):
        tokenizers = import_optional("tokenizers", extra="hf", feature=f"tokenizer {path!r}",
                                     instead="use --tokenizer byte")
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer: file {path!r} does not exist")
        self._tok = tokenizers.Tokenizer.from_file(path)
        base_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(eod_token, path)
        if self.eod is None:
            self.eod = base_size
        self.vocab_size = max(base_size, self.eod + 1)
        self.name = f"hf:{os.path.abspath(path)}"

    def _find_eod(self, eod_token, path):
        if eod_token is not None:
            eod = self._tok.token_to_id(eod_token)
            if eod is None:
                raise ValueError(f"tokenizer {path!r}: eod_token {eod_token!r} is not in its vocabulary")
            return eod
        for candidate in _EOD_CANDIDATES:
            eod = self._tok.token_to_id(candidate)
            if eod is not None:
                return eod
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod])

    def __repr__(self):
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"
