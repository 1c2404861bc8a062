"""Indexed token files: a ``.bin`` of raw token ids plus an ``.idx`` describing where each sequence lies.

The layout is Megatron-core's ``MMIDIDX`` format, so files written here load in Megatron and files
preprocessed by Megatron load here. All integers little-endian::

    .idx  magic      9 bytes  b"MMIDIDX\\x00\\x00"
          version    uint64   1
          dtype code uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
          n_seq      uint64   number of sequences
          n_doc      uint64   number of entries of document_indices (= documents + 1)
          sequence_lengths   int32[n_seq]   tokens per sequence
          sequence_pointers  int64[n_seq]   byte offset of each sequence in the .bin
          document_indices   int64[n_doc]   sequence index where each document starts, then n_seq
    .bin  token ids of all sequences back to back, in the dtype above

tpfuse writes one sequence per document (document_indices = 0..n_seq) and, like Megatron's
GPTDataset, treats each sequence as a document when sampling.

Token dtype: uint16 when the vocabulary has fewer than 65535 ids, else int32 (:func:`token_dtype`).

:class:`IndexedDataset` opens a pair read-only through ``numpy.memmap`` and validates it at open;
anything inconsistent raises ``ValueError`` naming the file and what is wrong.
:class:`IndexedDatasetWriter` writes a pair atomically (temporary names, ``os.replace`` at the end).
"""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_FORMAT = "<9sQBQQ"  # magic, version, dtype code, n_seq, n_doc
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)  # 34 bytes

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

_SCAN_CHUNK = 1 << 24  # tokens per block when scanning the .bin for out-of-vocabulary ids


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every id of a vocabulary: uint16 below 65535 ids, else int32."""
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return np.dtype(np.uint16) if vocab_size < 65535 else np.dtype(np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def publish(tmp_path: str, final_path: str) -> None:
    """Gives a finished temporary file the usual permissions (mkstemp makes it 0600) and moves it
    to its final name atomically."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    os.replace(tmp_path, final_path)


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


