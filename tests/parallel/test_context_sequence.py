"""parallel/context_sequence.py: the shift left over the cp ranks' load-balanced chunks against
``torch.roll`` of the whole sequence (its last entry zeroed) then split, and the whole-sequence
masked mean against the one-process mean.

Every rank builds the same full tensors (a fixed generator), keeps its chunks (``split_sequence``)
and rolls them with a collective; the roll only moves values, so the comparison is ``torch.equal``.
cp 2 and cp 4 over the world, and cp 2 as two groups of strided ranks ({0, 2}, {1, 3}: a tp2 × cp2
layout's cp groups) so that the group's own rank order is the one that counts.
"""
import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel.context_sequence import masked_sequence_mean, roll_left_over_context
from tpfuse.parallel.context_split import split_sequence

C, B = 3, 2          # chunk length; batch


def _full_tensors(seq):
    gen = torch.Generator().manual_seed(11)
    return {"ids": torch.randint(1, 100, (B, seq), generator=gen),            # (b, s) int64
            "mask": (torch.rand(B, seq, generator=gen) > 0.3).float(),        # (b, s) fp32
            "hidden": torch.randn(seq, B, 4, generator=gen)}                  # (s, b, h), dim 0


def _whole_roll(x, dim):
    rolled = torch.roll(x, shifts=-1, dims=dim)
    rolled.select(dim, -1).zero_()
    return rolled


def roll_worker(cp_groups):
    """True when every tensor's cp roll is its rank's part of the rolled whole sequence and the
    masked mean is the whole sequence's; ``cp_groups``: lists of global ranks (None: the world)."""
    rank = dist.get_rank()
    if cp_groups is None:
        group, members = None, list(range(dist.get_world_size()))
    else:
        groups = [(dist.new_group(ranks), ranks) for ranks in cp_groups]
        group, members = next((g, ranks) for g, ranks in groups if rank in ranks)
    cp, cp_rank = len(members), members.index(rank)
    full = _full_tensors(2 * cp * C)
    for name, x in full.items():
        dim = 0 if name == "hidden" else -1
        local = split_sequence(x, cp, cp_rank, dim=dim)
        rolled = roll_left_over_context(local, group, cp, cp_rank, dim=dim)
        expected = split_sequence(_whole_roll(x, dim), cp, cp_rank, dim=dim)
        assert rolled.dtype == x.dtype and torch.equal(rolled, expected), name
        assert torch.equal(local, split_sequence(x, cp, cp_rank, dim=dim)), f"{name} modified"
    losses = torch.randn(B, 2 * cp * C, generator=torch.Generator().manual_seed(5))
    mask = full["mask"]
    loss, mean = masked_sequence_mean(split_sequence(losses, cp, cp_rank),
                                      split_sequence(mask, cp, cp_rank), group, cp)
    whole = (losses * mask).sum() / mask.sum()
    # fp32 sums of ≤ 2·B·2·cp·C = 48 terms regrouped: at most 48 · 2^-24 ≈ 3e-6 relative
    assert torch.allclose(mean, whole, rtol=1e-5, atol=0)
    summed = loss.detach().clone()
    dist.all_reduce(summed, group=group)
    assert torch.allclose(summed, cp * whole, rtol=1e-5, atol=0)       # Σ_cp = cp · L
    return True


@pytest.mark.parametrize("world_size, cp_groups", [(2, None), (4, None), (4, [[0, 2], [1, 3]])])
def test_roll_over_context_is_the_whole_sequence_roll_split(run_distributed, world_size,
                                                            cp_groups):
    assert run_distributed(world_size, roll_worker, cp_groups) == [True] * world_size


def test_roll_at_cp1_is_the_plain_roll():
    full = _full_tensors(2 * C)
    for name, x in full.items():
        dim = 0 if name == "hidden" else -1
        assert torch.equal(roll_left_over_context(x, dim=dim), _whole_roll(x, dim)), name
