"""Indexed .bin/.idx files: writer → reader round trip, Megatron's MMIDIDX layout, and every kind of
corruption failing at open with a ValueError that names the file and the problem."""
import os
import struct

import numpy as np
import pytest

from tpfuse.data.indexed import (HEADER_SIZE, MAGIC, IndexedDataset, IndexedDatasetWriter, token_dtype,
                                 write_indexed_dataset)

DOCS = [[104, 105, 256], [], [1, 2, 3, 4, 5, 256], [255] * 7, [0]]


@pytest.fixture
def prefix(tmp_path):
    path = str(tmp_path / "corpus")
    write_indexed_dataset(path, DOCS, vocab_size=257)
    return path


def test_round_trip_and_megatron_layout(prefix):
    ds = IndexedDataset(prefix, vocab_size=257)
    assert len(ds) == len(DOCS) and ds.dtype == np.uint16 and ds.num_tokens == sum(map(len, DOCS))
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == doc
    assert ds.get(2, 1, 3).tolist() == [2, 3, 4]
    assert ds.get(2, 4).tolist() == [5, 256]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)
    # the header, read by hand: Megatron's MMIDIDX v1, dtype code 8 (uint16), n_seq, n_doc = n_seq + 1
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == MAGIC
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:HEADER_SIZE])
    assert (version, code, n_seq, n_doc) == (1, 8, 5, 6)
    lengths = np.frombuffer(raw, np.int32, n_seq, HEADER_SIZE)
    pointers = np.frombuffer(raw, np.int64, n_seq, HEADER_SIZE + 4 * n_seq)
    assert lengths.tolist() == [3, 0, 6, 7, 1]
    assert pointers.tolist() == [0, 6, 6, 18, 32]  # byte offsets: 2 bytes per uint16 token
    assert os.path.getsize(prefix + ".bin") == 2 * 17


def test_large_vocab_uses_int32(tmp_path):
    assert token_dtype(65534) == np.uint16 and token_dtype(65535) == np.int32
    path = str(tmp_path / "big")
    write_indexed_dataset(path, [[70000, 1], [65535]], vocab_size=70001)
    ds = IndexedDataset(path, vocab_size=70001)
    assert ds.dtype == np.int32 and ds[0].tolist() == [70000, 1] and ds[1].tolist() == [65535]


def test_writer_is_atomic(tmp_path):
    path = str(tmp_path / "partial")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(path, vocab_size=257) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []  # neither final names nor temporary files
    with pytest.raises(ValueError, match=r"\[0, 257\)"):
        with IndexedDatasetWriter(path, vocab_size=257) as writer:
            writer.add_document([1, 300])
    assert os.listdir(tmp_path) == []


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, remove):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - remove)


@pytest.mark.parametrize("corrupt, file, message", [
    (lambda p: _patch(p + ".idx", 0, b"XX"), ".idx", "magic"),
    (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), ".idx", "version 2"),
    (lambda p: _patch(p + ".idx", 17, bytes([9])), ".idx", "dtype code 9"),
    (lambda p: _truncate(p + ".idx", 3), ".idx", "truncated .idx"),
    (lambda p: _truncate(p + ".idx", HEADER_SIZE + 100), ".idx", "truncated .idx"),
    (lambda p: _truncate(p + ".bin", 2), ".bin", "truncated .bin"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), ".bin", "oversized .bin"),
    # sequence 3's byte offset (18) changed to 20: no longer the sum of the lengths before it
    (lambda p: _patch(p + ".idx", HEADER_SIZE + 4 * 5 + 8 * 3, struct.pack("<q", 20)), ".idx", "byte offset"),
    # token 0 (104) overwritten with 300 >= vocab 257
    (lambda p: _patch(p + ".bin", 0, struct.pack("<H", 300)), ".bin", "token id 300 at token 0"),
])
def test_corruption_fails_at_open_naming_the_file(prefix, corrupt, file, message):
    IndexedDataset(prefix, vocab_size=257)  # valid before
    corrupt(prefix)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix, vocab_size=257)
    assert prefix + file in str(info.value)


def test_vocab_mismatch_and_missing_files(prefix):
    # 256 (the byte tokenizer's EOD) is fine for vocab 257 but not for a 256-id vocabulary
    with pytest.raises(ValueError, match=r"token id 256 at token 2 is outside the vocabulary \[0, 256\)"):
        IndexedDataset(prefix, vocab_size=256)
    IndexedDataset(prefix)  # no vocabulary given: no scan
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"corpus\.bin"):
        IndexedDataset(prefix)


def test_empty_dataset(tmp_path):
    path = str(tmp_path / "empty")
    write_indexed_dataset(path, [], vocab_size=257)
    ds = IndexedDataset(path, vocab_size=257)
    assert len(ds) == 0 and ds.num_tokens == 0
