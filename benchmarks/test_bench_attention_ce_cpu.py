"""CPU benchmarks: the torch paths of flash_attention and cross_entropy vs plain torch compositions.

Run (pytest.ini disables benchmarks by default)::

    python3 -m pytest benchmarks/test_bench_attention_ce_cpu.py --benchmark-enable -q \
        --benchmark-columns=mean,min,rounds --benchmark-sort=mean

pytest-benchmark prints each group's timings with the ratio to the group's fastest in parentheses:
those ratios, measured in one run, are the result (never a timed assertion).
"""
import pytest
import torch
import torch.nn.functional as F

from tpfuse.kernels.cross_entropy import (cross_entropy, cross_entropy_loss_from_stats,
                                          cross_entropy_shard_grad, cross_entropy_shard_stats)
from tpfuse.kernels.flash_attention import flash_attention

B, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 2, 512, 64   # GQA, causal, fp32
ROWS, VOCAB = 2048, 8192                               # cross-entropy: 2048 tokens, 8k vocab, fp32
ROUNDS = 15  # after 2 warm-up rounds (allocator, thread pool), so the order of tests matters less


def _composed_attention(q, k, v):
    """The plain composition: repeat kv heads, scores, causal mask, softmax, weighted sum."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5                   # (b, h, s, s)
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def _sdpa_repeated_kv(q, k, v):
    """Peer: SDPA on explicitly repeated kv heads (what a model without GQA support does)."""
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                          v.repeat_interleave(group, dim=1), is_causal=True)


ATTENTION = {
    "tpfuse_torch_path": lambda q, k, v: flash_attention(q, k, v, causal=True, backend="torch"),
    "sdpa_enable_gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       enable_gqa=True),
    "composed_softmax": _composed_attention,
    "sdpa_repeated_kv": _sdpa_repeated_kv,
}


def _attention_inputs(requires_grad):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(B, KV_HEADS, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_forward(benchmark, impl):
    benchmark.group = f"attention fwd b{B} h{HEADS} kv{KV_HEADS} s{SEQ} d{HEAD_DIM} causal fp32"
    q, k, v = _attention_inputs(False)
    with torch.no_grad():
        out = benchmark.pedantic(ATTENTION[impl], (q, k, v), rounds=ROUNDS, warmup_rounds=2)
    torch.testing.assert_close(out, _composed_attention(q, k, v), rtol=1e-4, atol=1e-4)  # same op


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_forward_backward(benchmark, impl):
    benchmark.group = f"attention fwd+bwd b{B} h{HEADS} kv{KV_HEADS} s{SEQ} d{HEAD_DIM} causal fp32"
    q, k, v = _attention_inputs(True)
    grad_out = torch.randn(B, HEADS, SEQ, HEAD_DIM)

    def step():
        q.grad = k.grad = v.grad = None
        ATTENTION[impl](q, k, v).backward(grad_out)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)


class _PiecesCrossEntropy(torch.autograd.Function):
    """The shard pieces in torch (what the vocab-parallel loss runs), single shard."""

    @staticmethod
    def forward(ctx, logits, target):
        row_max, sum_exp, target_logit = cross_entropy_shard_stats(logits, target, 0, backend="torch")
        ctx.save_for_backward(logits, target, row_max, sum_exp)
        return cross_entropy_loss_from_stats(row_max, sum_exp, target_logit, target)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, row_max, sum_exp = ctx.saved_tensors
        return cross_entropy_shard_grad(logits, target, 0, row_max, sum_exp, grad_loss, backend="torch"), None


def _pieces_cross_entropy(logits, target):
    return _PiecesCrossEntropy.apply(logits, target)


def _composed_cross_entropy(logits, target):
    """The plain composition: log_softmax then gather the target column."""
    return -torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).squeeze(1)


CROSS_ENTROPY = {
    "tpfuse_torch_path": lambda x, t: cross_entropy(x, t, backend="torch"),
    "tpfuse_shard_pieces_torch": _pieces_cross_entropy,
    "composed_log_softmax": _composed_cross_entropy,
    "F.cross_entropy": lambda x, t: F.cross_entropy(x, t, reduction="none"),
}


@pytest.mark.parametrize("impl", list(CROSS_ENTROPY))
def test_cross_entropy_forward_backward(benchmark, impl):
    benchmark.group = f"cross_entropy fwd+bwd N{ROWS} V{VOCAB} fp32"
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=gen).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    grad_loss = torch.ones(ROWS)

    def step():
        logits.grad = None
        loss = CROSS_ENTROPY[impl](logits, target)
        loss.backward(grad_loss)
        return loss

    loss = benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=2)
    expected = F.cross_entropy(logits.detach(), target, reduction="none")
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)  # same op, fp32 order
