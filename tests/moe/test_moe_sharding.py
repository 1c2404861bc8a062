"""Checkpoint algebra of expert parameters: the single-process tensor from any (ep, etp) layout's
shards, and any rank's part of it (exact: only slicing and concatenation)."""
import pytest
import torch

from tpfuse.tp_layers.init import shard
from tpfuse.checkpoint.sharding import full_tensor, local_part

E, H, F = 4, 6, 8


def _part(full, ep, ep_rank, etp, etp_rank, dim, stride):
    block = E // ep
    return shard(full[ep_rank * block:(ep_rank + 1) * block], dim, etp, etp_rank, stride)


@pytest.mark.parametrize("old,new", [((2, 2), (4, 1)), ((4, 1), (1, 2)), ((1, 1), (2, 2))])
@pytest.mark.parametrize("dim,stride", [(2, 2), (1, 1), (None, 1)])
def test_expert_shards_reassemble_and_recut(old, new, dim, stride):
    full = torch.randn(E, H, F)
    record = {"expert": True, "dim": dim, "stride": stride}
    (ep, etp), (new_ep, new_etp) = old, new
    split = (lambda t, q: shard(t, dim, etp, q, stride)) if dim is not None else (lambda t, q: t)
    shards = {(r, q): split(full[r * E // ep:(r + 1) * E // ep], q)
              for r in range(ep) for q in range(etp)}
    rebuilt = full_tensor({"record": record}, shards, "w", {"tp": 1, "ep": ep, "etp": etp})
    assert torch.equal(rebuilt, full)
    for r in range(new_ep):
        for q in range(new_etp):
            sizes = {"tp": 1, "tp_rank": 0, "ep": new_ep, "ep_rank": r, "etp": new_etp,
                     "etp_rank": q}
            expected = (full[r * E // new_ep:(r + 1) * E // new_ep] if dim is None else
                        _part(full, new_ep, r, new_etp, q, dim, stride))
            assert torch.equal(local_part(record, rebuilt, sizes), expected)


def test_missing_expert_shard_is_named():
    record = {"expert": True, "dim": 1, "stride": 1}
    with pytest.raises(ValueError, match=r"lacks \(ep, etp\) shards \[\(1, 0\)\] of parameter w"):
        full_tensor({"record": record}, {(0, 0): torch.zeros(2, 3)}, "w",
                    {"tp": 1, "ep": 2, "etp": 1})
