"""VocabParallelEmbedding vs F.embedding and vocab_parallel_cross_entropy vs F.cross_entropy
(also over a padded vocabulary: F.cross_entropy over the real columns).

One gloo world of 4 ranks, TP size looping over 1, 2, 4 inside the job (dp = 4 / tp); sequence
parallelism on and off for the embedding. Outputs, input grads (logits) and the reassembled
weight grads are compared on every rank. Tolerance: see tests/support/tp_testing.py (the loss uses a
max / sum-of-exp split over shards, which reorders the log-sum-exp sum: same rounding argument).
"""
import torch
import torch.nn.functional as F
from torch import nn

from support.tp_testing import (assembled, assert_close_fp32, chunk_of, expect_value_error,
                         seeded_randn, tp_layouts, tp_state)
from tpfuse.tp_layers import VocabParallelEmbedding, vocab_parallel_cross_entropy

V, H, B, S = 20, 6, 2, 8


def _ids(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[0, :4] = torch.tensor([0, V // 4 - 1, V // 4, V - 1])  # shard boundaries at tp 4 and 2
    return ids


def _embedding_case(state, sp):
    torch.manual_seed(3)
    dense = nn.Embedding(V, H)
    ids, dy = _ids(4), seeded_randn(5, B, S, H)
    out_dense = F.embedding(ids, dense.weight)            # (b, s, h)
    out_dense.backward(dy)
    layer = VocabParallelEmbedding.from_dense(dense, sequence_parallel=sp, state=state)
    out = layer(ids)
    tag = f"embedding tp={state.tp_size} sp={sp}"
    if sp:  # sequence-first chunk of this rank
        expected, dy_local = (chunk_of(t.transpose(0, 1), state, 0) for t in (out_dense.detach(), dy))
    else:
        expected, dy_local = out_dense.detach(), dy
    assert out.shape == expected.shape, f"{tag}: shape {tuple(out.shape)}"
    assert_close_fp32(out, expected, f"{tag}: output")
    out.backward(dy_local)
    assert_close_fp32(assembled(layer.weight.grad, state, 0), dense.weight.grad, f"{tag}: dW")


def _loss_case(state):
    logits = seeded_randn(6, S, B, V, scale=3.0)          # (s, b, V)
    target = _ids(7).t().contiguous()                      # (s, b)
    target[1, 1] = target[5, 0] = -100                     # ignored tokens
    grad_loss = seeded_randn(8, S, B)
    dense_logits = logits.clone().requires_grad_()
    expected = F.cross_entropy(dense_logits.reshape(-1, V), target.reshape(-1), reduction="none",
                               ignore_index=-100).reshape(S, B)
    expected.backward(grad_loss)
    shard = chunk_of(logits, state, -1).clone().requires_grad_()    # (s, b, V/tp)
    loss = vocab_parallel_cross_entropy(shard, target, state=state)
    tag = f"loss tp={state.tp_size}"
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    assert_close_fp32(loss, expected.detach(), f"{tag}: loss")
    loss.backward(grad_loss)
    assert_close_fp32(shard.grad, chunk_of(dense_logits.grad, state, -1), f"{tag}: dlogits")


def _padded_loss_case(state):
    """Columns >= REAL are padding: the loss is F.cross_entropy over the real columns only, and
    the padding gets no gradient. With REAL = 11 of 20, tp=4's shards 2 (columns 10..14) and 3
    (15..19) are one-real-column and all-padding."""
    real = 11
    logits = seeded_randn(16, S, B, V, scale=3.0)         # (s, b, V_padded)
    target = torch.remainder(_ids(17).t(), real).contiguous()    # (s, b), real ids only
    grad_loss = seeded_randn(18, S, B)
    dense_logits = logits[..., :real].clone().requires_grad_()
    expected = F.cross_entropy(dense_logits.reshape(-1, real), target.reshape(-1),
                               reduction="none").reshape(S, B)
    expected.backward(grad_loss)
    shard = chunk_of(logits, state, -1).clone().requires_grad_()    # (s, b, V/tp)
    loss = vocab_parallel_cross_entropy(shard, target, vocab_size=real, state=state)
    tag = f"padded loss tp={state.tp_size}"
    assert_close_fp32(loss, expected.detach(), f"{tag}: loss")
    loss.backward(grad_loss)
    full_grad = torch.cat([dense_logits.grad, torch.zeros(S, B, V - real)], dim=-1)
    assert_close_fp32(shard.grad, chunk_of(full_grad, state, -1), f"{tag}: dlogits")


def _embedding_and_loss_against_torch():
    cases = 0
    for tp, state in tp_layouts():
        for sp in (False, True):
            _embedding_case(state, sp)
            cases += 1
        _loss_case(state)
        _padded_loss_case(state)
        cases += 1
        torch.manual_seed(9)  # layout-independent init: a slice of the same N(0, 0.02²) draw
        layer = VocabParallelEmbedding(V, H, state=state)
        torch.manual_seed(9)
        torch.testing.assert_close(assembled(layer.weight.data, state, 0),
                                   torch.empty(V, H).normal_(0.0, 0.02), rtol=0, atol=0)
    return cases


def test_embedding_and_loss_match_torch(run_distributed):
    assert run_distributed(4, _embedding_and_loss_against_torch) == [9] * 4


def _bad_settings():
    with tp_state(4) as state:
        expect_value_error(lambda: VocabParallelEmbedding(22, H, state=state),
                           "num_embeddings (vocab size)=22", "tp=4")
        layer = VocabParallelEmbedding(V, H, sequence_parallel=True, state=state)
        expect_value_error(lambda: layer(torch.zeros(B, 6, dtype=torch.long)),
                           "sequence length 6", "tp=4")
        expect_value_error(lambda: vocab_parallel_cross_entropy(
            torch.randn(S, B, V // 4), torch.zeros(S, dtype=torch.long), state=state),
            "logits shape", "target shape")
        expect_value_error(lambda: vocab_parallel_cross_entropy(
            torch.randn(S, B, V // 4), torch.zeros(S, B, dtype=torch.long), vocab_size=V + 1,
            state=state), "vocab_size=21", "[1, 20]")
    return True


def test_bad_settings_raise_before_collectives(run_distributed):
    assert run_distributed(4, _bad_settings) == [True] * 4
