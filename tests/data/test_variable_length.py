"""DocumentDataset and the micro-batch length rules of --variable-seq-lengths, against
hand-computed samples, padding and messages."""
import numpy as np
import pytest

from tpfuse.data import (DocumentDataset, build_pretraining_data_loader, check_micro_batch_length,
                         sequence_length_multiple)


class _Corpus:
    """Documents of 6, 1 (no sample: a single token), 4 and 20 tokens, ids 10·j + position."""
    sequence_lengths = np.array([6, 1, 4, 20])

    def get(self, j, offset=0, length=None):
        ids = 10 * j + np.arange(self.sequence_lengths[j])
        return ids[offset:None if length is None else offset + length]


def test_samples_are_whole_documents_cut_to_seq_length():
    dataset = DocumentDataset(_Corpus(), seq_length=8)
    assert len(dataset) == 3                      # the 1-token document holds no sample
    first = dataset[0]
    assert first["tokens"].tolist() == [0, 1, 2, 3, 4]
    assert first["labels"].tolist() == [1, 2, 3, 4, 5]
    assert first["loss_mask"].tolist() == [1.0] * 5
    assert first["position_ids"].tolist() == [0, 1, 2, 3, 4]
    last = dataset[2]                             # 20 tokens: the first 9 give 8 (tokens, label)
    assert last["tokens"].tolist() == list(range(30, 38))
    assert last["labels"].tolist() == list(range(31, 39))


def test_collate_pads_to_the_longest_sample_rounded_up_not_to_seq_length():
    dataset = DocumentDataset(_Corpus(), seq_length=8, pad_to_multiple_of=4)
    batch = dataset.collate([dataset[0], dataset[1]])    # 5 and 3 tokens: 5 rounds up to 8
    assert batch["tokens"].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [21, 22, 23, 0, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    short = DocumentDataset(_Corpus(), seq_length=8, pad_to_multiple_of=2)
    assert short.collate([short[1]])["tokens"].tolist() == [[20, 21, 22, 0]]   # 3 -> 4


def test_the_loader_collates_with_the_datasets_collate():
    dataset = DocumentDataset(_Corpus(), seq_length=8, num_samples=6)
    shapes = [tuple(b["tokens"].shape) for b in build_pretraining_data_loader(dataset, 0, 1, 0, 1)]
    assert shapes == [(1, 5), (1, 3), (1, 8)] * 2
    with pytest.raises(ValueError, match="seq_length=8 is not a multiple of pad_to_multiple_of=3"):
        DocumentDataset(_Corpus(), seq_length=8, pad_to_multiple_of=3)


def test_length_multiple_of_each_layout():
    assert sequence_length_multiple() == 1
    assert sequence_length_multiple(tp_size=2) == 1                  # TP without SP: any length
    assert sequence_length_multiple(tp_size=2, sequence_parallel=True) == 2
    assert sequence_length_multiple(cp_size=2) == 4
    assert sequence_length_multiple(tp_size=2, cp_size=2, sequence_parallel=True) == 8


@pytest.mark.parametrize("length,variable,layout,message", [
    (6, False, {}, "sequence length 6 with --seq-length 8: micro-batches of other lengths need "
                   "--variable-seq-lengths"),
    (9, True, {}, "sequence length 9: --variable-seq-lengths takes lengths from 1 to --seq-length "
                  "8"),
    (6, True, {"cp_size": 2}, "sequence length 6 is not divisible by 2 × --context-parallel-size "
                              "2 = 4"),
    (3, True, {"tp_size": 2, "sequence_parallel": True},
     "sequence length 3 is not divisible by --tensor-model-parallel-size 2 (--sequence-parallel) "
     "= 2"),
    (4, True, {"tp_size": 2, "cp_size": 2, "sequence_parallel": True},
     "sequence length 4 is not divisible by 2 × --context-parallel-size 2 × "
     "--tensor-model-parallel-size 2 (--sequence-parallel) = 8"),
])
def test_bad_lengths_name_the_length_and_flags(length, variable, layout, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_micro_batch_length(length, 8, variable, **layout)


def test_good_lengths_pass():
    check_micro_batch_length(8, 8, False)
    for length in (1, 5, 8):
        check_micro_batch_length(length, 8, True, tp_size=2)           # TP alone: any length
    check_micro_batch_length(4, 8, True, cp_size=2)
    check_micro_batch_length(8, 8, True, tp_size=2, cp_size=2, sequence_parallel=True)
