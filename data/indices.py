"""Pure index arithmetic for GPT datasets (numpy only, no files, no torch).

The three indices of Megatron's GPTDataset, for a set of ``documents`` (ids into a low-level
dataset with ``sequence_lengths``) and samples of ``s = sequence_length`` tokens:

- document index: the documents repeated for ``num_epochs`` epochs, each epoch an independent
  permutation drawn from the seeded ``RandomState`` → ``(num_epochs · len(documents),)``.
- sample index: concatenate the documents in document-index order into one token stream; sample
  ``i`` is the window of ``s + 1`` tokens starting at stream position ``i · s`` (consecutive samples
  share one token: the last label of sample i is the first token of sample i + 1); with
  ``extra_tokens=0`` (Megatron's ``add_extra_token_to_sequence=False``) windows of ``s`` tokens. Entry ``i`` is the
  (document-index position, offset in that document) of position ``i · s``; ``num_samples + 1``
  entries, the last one locating the final token of the last sample → ``(num_samples + 1, 2)``.
- shuffle index: a permutation of the sample ids drawn from the same ``RandomState``. When the final
  epoch is only partly needed (< 80 % of an epoch's samples, Megatron's rule), the samples of the
  full epochs and those reaching into the final epoch are shuffled separately, so the first
  ``num_samples`` shuffled ids use every full epoch completely.

Megatron's greedy blending (``blending_indices``): sample i goes to the dataset with the largest
``weight · max(i, 1) − count_so_far`` (ties → lowest dataset id).
"""
from __future__ import annotations

import numpy as np

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, sequence_length: int,
                      extra_tokens: int = 1) -> int:
    """Fewest epochs whose tokens cover ``num_samples`` windows of ``sequence_length +
    extra_tokens`` tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the documents of this split hold no tokens")
    needed = num_samples * sequence_length + extra_tokens
    return max(1, -(-needed // tokens_per_epoch))


def total_samples(tokens_per_epoch: int, num_epochs: int, sequence_length: int,
                  extra_tokens: int = 1) -> int:
    """Samples that ``num_epochs`` epochs hold (the last window needs ``extra_tokens`` more)."""
    return (num_epochs * tokens_per_epoch - extra_tokens) // sequence_length


def full_epoch_samples(tokens_per_epoch, num_epochs, sequence_length, num_samples,
                       extra_tokens: int = 1) -> int:
    """Samples to shuffle apart from the final epoch's (= all samples when not separated)."""
    everything = total_samples(tokens_per_epoch, num_epochs, sequence_length, extra_tokens)
    if num_epochs == 1:
        return everything
    before_final = total_samples(tokens_per_epoch, num_epochs - 1, sequence_length, extra_tokens)
    from_final = num_samples - before_final
    per_epoch = total_samples(tokens_per_epoch, 1, sequence_length, extra_tokens)
    separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    return before_final if separate else everything


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """Each epoch a fresh permutation of ``documents`` → ``(num_epochs · len(documents),)`` int64."""
    documents = np.asarray(documents, dtype=np.int64)
    return np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       sequence_length: int, num_samples: int, extra_tokens: int = 1) -> np.ndarray:
    """(position in document_index, offset) of stream position ``i · s`` for i = 0..num_samples
    (the last one ``n·s − 1`` when ``extra_tokens=0``: the final token of the last window)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]  # (D,)
    ends = np.cumsum(lengths)  # stream position one past each document
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length  # (n+1,)
    if not extra_tokens and num_samples:
        positions[-1] -= 1
    if num_samples and positions[-1] >= ends[-1]:
        raise ValueError(f"{num_samples} samples of {sequence_length} tokens need "
                         f"{positions[-1] + 1} tokens, the document index holds {ends[-1]}")
    doc_pos = np.searchsorted(ends, positions, side="right")  # first document ending after the position
    offsets = positions - (ends[doc_pos] - lengths[doc_pos])
    return np.stack([doc_pos, offsets], axis=1)  # (n+1, 2)


def build_shuffle_index(num_first: int, num_total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``0..num_first-1`` followed by a permutation of ``num_first..num_total-1``."""
    first = rng.permutation(num_first).astype(np.int64)
    if num_first == num_total:
        return first
    return np.concatenate([first, num_first + rng.permutation(num_total - num_first).astype(np.int64)])


