"""The torch path of flash attention (the CPU default): the mask cut into dense blocks, each one call of
torch's fused attention op, so masked-out work is skipped rather than computed and thrown away.

A *block* is a rectangle (batch rows, query rows, key rows) whose mask is one of: none, causal aligned at
its top-left corner (the op's ``is_causal``), or an explicit additive 0/−inf bias. The plan:

- sorted document ids → one block per (batch row, document): keys of other documents are never read,
  so a packed batch costs Σ Lᵢ² instead of s² (batch rows with equal ids share one block);
- inside a block, causal and window trim the key and query ranges to what some query can see (a
  query with nothing visible is left out: out 0, lse −inf), and a window narrower than the rows is cut
  into row chunks of ``max(W, WINDOW_CHUNK)`` so the cost is O(s·W), not O(s²);
- unsorted document ids → one block with the dense mask (exact, nothing skipped).

On CPU each block is ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the logsumexp) and its
backward op; elsewhere (``backend="torch"`` on a GPU) an explicit fp32 softmax of the block. The
backward takes the caller's out and lse — for ring attention the merged global ones — as the flash
backward does: P = exp(S − lse), δ = rowsum(dO ⊙ O).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WINDOW_CHUNK = 256  # query rows per block under a sliding window (at least the window itself)


@dataclass(frozen=True)
class Block:
    batch: slice
    rows: slice                  # query rows
    cols: slice                  # key rows
    causal: bool                 # top-left aligned causal mask (row r sees cols ≤ r, block-relative)
    bias: torch.Tensor | None    # additive 0 / −inf, (rows, cols) or (b, 1, rows, cols)


def _positional_blocks(mask, batch, qs, qe, ks, ke, dtype, device):
    """Blocks covering query rows [qs, qe) × key rows [ks, ke) under the causal / window rules."""
    shift, window = mask.shift, mask.window_size
    for _ in range(2):  # trimming keys can empty more queries and the other way round; twice is a fixpoint
        if mask.causal:  # row r sees cols ≤ r + shift
            ke, qs = min(ke, qe + shift), max(qs, ks - shift)
        if window is not None:  # row r sees cols ≥ r + shift − W + 1
            ks, qe = max(ks, qs + shift - window + 1), min(qe, ke - 1 - shift + window)
    if qs >= qe or ks >= ke:
        return []
    needs_causal = mask.causal and ke - 1 > qs + shift
    needs_window = window is not None and ks < qe + shift - window
    chunk = max(window or 0, WINDOW_CHUNK)
    if needs_window and qe - qs > chunk:
        return [blk for start in range(qs, qe, chunk)
                for blk in _positional_blocks(mask, batch, start, min(start + chunk, qe), ks, ke, dtype, device)]
    rows, cols = slice(qs, qe), slice(ks, ke)
    if not needs_window and (not needs_causal or qs + shift == ks):
        return [Block(batch, rows, cols, needs_causal, None)]
    r = torch.arange(qs, qe, device=device)[:, None] + shift
    c = torch.arange(ks, ke, device=device)[None, :]
    keep = (c <= r) if mask.causal else torch.ones_like(c <= r)
    if window is not None:
        keep &= r - c < window
    return [Block(batch, rows, cols, False, additive_bias(keep, dtype))]


def additive_bias(keep: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def _runs(ids: torch.Tensor) -> dict:
    """{id: (start, end)} of a 1-d sorted id row."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {v: (e - n, e) for v, n, e in zip(values.tolist(), counts.tolist(), ends)}


def plan(mask, b, s_q, s_k, dtype, device) -> list[Block]:
    """The blocks attention under ``mask`` computes (rows not covered are empty: out 0, lse −inf)."""
    if not mask.has_documents:
        return _positional_blocks(mask, slice(None), 0, s_q, 0, s_k, dtype, device)
    q_ids, k_ids = mask.q_document_ids, mask.k_document_ids
    ordered = all(bool((ids[:, 1:] >= ids[:, :-1]).all()) for ids in (q_ids, k_ids) if ids.shape[1] > 1)
    if not ordered:
        keep = mask.visible(s_q, s_k, device)                                 # (b, 1, s_q, s_k)
        return [Block(slice(None), slice(0, s_q), slice(0, s_k), False, additive_bias(keep, dtype))]
    shared = bool((q_ids == q_ids[:1]).all()) and bool((k_ids == k_ids[:1]).all())
    batches = [slice(None)] if shared else [slice(i, i + 1) for i in range(b)]
    blocks = []
    for batch in batches:
        key_runs = _runs(k_ids[batch.start or 0])
        for doc, (qs, qe) in _runs(q_ids[batch.start or 0]).items():
            if doc in key_runs:
                blocks += _positional_blocks(mask, batch, qs, qe, *key_runs[doc], dtype, device)
    return blocks


