"""Layout-invariant dropout at the layer level: coordinates of a sequence-parallel shard are the
full sequence's rows, and ParallelAttention's flash path (head dims 16..128) draws the same
attention-dropout mask as its explicit path."""
import torch

from tpfuse.tp_layers import ParallelAttention
from tpfuse.tp_layers.random import DropoutCoordinates, coordinate_dropout, dropout_site


def test_sequence_parallel_shard_draws_the_full_sequences_rows():
    coords = DropoutCoordinates(seed=3, first_sample=10, positions=torch.arange(8))
    x = torch.ones(8, 2, 12)                                            # (s, b, h)
    full = coordinate_dropout(x, 0.5, coords.rows(dropout_site(2, 1), 8, 2))
    for rank in range(2):
        shard = coordinate_dropout(x[4 * rank:4 * (rank + 1)], 0.5,
                                   coords.rows(dropout_site(2, 1), 4, 2, rank, True))
        assert torch.equal(shard, full[4 * rank:4 * (rank + 1)])
    other_samples = DropoutCoordinates(3, 12, torch.arange(8))
    assert not torch.equal(coordinate_dropout(x, 0.5, other_samples.rows(dropout_site(2, 1), 8, 2)),
                           full)


def test_flash_and_explicit_attention_paths_draw_the_same_dropout():
    """fp32 on both paths: the same products summed in another order (≤ s·u32 relative)."""
    torch.manual_seed(0)
    layer = ParallelAttention(32, 2, attention_dropout=0.2, layer_number=3).train()  # d = 16
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    coords = DropoutCoordinates(seed=1, first_sample=4, positions=torch.arange(8))
    drop = layer._attention_dropout(0.2, coords, 2)
    flash = layer._core_attention(q, k, v, None, None, None, coords)
    explicit = layer._explicit_attention(q, k, v, 0.2, drop=drop)
    torch.testing.assert_close(flash, explicit, rtol=1e-5, atol=1e-6)
    plain = layer._explicit_attention(q, k, v, 0.0)
    assert (plain - flash).abs().max() > 1e-3
