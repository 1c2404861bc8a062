"""BlendedDataset (Megatron's greedy rule, hand-checked), the builder's split ranges and blends, its
rank-0-first protocol under torch.distributed, and the data-parallel sampler's slicing and resume."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tpfuse.data import (BlendedDataset, BlendedMegatronDatasetBuilder, ByteTokenizer, GPTDataset,
                         GPTDatasetConfig, MegatronPretrainingSampler, MockGPTDataset,
                         build_pretraining_data_loader, parse_blend, split_ranges, write_indexed_dataset)
from tpfuse.data.indices import blending_indices

EOD = 256


def test_greedy_blending_by_hand():
    # weights (0.5, 0.3, 0.2); error_d = w_d · max(i, 1) − count_d, largest wins:
    # i=0: .5 .3 .2 → 0 | i=1: -.5 .3 .2 → 1 | i=2: 0 -.4 .4 → 2 | i=3: .5 -.1 -.4 → 0
    # i=4: 0 .2 -.2 → 1 | i=5: .5 -.5 0 → 0 | i=6: 0 -.2 .2 → 2 | i=7: .5 .1 -.6 → 0
    # i=8: 0 .4 -.4 → 1 | i=9: .5 -.3 -.2 → 0
    datasets, samples = blending_indices([0.5, 0.3, 0.2], 10)
    assert datasets.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert samples.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]  # each dataset's next unused sample
    # proportions are exact whenever weight × size is whole; ties go to the lowest dataset id
    assert np.bincount(blending_indices([0.5, 0.3, 0.2], 1000)[0]).tolist() == [500, 300, 200]
    assert blending_indices([0.5, 0.5], 6)[0].tolist() == [0, 1, 0, 1, 0, 1]


class _Numbers(torch.utils.data.Dataset):
    def __init__(self, base, size):
        self.base, self.size = base, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"tokens": torch.tensor([self.base + i])}


def test_blended_dataset_reads_the_assigned_samples():
    blend = BlendedDataset([_Numbers(0, 10), _Numbers(100, 10), _Numbers(200, 10)], [5, 3, 2], 10)
    assert blend.weights == [0.5, 0.3, 0.2]
    assert [int(blend[i]["tokens"]) for i in range(10)] == [0, 100, 200, 1, 101, 2, 201, 3, 102, 4]
    with pytest.raises(ValueError, match="dataset 1 .* has 2 samples, the blend of 10 .* needs 3"):
        BlendedDataset([_Numbers(0, 10), _Numbers(100, 2), _Numbers(200, 10)], [5, 3, 2], 10)


def test_split_ranges_and_blend_forms():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]  # round(3.33), round(6.67)
    assert split_ranges("8,2", 10) == [(0, 8), (8, 10), (10, 10)]
    assert parse_blend([0.3, "a", "0.7", "b"]) == [("a", 0.3), ("b", 0.7)]
    assert parse_blend([("a", 1), ("b", 3)]) == [("a", 1.0), ("b", 3.0)]
    assert parse_blend("a") == [("a", 1.0)]


def _write(path, first_token, count=10):
    """count documents; document d is [first_token + d] * (3 + d % 4) + [EOD]."""
    write_indexed_dataset(path, [[first_token + d] * (3 + d % 4) + [EOD] for d in range(count)], 257)
    return path


def _config(blend, **kw):
    return GPTDatasetConfig(random_seed=5, sequence_length=4, tokenizer=ByteTokenizer(), blend=blend, **kw)


def test_builder_split_ranges(tmp_path):
    prefix = _write(str(tmp_path / "a"), 0)
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [20, 5, 0], lambda: True, _config([prefix], split="6,2,2")).build()
    assert test is None
    assert train.indexed_indices.tolist() == list(range(6)) and valid.indexed_indices.tolist() == [6, 7]
    assert set(train.document_index.tolist()) == set(range(6)) and len(train) >= 20
    assert set(valid.document_index.tolist()) == {6, 7} and len(valid) >= 5
    # every token a split sees belongs to its documents (document d holds token d)
    assert set(np.concatenate([valid.get_text(i) for i in range(len(valid))]).tolist()) <= {6, 7, EOD}
    assert BlendedMegatronDatasetBuilder(GPTDataset, [20, 5, 1], False, _config([prefix])).build() == (None,) * 3
    with pytest.raises(ValueError, match="test split of .* empty"):
        BlendedMegatronDatasetBuilder(GPTDataset, [1, 1, 1], True, _config([prefix], split="8,2")).build()
    with pytest.raises(ValueError, match="no .*missing.bin"):
        BlendedMegatronDatasetBuilder(GPTDataset, [1, 0, 0], True, _config([str(tmp_path / "missing")]))


def test_builder_blend_of_two_files(tmp_path):
    a, b = _write(str(tmp_path / "a"), 0), _write(str(tmp_path / "b"), 100)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [40, 8, 0], lambda: True, _config([3.0, a, 1.0, b], split="8,2,0")).build()
    assert isinstance(train, BlendedDataset) and len(train) == 40 and len(valid) == 8
    # children are asked for ceil(size · weight · 1.005) samples (Megatron's margin)
    assert [child.num_samples for child in train.datasets] == [31, 11]
    # the greedy rule on (0.75, 0.25): every sample's tokens come from the file it assigns
    expected = blending_indices([0.75, 0.25], 40)[0]
    assert np.bincount(expected).tolist() == [30, 10] and train.dataset_index.tolist() == expected.tolist()
    for i in range(40):
        tokens = [t for t in train[i]["tokens"].tolist() + train[i]["labels"].tolist() if t != EOD]
        assert all((t >= 100) == bool(expected[i]) for t in tokens)
    per_split = _config(None, blend_per_split=[[a], None, [b]])
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 10], True, per_split).build()
    assert valid is None and train.indexed_indices.size == 10 and test.dataset_path == b


def test_builder_mock(tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=ByteTokenizer(), mock=True,
                              mock_num_documents=1000, mock_max_document_length=30)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [50, 10, 2], True, config).build()
    assert isinstance(train, MockGPTDataset) and len(train) >= 50 and len(test) >= 2
    assert train.indexed_indices.tolist() == list(range(969)) and test.indexed_indices.tolist() == [999]


def _build_on_two_ranks(prefix, cache):
    """Rank 0 writes the cache; rank 1 must load it (building it itself would raise)."""
    from tpfuse.data import gpt_dataset

    if dist.get_rank() == 1:
        def forbidden(*args):
            raise AssertionError("rank 1 rebuilt the indices instead of loading rank 0's cache")
        gpt_dataset.build_gpt_indices = forbidden
    try:
        config = _config([prefix], path_to_cache=cache)
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [30, 0, 0], lambda: True, config).build()
        return train.shuffle_index.tolist(), [train.get_text(i).tolist() for i in range(len(train))]
    finally:
        gpt_dataset.build_gpt_indices = __import__("tpfuse.data.indices", fromlist=["x"]).build_gpt_indices


def _fail_on_rank_zero():
    def built_here():
        if dist.get_rank() == 0:
            raise OSError("disk full while writing the cache")
        return True
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=ByteTokenizer(), mock=True)
    try:
        BlendedMegatronDatasetBuilder(MockGPTDataset, [5, 0, 0], built_here, config).build()
    except Exception as err:
        return type(err).__name__, str(err)
    return None


def test_builder_rank0_first_under_distributed(tmp_path, run_distributed):
    prefix = _write(str(tmp_path / "a"), 0)
    cache = str(tmp_path / "cache")
    rank0, rank1 = run_distributed(2, _build_on_two_ranks, prefix, cache)
    assert rank0 == rank1 and len(os.listdir(cache)) == 4
    # a failure on rank 0 ends both ranks with an error (no rank waits forever)
    errors = run_distributed(2, _fail_on_rank_zero)
    assert errors[0] == ("OSError", "disk full while writing the cache")
    assert errors[1][0] == "RuntimeError" and "rank 0" in errors[1][1]


def test_sampler_dp_slices_and_resume():
    dataset = [{"tokens": torch.tensor([i, i]), "loss_mask": torch.tensor([1.0, 1.0])} for i in range(23)]
    b, dp = 2, 3  # 6 samples per micro-batch step; 23 samples → 3 full steps, 5 dropped
    per_rank = [[batch["tokens"][:, 0].tolist() for batch in build_pretraining_data_loader(dataset, 0, b, r, dp)]
                for r in range(dp)]
    # global order 0..17; step k gives rank r samples 6k + 2r, 6k + 2r + 1
    assert per_rank == [[[6 * k + 2 * r, 6 * k + 2 * r + 1] for k in range(3)] for r in range(dp)]
    batch = next(build_pretraining_data_loader(dataset, 0, b, 0, dp))
    assert batch["tokens"].shape == (2, 2) and batch["loss_mask"].dtype == torch.float32
    # resuming from consumed_samples reproduces the uninterrupted order from that point on
    for rank in range(dp):
        loader = build_pretraining_data_loader(dataset, 0, b, rank, dp)
        next(loader)
        assert loader.consumed_samples == 6
        resumed = build_pretraining_data_loader(dataset, loader.consumed_samples, b, rank, dp)
        assert [x["tokens"].tolist() for x in resumed] == [x["tokens"].tolist() for x in loader]
    assert len(MegatronPretrainingSampler(23, 6, b, 0, dp)) == 2
    with pytest.raises(ValueError, match="consumed_samples=23"):
        MegatronPretrainingSampler(23, 23, b, 0, dp)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(23, 0, b, 3, dp)
