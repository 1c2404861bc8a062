"""Context-parallel attention against the single-process kernel on the full sequence.

Every cp rank (gloo, cp = 2 and 4) holds its load-balanced chunks (r, 2·cp−1−r) of q, k, v and of
the output gradient; ``context_parallel_attention`` with each comm type (p2p ring, all_gather,
a2a), causal / packed documents crossing chunk and rank boundaries / sliding window / both, GQA,
must give this rank's rows of ``flash_attention`` over the whole sequence and of its q, k, v
gradients. A head dim outside the kernel's range (8) checks the explicit per-block path.

Tolerance: both sides are fp32; they differ in summation order only (the ring merges per-block
softmaxes by lse, dK/dV partial sums arrive in ring order), a few ulp of the largest value per
term over ≤ 64 keys; 2e-5 × max |reference| covers it (observed ≤ 3e-6), while a wrong offset,
a missed block or a mis-routed dK moves entries by O(max |reference|).
"""
import pytest
import torch

from tpfuse.kernels.flash_attention import attention_reference, flash_attention
from tpfuse.parallel.context_split import (check_sequence_split, local_token_index,
                                           natural_to_rank_order, rank_order_index,
                                           rank_order_to_natural, split_sequence)

B, HEADS, KV_HEADS, SEQ = 2, 8, 4, 32
MASKS = {
    "causal": dict(),
    "documents": dict(documents=True),
    "window": dict(window_size=5),
    "documents_window": dict(documents=True, window_size=7),
}


def _inputs(head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, SEQ, head_dim, generator=gen)
    k = torch.randn(B, KV_HEADS, SEQ, head_dim, generator=gen)
    v = torch.randn(B, KV_HEADS, SEQ, head_dim, generator=gen)
    dout = torch.randn(B, HEADS, SEQ, head_dim, generator=gen)
    # documents of 1..11 tokens packed back to back: they cross chunk (4 or 8 tokens) boundaries
    lengths = torch.randint(1, 12, (B, SEQ), generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(SEQ), row)[:SEQ] for row in lengths])
    return q, k, v, dout, ids


def _reference(q, k, v, dout, ids, mask, head_dim):
    """out, dq, dk, dv of the whole sequence in one process."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kw = dict(window_size=mask.get("window_size"))
    if mask.get("documents"):
        kw.update(q_document_ids=ids, k_document_ids=ids)
    if 16 <= head_dim <= 128:
        out = flash_attention(q, k, v, causal=True, **kw)
    else:  # the kernels take 16..128: the reference on q, k, v repeated to 2d columns (q·k
        # doubles, so the scale halves; out keeps v's first d columns)
        out = attention_reference(q.repeat(1, 1, 1, 2), k.repeat(1, 1, 1, 2), v.repeat(1, 1, 1, 2),
                                  softmax_scale=head_dim ** -0.5 / 2, causal=True, **kw)[..., :head_dim]
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _cp_attention_errors(comm_type, head_dim):
    """On every rank: max |cp − reference| / max |reference| per (mask, tensor)."""
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers._group import resolve_cp_group
    from tpfuse.tp_layers.context_parallel import context_parallel_attention

    state = ParallelState.initialize(cp=torch.distributed.get_world_size())
    cp = resolve_cp_group(state=state)
    errors = {}
    for seed, (name, mask) in enumerate(MASKS.items()):
        q, k, v, dout, ids = _inputs(head_dim, seed)
        expected = _reference(q, k, v, dout, ids, mask, head_dim)
        local = [split_sequence(t, cp.size, cp.rank, dim=2).clone().requires_grad_()
                 for t in (q, k, v)]
        local_ids = split_sequence(ids, cp.size, cp.rank, dim=1) if mask.get("documents") else None
        out = context_parallel_attention(*local, cp, comm_type, window_size=mask.get("window_size"),
                                         document_ids=local_ids)
        out.backward(split_sequence(dout, cp.size, cp.rank, dim=2))
        got = [out.detach()] + [t.grad for t in local]
        for tensor, mine, full in zip(("out", "dq", "dk", "dv"), got, expected):
            want = split_sequence(full, cp.size, cp.rank, dim=2)
            errors[f"{name}.{tensor}"] = ((mine - want).abs().max() / full.abs().max()).item()
    state.destroy()
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_context_parallel_attention_matches_full_sequence(run_distributed, cp, comm_type):
    per_rank = run_distributed(cp, _cp_attention_errors, comm_type, 16)
    worst = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
    assert max(worst.values()) < 2e-5, worst


def test_explicit_head_dim_path(run_distributed):
    """Head dim 8 (outside the kernels' range): the explicit per-block softmax, ring and a2a."""
    for comm_type in ("p2p", "a2a"):
        per_rank = run_distributed(2, _cp_attention_errors, comm_type, 8)
        worst = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
        assert max(worst.values()) < 2e-5, (comm_type, worst)


def _a2a_heads_error():
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers._group import resolve_cp_group
    from tpfuse.tp_layers.context_parallel import context_parallel_attention

    state = ParallelState.initialize(cp=4)
    q, k, v, _, _ = _inputs(16, 0)
    k, v = k[:, :2], v[:, :2]            # 2 kv heads: not divisible by cp = 4
    local = [split_sequence(t, 4, state.cp_rank, dim=2) for t in (q, k, v)]
    try:
        context_parallel_attention(*local, resolve_cp_group(state=state), "a2a")
    except ValueError as error:
        return str(error)
    finally:
        state.destroy()
    return None


def test_a2a_needs_heads_divisible_by_cp(run_distributed):
    messages = run_distributed(4, _a2a_heads_error)
    assert all(m and "kv heads" in m and "context_parallel_size=4" in m for m in messages), messages


def test_sequence_split_layout():
    """Megatron's load-balanced layout, by hand: cp = 2, s = 8 → rank 0: 0 1 6 7, rank 1: 2 3 4 5."""
    assert local_token_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_token_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert rank_order_index(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    assert split_sequence(x, 2, 1, dim=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    pieces = [split_sequence(x, 4, r, dim=1) for r in range(4)]
    restored = torch.cat(pieces, dim=1)[:, torch.argsort(rank_order_index(8, 4))]
    assert torch.equal(restored, x)
    assert torch.equal(rank_order_to_natural(torch.cat(pieces, dim=1), 4, dim=1), x)
    assert torch.equal(natural_to_rank_order(x, 4, dim=1), torch.cat(pieces, dim=1))
    with pytest.raises(ValueError, match=r"seq_length=12 is not divisible by 2 × "
                                         r"context_parallel_size \(2\) × tensor_model_parallel_"):
        check_sequence_split(12, 2, tp_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="seq_length=6 .* 2 × context_parallel_size \\(2\\) = 4"):
        check_sequence_split(6, 2)


def test_one_device_check_runs_every_rank_share_against_the_full_kernel():
    """benchmarks/gpu_context_parallel_check.py --cpu-dry-run: every cp rank's block calls (cp 2,
    4, 8; each mask) in one process against the full-sequence kernel, fp32 tolerance 1e-4. Run
    as the script it is (a subprocess), as a user runs it."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                          "gpu_context_parallel_check.py")
    done = subprocess.run([sys.executable, script, "--cpu-dry-run"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("| PASS |") == 12
