"""Megatron's ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``: a
SentencePiece ``.model`` file run by the ``sentencepiece`` library (the ``sentencepiece`` extra).

Megatron-core 0.16.1's default tokenizer system gives the three types the same ids: the model's
own ``encode_as_ids(text)`` (no BOS / EOS added, special tokens only those trained into the
model), EOD the model's eos id, ``vocab_size`` its piece count. (Megatron's legacy system, behind
``--legacy-tokenizer``, appended ``<CLS> <SEP> <EOD> <MASK>`` to SentencePieceTokenizer's vocabulary
and put a BOS before Llama2Tokenizer's ids; tpfuse follows the default system.)
"""
from __future__ import annotations

from tpfuse._optional import import_optional


class SentencePieceTokenizer:
    """A SentencePiece model: ids ``encode_as_ids(text)``, EOD its eos id."""

    def __init__(self, model_file: str, spec: str):
        sentencepiece = import_optional("sentencepiece", extra="sentencepiece",
                                        feature="a SentencePiece --tokenizer-type")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as err:
            raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model "
                             f"({err})") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the SentencePiece model has no eos "
                             "piece (trained with eos_id=-1), and Megatron's end of document is "
                             "the eos id")
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        self.name = spec

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    def __repr__(self):
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
