"""GPT datasets: windows of ``sequence_length + 1`` tokens over shuffled documents.

``GPTDataset(low_level, dataset_path, indexed_indices, num_samples, index_split, config)`` follows
Megatron-core: ``low_level`` offers ``sequence_lengths`` and ``get(doc, offset, length)`` (an
:class:`~tpfuse.data.indexed.IndexedDataset`, or the synthetic :class:`MockGPTLowLevelDataset`);
``indexed_indices`` are the documents of this split. The document / sample / shuffle indices
(see :mod:`tpfuse.data.indices`) are built from ``config.random_seed`` and, when
``config.path_to_cache`` is set, saved there as ``<md5 of the description>-<Class>-<split>-<kind>.npy``
(written to a temporary name, then ``os.replace``). A cached file that does not load or does not fit
the description is reported with a warning and rebuilt. With ``torch.distributed`` initialised only
global rank 0 writes the cache; other ranks load it (the builder makes them wait for rank 0) or, if
it is unusable, compute the same indices in memory.

``ds[i]`` → ``{"tokens", "labels", "position_ids"}`` int64 ``(s,)``, ``"loss_mask"`` fp32 ``(s,)``
and, only with ``reset_attention_mask``, ``"document_ids"`` int64 ``(s,)`` (EODs before each
token: what the attention takes) — plus ``"attention_mask"`` bool ``(1, s, s)`` (True = masked)
when ``create_attention_mask`` also asks for Megatron's dense mask.
``len(ds)`` counts every sample of the epochs built (at least ``num_samples``).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings

import numpy as np
import torch

from .config import GPTDatasetConfig
from .indexed import IndexedDataset, publish
from .indices import build_gpt_indices, num_epochs_needed, sample_fields, total_samples

CACHE_FORMAT = 1
INDEX_KINDS = ("document_index", "sample_index", "shuffle_index")


class MockGPTLowLevelDataset:
    """A synthetic corpus from the seed: document i has 1..max tokens (its last one EOD), the others
    counting up ``1, 2, 3, ...`` modulo the vocabulary (skipping EOD), so a model can learn it."""

    def __init__(self, seed: int, vocab_size: int, eod: int, num_documents: int, max_length: int):
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, max_length + 1, size=num_documents).astype(np.int32)

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        body = (np.arange(1, size, dtype=np.int64) % (self.vocab_size - 1))
        body += body >= self.eod  # skip the EOD id
        document = np.concatenate([body, [self.eod]])
        return document[offset:offset + length]


def _is_cache_writer() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0


def _save_atomic(path: str, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class GPTDataset(torch.utils.data.Dataset):
    """Megatron-style GPT dataset over one low-level dataset's split (see module docstring)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split: str,
                 config: GPTDatasetConfig):
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(f"num_samples must be a non-negative int or None, got {num_samples!r}")
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indexed_indices = np.asarray(indexed_indices, dtype=np.int64)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self._check_has_tokens()
        self.description = self._describe()
        self.unique_hash = hashlib.md5(
            json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build_indices()
        if len(self) == 0:
            raise ValueError(f"{self.dataset_path or 'mock data'}: the {index_split} split holds fewer than "
                             f"sequence_length + 1 = {config.sequence_length + 1} tokens")

    # ------------------------------------------------------------------------ construction
    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig):
        """The indexed file pair at ``dataset_path``, its ids checked against the tokenizer's vocab."""
        return IndexedDataset(dataset_path, vocab_size=config.tokenizer.vocab_size)

    def _check_has_tokens(self):
        if self.indexed_indices.size == 0 or \
                int(self.dataset.sequence_lengths[self.indexed_indices].astype(np.int64).sum()) == 0:
            raise ValueError(f"{self.dataset_path or 'mock data'}: the {self.index_split} split "
                             f"(documents {self.indexed_indices[:1]}..{self.indexed_indices[-1:]}) holds no "
                             f"tokens; adjust split={self.config.split!r} or add data")

    def _describe(self) -> dict:
        return {
            "class": type(self).__name__, "format": CACHE_FORMAT,
            "dataset_path": os.path.abspath(self.dataset_path) if self.dataset_path else None,
            "dataset_documents": int(len(self.dataset.sequence_lengths)),
            "dataset_tokens": int(self.dataset.sequence_lengths.astype(np.int64).sum()),
            # a regenerated corpus with other document lengths must not reuse old indices
            "dataset_lengths_md5": hashlib.md5(np.ascontiguousarray(
                self.dataset.sequence_lengths, dtype=np.int64).tobytes()).hexdigest(),
            "index_split": self.index_split,
            "index_range": [int(self.indexed_indices[0]), int(self.indexed_indices[-1]) + 1,
                            int(self.indexed_indices.size)],
            "num_samples": self.num_samples,
            "random_seed": self.config.random_seed,
            "sequence_length": self.config.sequence_length,
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
        }

    def _expected_shapes(self) -> dict:
        lengths = self.dataset.sequence_lengths.astype(np.int64)
        tokens = int(lengths[self.indexed_indices].sum())
        s, extra = self.config.sequence_length, int(self.config.add_extra_token_to_sequence)
        epochs = 1 if self.num_samples is None else num_epochs_needed(tokens, self.num_samples, s,
                                                                      extra)
        n = total_samples(tokens, epochs, s, extra)
        return {"document_index": (epochs * self.indexed_indices.size,), "sample_index": (n + 1, 2),
                "shuffle_index": (n,)}

    def cache_paths(self) -> dict | None:
        if self.config.path_to_cache is None or self.dataset_path is None:
            return None
        stem = f"{self.unique_hash}-{type(self).__name__}-{self.index_split}"
        return {kind: os.path.join(self.config.path_to_cache, f"{stem}-{kind}.npy") for kind in INDEX_KINDS}

    def _build_indices(self):
        return build_gpt_indices(self.dataset.sequence_lengths, self.indexed_indices,
                                 self.config.sequence_length, self.num_samples, self.config.random_seed,
                                 int(self.config.add_extra_token_to_sequence))

    def _load_or_build_indices(self):
        paths = self.cache_paths()
        if paths is None:
            return self._build_indices()
        if all(os.path.isfile(p) for p in paths.values()):
            try:
                return self._load_cache(paths)
            except ValueError as err:
                warnings.warn(f"dataset index cache unusable, rebuilding: {err}", stacklevel=3)
        indices = self._build_indices()
        if _is_cache_writer():
            self._write_cache(paths, indices)
        return indices

    def _write_cache(self, paths, indices):
        os.makedirs(self.config.path_to_cache, exist_ok=True)
        for kind, array in zip(INDEX_KINDS, indices):
            _save_atomic(paths[kind], array)
        description = paths["document_index"].replace("-document_index.npy", "-description.json")
        fd, tmp = tempfile.mkstemp(dir=self.config.path_to_cache, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.description, f, indent=2, sort_keys=True)
        publish(tmp, description)

    def _load_cache(self, paths):
        shapes = self._expected_shapes()
        arrays = []
        for kind in INDEX_KINDS:
            try:
                array = np.load(paths[kind], mmap_mode="r", allow_pickle=False)
            except Exception as err:  # a truncated or garbled .npy raises several kinds of errors
                raise ValueError(f"{paths[kind]}: cannot be read as .npy ({err})") from None
            if array.shape != shapes[kind] or array.dtype.kind not in "iu":
                raise ValueError(f"{paths[kind]}: shape {array.shape} dtype {array.dtype}, expected "
                                 f"shape {shapes[kind]} of integers")
            arrays.append(array)
        self._check_cached_values(paths, *arrays)
        return tuple(arrays)

    def _check_cached_values(self, paths, document_index, sample_index, shuffle_index):
        begin, end = int(self.indexed_indices.min()), int(self.indexed_indices.max())
        if document_index.size and (document_index.min() < begin or document_index.max() > end):
            raise ValueError(f"{paths['document_index']}: document ids outside [{begin}, {end}]")
        positions, offsets = sample_index[:, 0], sample_index[:, 1]
        if positions.min() < 0 or positions.max() >= document_index.size or np.any(np.diff(positions) < 0) \
                or offsets.min() < 0:
            raise ValueError(f"{paths['sample_index']}: entries do not walk through the document index")
        n = shuffle_index.size
        if n and not np.array_equal(np.bincount(shuffle_index, minlength=n), np.ones(n, dtype=np.int64)):
            raise ValueError(f"{paths['shuffle_index']}: not a permutation of 0..{n - 1}")

    # ------------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.shuffle_index.size)

    def get_text(self, idx: int) -> np.ndarray:
        """The ``s + 1`` token ids of sample ``idx`` (after the shuffle; ``s`` without
        ``add_extra_token_to_sequence``: the last sample-index entry then locates its last token,
        the others the first token of the next window, which is dropped)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        sample = int(self.shuffle_index[idx])
        (doc_first, offset_first), (doc_last, offset_last) = self.sample_index[sample:sample + 2]
        doc_first, doc_last = int(doc_first), int(doc_last)
        if doc_first == doc_last:
            return np.asarray(self.dataset.get(int(self.document_index[doc_first]), int(offset_first),
                                               int(offset_last - offset_first + 1)), dtype=np.int64)
        parts = [self.dataset.get(int(self.document_index[doc_first]), int(offset_first))]
        parts += [self.dataset.get(int(self.document_index[d])) for d in range(doc_first + 1, doc_last)]
        parts.append(self.dataset.get(int(self.document_index[doc_last]), 0, int(offset_last) + 1))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])

    def __getitem__(self, idx: int) -> dict:
        c = self.config
        text = self.get_text(idx)
        if not c.add_extra_token_to_sequence and text.size > c.sequence_length:
            text = text[:c.sequence_length]
        fields = sample_fields(text, c.tokenizer.eod, c.reset_position_ids,
                               c.reset_attention_mask, c.eod_mask_loss, c.add_extra_token_to_sequence,
                               create_attention_mask=c.create_attention_mask)
        return {name: torch.from_numpy(value) for name, value in fields.items()}

    def __repr__(self):
        return (f"{type(self).__name__}({self.dataset_path!r}, split={self.index_split}, "
                f"samples={len(self)}, documents={self.indexed_indices.size})")


class MockGPTDataset(GPTDataset):
    """GPTDataset over :class:`MockGPTLowLevelDataset` (synthetic, deterministic, never cached)."""

    @staticmethod
    def build_low_level_dataset(dataset_path, config: GPTDatasetConfig):
        return MockGPTLowLevelDataset(config.random_seed, config.tokenizer.vocab_size, config.tokenizer.eod,
                                      config.mock_num_documents, config.mock_max_document_length)

    def cache_paths(self):
        return None
