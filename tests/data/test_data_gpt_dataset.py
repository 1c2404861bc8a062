"""GPTDataset / MockGPTDataset: samples checked against hand-computed windows and a naive reference
of the documented algorithm; determinism from the seed; the index cache (reuse, corruption)."""
import glob
import os

import numpy as np
import pytest
import torch

from tpfuse.data import (ByteTokenizer, GPTDataset, GPTDatasetConfig, IndexedDataset, MockGPTDataset,
                         NullTokenizer, write_indexed_dataset)
from tpfuse.data import gpt_dataset as gpt_module
from tpfuse.data.indices import sample_fields

EOD = 256


def _config(seq, seed=1, cache=None, **kw):
    return GPTDatasetConfig(random_seed=seed, sequence_length=seq, tokenizer=ByteTokenizer(),
                            blend=["unused"], path_to_cache=cache, **kw)


def _dataset(tmp_path, docs, seq, num_samples=None, seed=1, cache=None, **kw):
    prefix = str(tmp_path / "corpus")
    if not os.path.exists(prefix + ".bin"):
        write_indexed_dataset(prefix, docs, vocab_size=257)
    config = _config(seq, seed, cache, **kw)
    low = GPTDataset.build_low_level_dataset(prefix, config)
    return GPTDataset(low, prefix, np.arange(len(docs)), num_samples, "train", config)


def _texts(ds):
    return [ds.get_text(i).tolist() for i in range(len(ds))]


def test_hand_computed_windows_cross_documents(tmp_path):
    d0, d1 = [1, 2, 3, EOD], [5, 6, 7, 8, EOD]  # 9 tokens, s = 4 → (9 - 1) // 4 = 2 samples
    ds = _dataset(tmp_path, [d0, d1], seq=4)
    assert len(ds) == 2 and sorted(ds.document_index.tolist()) == [0, 1]
    # windows of s + 1 = 5 tokens starting every 4 tokens; consecutive windows share one token
    expected = {(0, 1): [[1, 2, 3, EOD, 5], [5, 6, 7, 8, EOD]],  # stream 1 2 3 E 5 6 7 8 E
                (1, 0): [[5, 6, 7, 8, EOD], [EOD, 1, 2, 3, EOD]]}  # stream 5 6 7 8 E 1 2 3 E
    windows = expected[tuple(ds.document_index.tolist())]
    assert sorted(_texts(ds)) == sorted(windows)
    sample = ds[0]
    text = windows[int(ds.shuffle_index[0])]
    assert sample["tokens"].tolist() == text[:-1] and sample["labels"].tolist() == text[1:]
    assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
    assert sample["loss_mask"].dtype == torch.float32 and sample["position_ids"].tolist() == [0, 1, 2, 3]
    assert "attention_mask" not in sample


def test_matches_naive_reference_over_epochs(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n).tolist() + [EOD] for n in [0, 3, 1, 9, 0, 2, 5, 1]]  # 30 tokens
    seq, num_samples, seed = 7, 9, 3  # 9 × 7 + 1 = 64 tokens → 3 epochs (90 tokens) → 12 samples
    ds = _dataset(tmp_path, docs, seq, num_samples, seed)
    # the documented algorithm, naively: per-epoch permutations, one token stream, windows, shuffle
    state = np.random.RandomState(seed)
    order = np.concatenate([state.permutation(len(docs)) for _ in range(3)])
    stream = np.concatenate([docs[d] for d in order])
    total = (len(stream) - 1) // seq
    windows = [stream[k * seq:k * seq + seq + 1].tolist() for k in range(total)]
    # epochs 1–2 hold (60 - 1) // 7 = 8 samples; only 1 is needed from epoch 3 (< 80 % of the 4 per
    # epoch), so samples 0..7 and 8..11 are shuffled separately (Megatron's separate final epoch)
    shuffle = np.concatenate([state.permutation(8), 8 + state.permutation(total - 8)])
    assert len(ds) == total == 12
    assert ds.document_index.tolist() == order.tolist()
    assert ds.shuffle_index.tolist() == shuffle.tolist()
    assert _texts(ds) == [windows[k] for k in shuffle]
    assert sorted(ds.shuffle_index[:8].tolist()) == list(range(8))  # full epochs used first
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_determinism_and_seed(tmp_path):
    docs = [[i % 256] * (1 + i % 5) + [EOD] for i in range(40)]
    a = _dataset(tmp_path, docs, seq=5, num_samples=50, seed=7)
    b = _dataset(tmp_path, docs, seq=5, num_samples=50, seed=7)
    c = _dataset(tmp_path, docs, seq=5, num_samples=50, seed=8)
    assert _texts(a) == _texts(b)
    assert a.document_index.tolist() != c.document_index.tolist()
    assert _texts(a) != _texts(c)