def _covers_everything(blocks, s_q, s_k) -> bool:
    if len(blocks) != 1:
        return False
    blk = blocks[0]
    return blk.batch == slice(None) and (blk.rows.start, blk.rows.stop, blk.cols.start, blk.cols.stop) == (0, s_q, 0, s_k)


def _empty_rows(blk) -> torch.Tensor | None:
    """Rows of a dense-bias block with no visible key (only unsorted document ids leave any)."""
    return None if blk.bias is None or blk.bias.dim() == 2 else torch.isinf(blk.bias).all(-1)  # (b, 1, rows)


# ----------------------------------------------------------------------------- one block

def _explicit_scores(q, k, blk, scale):
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    scores = scale * q.to(compute) @ k.to(compute).repeat_interleave(group, 1).transpose(-1, -2)
    if blk.causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return scores if blk.bias is None else scores + blk.bias


def _block_forward(q, k, v, blk, scale):
    """(out, lse) of one block; q (nb, h, rows, d), k/v (nb, h_kv, cols, d)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, blk.causal, attn_mask=blk.bias, scale=scale)
    else:
        scores = _explicit_scores(q, k, blk, scale)                          # (nb, h, rows, cols)
        lse = torch.logsumexp(scores, dim=-1)
        v_full = v.to(scores.dtype).repeat_interleave(q.shape[1] // k.shape[1], 1)
        out = (torch.exp(scores - lse[..., None]) @ v_full).to(q.dtype)
    empty = _empty_rows(blk)
    if empty is not None:
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def _block_backward(dout, q, k, v, out, lse, blk, scale):
    """(dq, dk, dv) of one block given the (global) out and lse of its query rows."""
    lse = lse.masked_fill(torch.isinf(lse), 0.0)  # empty rows: P = exp(−inf − 0) = 0, and O = 0 ⇒ δ = 0
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(q.dtype if q.dtype == torch.float64 else torch.float32),
            0.0, blk.causal, attn_mask=blk.bias, scale=scale)
    scores = _explicit_scores(q, k, blk, scale)
    group, compute = q.shape[1] // k.shape[1], scores.dtype
    dout_c, q_c = dout.to(compute), q.to(compute)
    p = torch.exp(scores - lse.to(compute)[..., None])                       # (nb, h, rows, cols)
    dp = dout_c @ v.to(compute).repeat_interleave(group, 1).transpose(-1, -2)
    ds = p * (dp - (dout_c * out.to(compute)).sum(-1, keepdim=True))
    dq = scale * ds @ k.to(compute).repeat_interleave(group, 1)
    grouped = (k.shape[0], k.shape[1], group, k.shape[2], k.shape[3])
    dk = (scale * ds.transpose(-1, -2) @ q_c).reshape(grouped).sum(2)
    dv = (p.transpose(-1, -2) @ dout_c).reshape(grouped).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- whole call

def attention_forward_torch(q, k, v, mask, scale):
    """(out (b, h, s_q, d) in q's dtype, lse (b, h, s_q) fp32, float64 for float64 inputs)."""
    b, heads, s_q, head_dim = q.shape
    s_k = k.shape[2]
    blocks = plan(mask, b, s_q, s_k, q.dtype, q.device)
    if _covers_everything(blocks, s_q, s_k):
        out, lse = _block_forward(q, k, v, blocks[0], scale)
        return out, lse.float() if q.dtype != torch.float64 else lse
    out = q.new_zeros(b, heads, s_q, head_dim)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((b, heads, s_q), float("-inf"), dtype=lse_dtype, device=q.device)
    for blk in blocks:
        o, l = _block_forward(q[blk.batch, :, blk.rows], k[blk.batch, :, blk.cols], v[blk.batch, :, blk.cols],
                              blk, scale)
        out[blk.batch, :, blk.rows] = o
        lse[blk.batch, :, blk.rows] = l
    return out, lse


def attention_backward_torch(dout, q, k, v, out, lse, mask, scale):
    """(dq, dk, dv) in the dtypes of q, k, v; rows and keys outside every block get 0."""
    b, _, s_q, _ = q.shape
    s_k = k.shape[2]
    blocks = plan(mask, b, s_q, s_k, q.dtype, q.device)
    if _covers_everything(blocks, s_q, s_k):
        return _block_backward(dout, q, k, v, out, lse, blocks[0], scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, dk, dv = (torch.zeros(t.shape, dtype=compute, device=t.device) for t in (q, k, v))
    for blk in blocks:
        rows, cols = (blk.batch, slice(None), blk.rows), (blk.batch, slice(None), blk.cols)
        g_q, g_k, g_v = _block_backward(dout[rows], q[rows], k[cols], v[cols], out[rows], lse[rows], blk, scale)
        dq[rows] += g_q
        dk[cols] += g_k      # window chunks share keys: accumulate
        dv[cols] += g_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