# --------------------------------------------------------------------------------------- writing
class IndexedDatasetWriter:
    """Writes ``prefix.bin`` / ``prefix.idx``; nothing appears under those names until ``finalize``.

    >>> with IndexedDatasetWriter("out/corpus", vocab_size=257) as w:
    ...     w.add_document([104, 105, 256])
    """

    def __init__(self, prefix: str, vocab_size: int | None = None, dtype=None):
        if (vocab_size is None) == (dtype is None):
            raise ValueError("IndexedDatasetWriter: give exactly one of vocab_size or dtype")
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(vocab_size)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"IndexedDatasetWriter: dtype {self.dtype} is not an integer token dtype "
                             f"({sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())})")
        self.prefix = prefix
        self.vocab_size = vocab_size
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        fd, self._tmp_bin = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".bin")
        self._bin = os.fdopen(fd, "wb")
        self._lengths: list[int] = []
        self._done = False

    def add_document(self, ids) -> None:
        """Appends one document (a sequence of token ids)."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"add_document: expected a 1-d sequence of ids, got shape {array.shape}")
        if array.size and (array.min() < 0 or (self.vocab_size is not None and array.max() >= self.vocab_size)):
            raise ValueError(f"add_document: ids must lie in [0, {self.vocab_size}), got min "
                             f"{array.min()} max {array.max()} (document {len(self._lengths)})")
        self._bin.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self._lengths.append(int(array.size))

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def finalize(self) -> None:
        """Writes the .idx, then moves both files to their final names (bin first, then idx)."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.prefix}: a document of {lengths.max()} tokens exceeds int32 lengths")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        header = struct.pack(HEADER_FORMAT, MAGIC, VERSION, CODE_OF_DTYPE[self.dtype],
                             len(lengths), len(document_indices))
        fd, tmp_idx = tempfile.mkstemp(dir=os.path.dirname(self._tmp_bin), prefix=".tmp-", suffix=".idx")
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(document_indices.tobytes())
        publish(self._tmp_bin, bin_path(self.prefix))
        publish(tmp_idx, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Removes the temporary files (nothing was published)."""
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        elif not self._done:
            self.abort()


def write_indexed_dataset(prefix: str, documents, vocab_size: int) -> None:
    """Writes every document of an iterable of id sequences to ``prefix.bin`` / ``prefix.idx``."""
    with IndexedDatasetWriter(prefix, vocab_size=vocab_size) as writer:
        for doc in documents:
            writer.add_document(doc)


# --------------------------------------------------------------------------------------- reading
def _read_header(path: str, file_size: int):
    if file_size < HEADER_SIZE:
        raise ValueError(f"{path}: truncated .idx: {file_size} bytes, the header alone is {HEADER_SIZE}")
    with open(path, "rb") as f:
        magic, version, code, n_seq, n_doc = struct.unpack(HEADER_FORMAT, f.read(HEADER_SIZE))
    if magic != MAGIC:
        raise ValueError(f"{path}: not an indexed-dataset index: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"{path}: unsupported .idx version {version} (this reader knows {VERSION})")
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
    expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
    if file_size != expected:
        what = "truncated" if file_size < expected else "trailing bytes in"
        raise ValueError(f"{path}: {what} .idx: {file_size} bytes, but its header "
                         f"({n_seq} sequences, {n_doc} document indices) needs {expected}")
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc


def _check_layout(prefix, lengths, pointers, document_indices, dtype, bin_size):
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"{ipath}: negative sequence length {lengths.min()}")
    expected_pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=expected_pointers[1:])
    if not np.array_equal(pointers, expected_pointers):
        bad = int(np.flatnonzero(pointers != expected_pointers)[0])
        raise ValueError(f"{ipath}: byte offset of sequence {bad} is {pointers[bad]}, but the lengths "
                         f"before it put it at {expected_pointers[bad]}")
    expected_bin = int(lengths.astype(np.int64).sum()) * dtype.itemsize
    if bin_size != expected_bin:
        what = "truncated" if bin_size < expected_bin else "oversized"
        raise ValueError(f"{bpath}: {what} .bin: {bin_size} bytes, but {ipath} describes "
                         f"{expected_bin} bytes ({lengths.sum()} tokens of {dtype})")
    if (document_indices.size == 0 or document_indices[0] != 0 or document_indices[-1] != lengths.size
            or np.any(np.diff(document_indices) < 0)):
        raise ValueError(f"{ipath}: document indices must rise from 0 to {lengths.size} "
                         f"(the sequence count), got {document_indices[:3]}...{document_indices[-3:]}")


def _check_vocab(prefix, tokens, vocab_size):
    for start in range(0, tokens.size, _SCAN_CHUNK):
        block = tokens[start:start + _SCAN_CHUNK]
        high, low = int(block.max()), int(block.min())
        if high >= vocab_size or low < 0:
            bad = start + int(np.flatnonzero((block >= vocab_size) | (block < 0))[0])
            raise ValueError(f"{bin_path(prefix)}: token id {int(tokens[bad])} at token {bad} is outside "
                             f"the vocabulary [0, {vocab_size}) (wrong tokenizer or corrupt file?)")


class IndexedDataset:
    """Read-only view of ``prefix.bin`` / ``prefix.idx`` (memory-mapped), validated at open.

    ``vocab_size``: when given, every token id must be < vocab_size (one scan of the .bin).
    ``ds[i]`` → the i-th sequence as a numpy array; ``ds.get(i, offset, length)`` → a slice of it.
    """

    def __init__(self, prefix: str, vocab_size: int | None = None):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset {prefix!r}: missing file {path}")
        self.dtype, n_seq, n_doc = _read_header(ipath, os.path.getsize(ipath))
        index = np.memmap(ipath, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, dtype=np.int32, count=n_seq, offset=offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(index, dtype=np.int64, count=n_seq, offset=offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(index, dtype=np.int64, count=n_doc, offset=offset)
        bin_size = os.path.getsize(bpath)
        _check_layout(prefix, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                      self.dtype, bin_size)
        self.num_tokens = bin_size // self.dtype.itemsize
        self.tokens = (np.memmap(bpath, mode="r", dtype=self.dtype) if bin_size
                       else np.zeros(0, dtype=self.dtype))  # (num_tokens,)
        if vocab_size is not None and self.num_tokens:
            _check_vocab(prefix, self.tokens, vocab_size)

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (to its end when length is None)."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if not (0 <= offset and length >= 0 and offset + length <= size):
            raise IndexError(f"{self.prefix}: slice [{offset}, {offset + length}) outside sequence {i} "
                             f"of length {size}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __repr__(self):
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")