def _megatron_masks(tokens, eod):
    """Megatron's _get_ltor_masks_and_position_ids loop, the reference for sample_fields."""
    s = tokens.numel()
    mask = torch.tril(torch.ones(s, s)).unsqueeze(0)
    loss_mask = torch.ones(s)
    loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s)
    prev = 0
    for i in torch.arange(s)[tokens == eod].tolist():
        mask[0, i + 1:, :i + 1] = 0
        position_ids[i + 1:] -= i + 1 - prev
        prev = i + 1
    return mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("text", [[1, 2, EOD, 4, 5, EOD, 7, 8], [EOD, EOD, 3, 4, 5, 6, 7, EOD], list(range(9))])
def test_eod_masks_and_positions(text):
    fields = sample_fields(np.array(text), EOD, True, True, True, create_attention_mask=True)
    mask, loss_mask, position_ids = _megatron_masks(torch.tensor(text[:-1]), EOD)
    assert np.array_equal(fields["attention_mask"], mask.numpy())
    # the document ids the attention takes give Megatron's mask: causal within equal ids
    ids, s = fields["document_ids"], len(text) - 1
    allowed = np.tril(np.ones((s, s), dtype=bool)) & (ids[:, None] == ids[None, :])
    assert np.array_equal(~allowed[None], mask.numpy())
    assert "attention_mask" not in sample_fields(np.array(text), EOD, True, True, True)
    assert np.array_equal(fields["loss_mask"], loss_mask.numpy())
    assert np.array_equal(fields["position_ids"], position_ids.numpy())
    if text[0] == 1:  # by hand: positions restart after each EOD, loss zero on the EOD inputs
        assert fields["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0]
        assert fields["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0, 1]
    plain = sample_fields(np.array(text), EOD, False, False, False)
    s = len(text) - 1
    assert plain["position_ids"].tolist() == list(range(s)) and plain["loss_mask"].tolist() == [1.0] * s
    assert "attention_mask" not in plain and "document_ids" not in plain


def test_cache_reuse_and_corruption(tmp_path, monkeypatch):
    docs = [[i % 256] * (2 + i % 7) + [EOD] for i in range(30)]
    cache = str(tmp_path / "cache")
    first = _dataset(tmp_path, docs, seq=6, num_samples=40, cache=cache)
    files = sorted(glob.glob(os.path.join(cache, "*")))
    assert [os.path.basename(f).split("-", 1)[1] for f in files] == [
        "GPTDataset-train-description.json", "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy"]
    assert all(os.path.basename(f).startswith(first.unique_hash) for f in files)

    def no_rebuild(*args):
        raise AssertionError("indices were rebuilt instead of loaded from the cache")

    with monkeypatch.context() as patch:
        patch.setattr(gpt_module, "build_gpt_indices", no_rebuild)
        again = _dataset(tmp_path, docs, seq=6, num_samples=40, cache=cache)
    for kind in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(first, kind), getattr(again, kind))
    other = _dataset(tmp_path, docs, seq=6, num_samples=40, seed=2, cache=cache)
    assert other.unique_hash != first.unique_hash and len(glob.glob(os.path.join(cache, "*"))) == 8

    shuffle_file = [f for f in files if f.endswith("shuffle_index.npy")][0]
    for damage in (lambda: open(shuffle_file, "r+b").truncate(100),  # truncated .npy
                   lambda: np.save(shuffle_file, np.zeros(len(first), dtype=np.int64))):  # not a permutation
        damage()
        with pytest.warns(UserWarning, match="shuffle_index.npy"):
            rebuilt = _dataset(tmp_path, docs, seq=6, num_samples=40, cache=cache)
        assert np.array_equal(rebuilt.shuffle_index, first.shuffle_index)
        assert np.array_equal(np.load(shuffle_file), first.shuffle_index)  # rewritten
    assert not glob.glob(os.path.join(cache, ".tmp-*"))
    # a regenerated corpus (same document count, other lengths) gets its own cache entry
    prefix = str(tmp_path / "corpus")
    for suffix in (".bin", ".idx"):
        os.remove(prefix + suffix)
    changed = _dataset(tmp_path, [d + [7] for d in docs], seq=6, num_samples=40, cache=cache)
    assert changed.unique_hash not in (first.unique_hash, other.unique_hash)


def test_vocab_mismatch_and_empty_split(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, [[1, 2, EOD], []], vocab_size=257)
    config = GPTDatasetConfig(random_seed=0, sequence_length=2, tokenizer=NullTokenizer(100), blend=[prefix])
    with pytest.raises(ValueError, match=r"corpus\.bin: token id 256 .* \[0, 101\)"):
        GPTDataset.build_low_level_dataset(prefix, config)
    low = IndexedDataset(prefix)
    with pytest.raises(ValueError, match="valid split .* holds no tokens"):
        GPTDataset(low, prefix, np.array([1]), 4, "valid", _config(2))
    with pytest.raises(ValueError, match=r"train split holds fewer than sequence_length \+ 1 = 5 tokens"):
        GPTDataset(low, prefix, np.array([0, 1]), None, "train", _config(4))  # one epoch of 3 tokens
    assert len(GPTDataset(low, prefix, np.array([0, 1]), 2, "train", _config(4))) == 2  # 3 epochs: 9 tokens


def test_mock_dataset_deterministic():
    def build(seed):
        config = GPTDatasetConfig(random_seed=seed, sequence_length=16, tokenizer=NullTokenizer(50), mock=True,
                                  mock_num_documents=64, mock_max_document_length=40, eod_mask_loss=True)
        low = MockGPTDataset.build_low_level_dataset(None, config)
        return MockGPTDataset(low, None, np.arange(64), 100, "train", config)

    a, b, c = build(3), build(3), build(4)
    assert len(a) >= 100 and _texts(a) == _texts(b) and _texts(a) != _texts(c)
    # each synthetic document counts 1, 2, ... (mod 50, skipping EOD = 50) and ends with EOD
    for d in range(5):
        doc = a.dataset.get(d).tolist()
        assert doc == [k % 50 for k in range(1, len(doc))] + [50]
    sample = a[0]
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert int(sample["tokens"].max()) <= 50
    assert torch.equal(sample["loss_mask"], (sample["tokens"] != 50).float())


@pytest.mark.parametrize("kwargs, message", [
    (dict(sequence_length=0), "sequence_length"),
    (dict(random_seed=-1), "random_seed"),
    (dict(split="1,x"), "split"),
    (dict(split="0,0,0"), "split"),
    (dict(blend=[("a", -1.0)]), "weight of 'a'"),
    (dict(blend=[0.5, "a", 0.5]), "flat form"),
    (dict(blend=None), "blend"),
    (dict(tokenizer=None), "tokenizer"),
    (dict(reset_position_ids=1), "reset_position_ids"),
])
def test_config_validation(kwargs, message):
    args = dict(random_seed=1, sequence_length=8, tokenizer=ByteTokenizer(), blend=["p"])
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        GPTDatasetConfig(**args)