def build_gpt_indices(sequence_lengths, documents, sequence_length, num_samples, seed,
                      extra_tokens: int = 1):
    """The three indices of one GPT dataset split, deterministically from ``seed``.

    ``num_samples=None`` means one epoch. Returns (document_index, sample_index, shuffle_index).
    With ``extra_tokens=0`` the last sample-index entry locates the token after the last sample.
    """
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(np.asarray(sequence_lengths, dtype=np.int64)[documents].sum())
    if num_samples is None:
        num_epochs = 1
        num_samples = total_samples(tokens_per_epoch, 1, sequence_length, extra_tokens)
    else:
        num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, sequence_length,
                                       extra_tokens)
    num_total = total_samples(tokens_per_epoch, num_epochs, sequence_length, extra_tokens)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng)
    sample_index = build_sample_index(sequence_lengths, document_index, sequence_length, num_total,
                                      extra_tokens)
    num_first = full_epoch_samples(tokens_per_epoch, num_epochs, sequence_length, num_samples,
                                   extra_tokens)
    shuffle_index = build_shuffle_index(num_first, num_total, rng)
    return document_index, sample_index, shuffle_index


def sample_fields(text: np.ndarray, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                  eod_mask_loss: bool, extra_token: bool = True, pad_label: int = -100,
                  create_attention_mask: bool = False) -> dict:
    """A window of s + 1 token ids → Megatron's training fields (numpy), each ``(s,)``.

    tokens = text[:-1], labels = text[1:]; without ``extra_token`` (a window of s ids) tokens =
    text, labels = text shifted left with ``pad_label`` last (loss_mask 0 there, as Megatron's
    pad label); loss_mask 0 where the *input* token is EOD (with eod_mask_loss); position_ids
    restart at 0 after every EOD (with reset_position_ids).
    With reset_attention_mask no query attends across an EOD to an earlier document:
    ``document_ids`` int64 ``(s,)`` = the number of EODs strictly before each position (an EOD
    belongs to the document it ends), what the attention takes; with create_attention_mask also
    Megatron's dense ``attention_mask`` ``(1, s, s)`` bool, True where attention is NOT allowed
    (causal and same document).
    """
    text = np.asarray(text, dtype=np.int64)
    if extra_token:
        tokens, labels = text[:-1], text[1:]
    else:
        tokens, labels = text, np.concatenate([text[1:], [pad_label]])
    s = tokens.size
    is_eod = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if not extra_token:
        loss_mask[-1] = 0.0
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        after_eod = np.where(is_eod, position_ids + 1, 0)  # a document starts after each EOD
        starts = np.concatenate([[0], np.maximum.accumulate(after_eod)[:-1]])
        position_ids = position_ids - starts
    fields = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if reset_attention_mask:
        segment = np.concatenate([[0], np.cumsum(is_eod)[:-1]])  # EODs strictly before each position
        fields["document_ids"] = segment.astype(np.int64)
    if reset_attention_mask and create_attention_mask:
        causal = np.tril(np.ones((s, s), dtype=bool))
        allowed = causal & (segment[:, None] == segment[None, :])
        fields["attention_mask"] = ~allowed[None]  # (1, s, s)
    return fields


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: (dataset id, sample id within that dataset) of each of ``size`` samples."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        scale = max(i, 1)
        errors = [w * scale - c for w, c in zip(weights, counts)]
        best = max(range(len(errors)), key=lambda d: (errors[d], -d))  # largest error, lowest id on ties
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index
