"""Variable-length micro-batches (SFT style) for ``--variable-seq-lengths``.

``DocumentDataset(low_level, seq_length, pad_to_multiple_of)``: sample i is one whole document
(its first ``seq_length + 1`` tokens), not a window packed across documents: ``tokens`` are its
first n tokens, ``labels`` the n after them (n ≤ seq_length), ``loss_mask`` ones, ``position_ids``
``0 .. n−1``. Its ``collate`` pads a micro-batch to L = its longest sample rounded up to
``pad_to_multiple_of`` (never to ``seq_length``): tokens and labels with 0, position ids counting
on, loss mask 0, so the padding adds nothing to the loss. The micro-batch lengths then differ
and each is ≤ seq_length when seq_length is a multiple of ``pad_to_multiple_of``
(``sequence_length_multiple`` gives the one a layout needs). The data loader
(``data/sampler.py``) collates with a dataset's ``collate`` when it has one.

``check_micro_batch_length(L, ...)``: what a micro-batch's length must satisfy — without
``--variable-seq-lengths`` L = --seq-length; with it L ≤ --seq-length, divisible by 2·cp under
context parallelism (the load-balanced chunks) and by tp under sequence parallelism (its times
2·cp with both). ``pretrain`` checks every micro-batch it reads, before its forward.
"""
from __future__ import annotations

import numpy as np
import torch


def sequence_length_multiple(tp_size: int = 1, cp_size: int = 1,
                             sequence_parallel: bool = False) -> int:
    """The multiple every micro-batch length needs: 2·cp (cp > 1) times tp (sequence parallel
    with tp > 1); 1 otherwise."""
    return (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1)


def _needed_multiple_text(tp_size, cp_size, sequence_parallel) -> str:
    parts = []
    if cp_size > 1:
        parts.append(f"2 × --context-parallel-size {cp_size}")
    if sequence_parallel and tp_size > 1:
        parts.append(f"--tensor-model-parallel-size {tp_size} (--sequence-parallel)")
    return " × ".join(parts)


def check_micro_batch_length(length: int, seq_length: int, variable_seq_lengths: bool,
                             tp_size: int = 1, cp_size: int = 1,
                             sequence_parallel: bool = False) -> None:
    """ValueError naming the length and the flags when a micro-batch of ``length`` tokens cannot
    run (see the module docstring)."""
    if not variable_seq_lengths:
        if length != seq_length:
            raise ValueError(f"a micro-batch of sequence length {length} with --seq-length "
                             f"{seq_length}: micro-batches of other lengths need "
                             f"--variable-seq-lengths (each pipeline message then carries its "
                             f"shape)")
        return
    if not 0 < length <= seq_length:
        raise ValueError(f"a micro-batch of sequence length {length}: --variable-seq-lengths "
                         f"takes lengths from 1 to --seq-length {seq_length}")
    multiple = sequence_length_multiple(tp_size, cp_size, sequence_parallel)
    if length % multiple:
        raise ValueError(f"a micro-batch of sequence length {length} is not divisible by "
                         f"{_needed_multiple_text(tp_size, cp_size, sequence_parallel)} = "
                         f"{multiple} (--variable-seq-lengths): pad each micro-batch to a "
                         f"multiple of {multiple} (DocumentDataset(pad_to_multiple_of="
                         f"{multiple}))")


class DocumentDataset(torch.utils.data.Dataset):
    """One document per sample, of its own length (see the module docstring). ``low_level``:
    anything with ``sequence_lengths`` and ``get(i)`` (an ``IndexedDataset``, a
    ``MockGPTLowLevelDataset``); documents of fewer than 2 tokens hold no sample and are left
    out. ``num_samples``: cycle over the documents up to this many samples (default: each once).
    """

    variable_seq_lengths = True     # pretrain refuses it without --variable-seq-lengths

    def __init__(self, low_level, seq_length: int, pad_to_multiple_of: int = 1,
                 num_samples: int | None = None):
        if seq_length % pad_to_multiple_of:
            raise ValueError(f"seq_length={seq_length} is not a multiple of pad_to_multiple_of="
                             f"{pad_to_multiple_of}: a padded micro-batch could exceed it")
        self.low_level, self.seq_length = low_level, seq_length
        self.pad_to_multiple_of = pad_to_multiple_of
        lengths = np.asarray(low_level.sequence_lengths)
        self.documents = np.flatnonzero(lengths >= 2)
        if self.documents.size == 0:
            raise ValueError("DocumentDataset: no document has 2 tokens or more")
        self.num_samples = self.documents.size if num_samples is None else num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        document = int(self.documents[idx % self.documents.size])
        size = min(int(self.low_level.sequence_lengths[document]), self.seq_length + 1)
        text = torch.from_numpy(np.asarray(self.low_level.get(document, 0, size), dtype=np.int64))
        n = text.numel() - 1
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(n),
                "position_ids": torch.arange(n)}

    def collate(self, samples: list[dict]) -> dict:
        """Stacked ``(b, L)`` fields, L = the longest sample rounded up to
        ``pad_to_multiple_of``; padding: ids 0, positions counting on, loss mask 0."""
        longest = max(sample["tokens"].numel() for sample in samples)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return {name: torch.stack([_padded(name, sample[name], length) for sample in samples])
                for name in samples[0]}


def _padded(name: str, values: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - values.numel()
    if name == "position_ids":
        return torch.arange(length)
    return torch.cat([values, values.new_zeros(extra)])
