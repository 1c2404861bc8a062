"""CPU benchmark: document-masked (packed) and sliding-window attention on flash_attention's torch path vs
the unmasked causal kernel and vs the same mask given to SDPA as a dense boolean mask.

Run (pytest.ini disables benchmarks by default)::

    python3 -m pytest benchmarks/test_bench_attention_masks_cpu.py --benchmark-enable -q \
        --benchmark-columns=median,min,rounds --benchmark-sort=name -p no:cacheprovider

A packed batch of documents costs Σ Lᵢ² rather than s² when the blocks of other documents are skipped,
so document masking should be *faster* than unmasked causal attention; a dense mask computes every
block and throws most away. pytest-benchmark prints each group's ratios to its fastest (the result;
never a timed assertion). Every variant's output is checked against the dense-mask peer.
"""
import pytest
import torch
import torch.nn.functional as F

from tpfuse.kernels.flash_attention import flash_attention

B, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 2, 2048, 64      # GQA, fp32
DOC_LENGTHS = (64, 448)                                     # uniform document lengths: mean 256, 8 per row
WINDOW = 256
ROUNDS = 5
THREADS = (1, 2)  # intra-op threads: on a shared, loaded machine every parallel region can wait for a
                  # descheduled second thread, which a packed batch (a few calls more) feels most


def _packed_ids():
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(B):
        lengths = torch.randint(DOC_LENGTHS[0], DOC_LENGTHS[1] + 1, (SEQ,), generator=gen)
        rows.append(torch.repeat_interleave(torch.arange(SEQ), lengths)[:SEQ])
    return torch.stack(rows)                                                  # (b, s)


IDS = _packed_ids()
POS = torch.arange(SEQ)
CAUSAL = POS[None, :] <= POS[:, None]                                         # (s, s) key ≤ query
DOCUMENT_MASK = (CAUSAL & (IDS[:, :, None] == IDS[:, None, :]))[:, None]     # (b, 1, s, s)
WINDOW_MASK = CAUSAL & (POS[:, None] - POS[None, :] < WINDOW)


def _sdpa_masked(mask):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


VARIANTS = {  # name: (function, dense-mask peer whose output it must match)
    "causal_unmasked": (lambda q, k, v: flash_attention(q, k, v, backend="torch"), None),
    "documents_skipped_blocks": (lambda q, k, v: flash_attention(q, k, v, q_document_ids=IDS, k_document_ids=IDS,
                                                                 backend="torch"), DOCUMENT_MASK),
    "documents_dense_mask_sdpa": (_sdpa_masked(DOCUMENT_MASK), None),
    "window_chunked": (lambda q, k, v: flash_attention(q, k, v, window_size=WINDOW, backend="torch"), WINDOW_MASK),
    "window_dense_mask_sdpa": (_sdpa_masked(WINDOW_MASK), None),
}


def _inputs(requires_grad):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(B, KV_HEADS, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _check_against_dense(name, q, k, v, out):
    peer_mask = VARIANTS[name][1]
    if peer_mask is not None:  # same attention, fp32 summation order only
        with torch.no_grad():
            torch.testing.assert_close(out.detach(), _sdpa_masked(peer_mask)(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.fixture(params=THREADS, ids=lambda n: f"{n}thread")
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_masked_attention_forward(benchmark, name, threads):
    benchmark.group = (f"masked attention fwd b{B} h{HEADS} kv{KV_HEADS} s{SEQ} d{HEAD_DIM} fp32, docs 64-448, "
                       f"W{WINDOW}, {threads} thread(s)")
    q, k, v = _inputs(False)
    with torch.no_grad():
        out = benchmark.pedantic(VARIANTS[name][0], (q, k, v), rounds=ROUNDS, warmup_rounds=1)
    _check_against_dense(name, q, k, v, out)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_masked_attention_forward_backward(benchmark, name, threads):
    benchmark.group = (f"masked attention fwd+bwd b{B} h{HEADS} kv{KV_HEADS} s{SEQ} d{HEAD_DIM} fp32, docs 64-448, "
                       f"W{WINDOW}, {threads} thread(s)")
    q, k, v = _inputs(True)
    grad_out = torch.randn(B, HEADS, SEQ, HEAD_DIM)

    def step():
        q.grad = k.grad = v.grad = None
        out = VARIANTS[name][0](q, k, v)
        out.backward(grad_out)
        return out

    out = benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)
    _check_against_dense(name, q, k, v, out)
