"""The torch path of flash attention (the CPU default): the mask cut into rectangles of visible work, each
rectangle a row of one call of torch's fused attention op, so masked-out work is skipped rather than
computed and thrown away.

A *segment* is (batch row, query rows [qs, qe), key rows [ks, ke)):

- sorted document ids → one segment per (batch row, document): keys of other documents are never read,
  so a packed batch costs Σ Lᵢ² instead of s²;
- inside a segment, causal and window trim the key and query ranges to what some query can see (a
  query with nothing visible is left out: out 0, lse −inf), and a window narrower than the rows cuts it
  into row chunks of ``max(W, WINDOW_CHUNK)`` so the cost is O(s·W), not O(s²);
- unsorted document ids → one call with the dense mask (exact, nothing skipped).

One segment covering the whole batch runs on views of the inputs (the plain causal case: one call,
no copy). Otherwise segments of similar size are gathered into a padded batch (lengths rounded up to
2^k or 1.5·2^k), one call per size: on a CPU each call is a parallel region, so a few large calls beat
one call per document. A padded batch whose rows start at the same position for queries and keys
uses the op's top-left causal mask (padding keys come after every real query); any other gets an
exact additive 0/−inf bias from the positions.

On CPU each call is ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the logsumexp) and its
backward op; elsewhere (``backend="torch"`` on a GPU) the explicit softmax of
``flash_attention_reference``. The backward takes the
caller's out and lse — for ring attention the merged global ones — as the flash backward does:
P = exp(S − lse), δ = rowsum(dO ⊙ O).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .flash_attention_reference import explicit_backward, explicit_forward

WINDOW_CHUNK = 256  # query rows per segment under a sliding window (at least the window itself)


@dataclass(frozen=True)
class Segment:
    row: int | None   # batch row; None: every row
    qs: int
    qe: int
    ks: int
    ke: int


def _trimmed(mask, row, qs, qe, ks, ke) -> list[Segment]:
    """Segments covering query rows [qs, qe) × key rows [ks, ke) under the causal / window rules."""
    shift, window = mask.shift, mask.window_size
    for _ in range(2):  # trimming keys can empty more queries and the other way round; twice is a fixpoint
        if mask.causal:  # row r sees cols ≤ r + shift
            ke, qs = min(ke, qe + shift), max(qs, ks - shift)
        if window is not None:  # row r sees cols ≥ r + shift − W + 1
            ks, qe = max(ks, qs + shift - window + 1), min(qe, ke - 1 - shift + window)
    if qs >= qe or ks >= ke:
        return []
    chunk = max(window or 0, WINDOW_CHUNK)
    if window is not None and ks < qe + shift - window and qe - qs > chunk:
        return [seg for start in range(qs, qe, chunk)
                for seg in _trimmed(mask, row, start, min(start + chunk, qe), ks, ke)]
    return [Segment(row, qs, qe, ks, ke)]


def _runs(ids: torch.Tensor) -> dict:
    """{id: (start, end)} of a 1-d sorted id row."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {v: (e - n, e) for v, n, e in zip(values.tolist(), counts.tolist(), ends)}


def segments(mask, b, s_q, s_k) -> list[Segment] | None:
    """The segments attention under ``mask`` computes (rows in none are empty); None: unsorted ids."""
    if not mask.has_documents:
        return _trimmed(mask, None, 0, s_q, 0, s_k)
    q_ids, k_ids = mask.q_document_ids, mask.k_document_ids
    if not all(bool((ids[:, 1:] >= ids[:, :-1]).all()) for ids in (q_ids, k_ids) if ids.shape[1] > 1):
        return None
    shared = bool((q_ids == q_ids[:1]).all()) and bool((k_ids == k_ids[:1]).all())
    result = []
    for row in ([None] if shared else range(b)):
        key_runs = _runs(k_ids[row or 0])
        for doc, (qs, qe) in _runs(q_ids[row or 0]).items():
            if doc in key_runs:
                result += _trimmed(mask, row, qs, qe, *key_runs[doc])
    return result


def padded(length: int) -> int:
    """Bucket length: the next of 16, 24, 32, 48, 64, 96, ... (2^k or 1.5·2^k) at or above ``length``."""
    size = 16
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def additive_bias(keep: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


# ----------------------------------------------------------------------------- calls of the op

@dataclass
class Call:
    """One op call: a view of rows [qs, qe) × keys [ks, ke) of every batch row (``view``), or segments
    gathered into a padded (n, heads, Lq | Lk, d) batch — ``row (n,)``, positions ``q_pos (n, Lq)``,
    ``k_pos (n, Lk)`` (padding repeats a segment's last row), ``q_valid (n, Lq)`` — and its mask."""
    causal: bool                  # the op's top-left causal mask
    bias: torch.Tensor | None     # additive 0 / −inf
    view: Segment | None = None
    row: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None


def _views_call(mask, seg, dtype, device) -> Call:
    """One segment over every batch row, run on views."""
    needs_causal = mask.causal and seg.ke - 1 > seg.qs + mask.shift
    needs_window = mask.window_size is not None and seg.ks < seg.qe + mask.shift - mask.window_size
    if not needs_window and (not needs_causal or seg.qs + mask.shift == seg.ks):
        return Call(needs_causal, None, view=seg)
    r = torch.arange(seg.qs, seg.qe, device=device)[:, None] + mask.shift
    c = torch.arange(seg.ks, seg.ke, device=device)[None, :]
    return Call(False, additive_bias(_rules(mask, r - c), dtype), view=seg)


def _rules(mask, rel):
    """Causal / window visibility of query_pos − key_pos ``rel``."""
    keep = rel >= 0 if mask.causal else torch.ones_like(rel, dtype=torch.bool)
    return keep & (rel < mask.window_size) if mask.window_size is not None else keep


def _gathered_call(mask, segs, b, dtype, device) -> Call:
    """Segments of one size bucket as one padded batch (segments over every row expanded per row).
    Padding keys are masked for every real query: by the causal mask where each segment's queries and
    keys start at the same position (padding comes after every real query), else by the bias."""
    segs = [(r, s.qs, s.qe, s.ks, s.ke) for s in segs for r in ([s.row] if s.row is not None else range(b))]
    spans = torch.tensor(segs, device=device)
    row, qs, qe, ks, ke = spans.unbind(1)
    lq, lk = padded(int((qe - qs).max())), padded(int((ke - ks).max()))
    steps_q, steps_k = torch.arange(lq, device=device), torch.arange(lk, device=device)
    gather = dict(row=row, q_pos=(qs[:, None] + steps_q).minimum(qe[:, None] - 1),
                  k_pos=(ks[:, None] + steps_k).minimum(ke[:, None] - 1), q_valid=steps_q < (qe - qs)[:, None])
    aligned = bool((qs + mask.shift == ks).all()) and bool((ke - ks >= qe - qs).all())
    if mask.window_size is None and aligned and mask.causal:
        return Call(True, None, **gather)
    k_valid = steps_k < (ke - ks)[:, None]                                               # (n, Lk)
    if mask.window_size is None and not mask.causal:
        bias = None if bool(k_valid.all()) else additive_bias(k_valid[:, None, None, :], dtype)
        return Call(False, bias, **gather)
    rel = (qs + mask.shift - ks)[:, None, None] + steps_q[:, None] - steps_k             # (n, Lq, Lk)
    keep = _rules(mask, rel) & k_valid[:, None, :]
    return Call(False, additive_bias(keep[:, None], dtype), **gather)


def _nothing_to_plan(mask, s_q, s_k) -> bool:
    """No documents, no window, and no causal mask or a causal one whose queries and keys sit at
    the same positions: one call on the whole inputs, known without building segments."""
    if mask.has_documents or mask.window_size is not None:
        return False
    return not mask.causal or (mask.shift == 0 and s_q == s_k)


def plan(mask, b, s_q, s_k, dtype, device) -> list[Call]:
    if _nothing_to_plan(mask, s_q, s_k):
        return [Call(mask.causal, None, view=Segment(None, 0, s_q, 0, s_k))]
    segs = segments(mask, b, s_q, s_k)
    if segs is None:  # unsorted document ids: one dense call
        keep = mask.visible(s_q, s_k, device)                                  # (b, 1, s_q, s_k)
        return [Call(False, additive_bias(keep, dtype), view=Segment(None, 0, s_q, 0, s_k))]
    if len(segs) == 1 and segs[0].row is None:
        return [_views_call(mask, segs[0], dtype, device)]
    buckets = defaultdict(list)
    for seg in segs:
        buckets[padded(seg.qe - seg.qs), padded(seg.ke - seg.ks)].append(seg)
    return [_gathered_call(mask, group, b, dtype, device) for group in buckets.values()]


def _index(t, call, keys):
    """(batch, head, position) index tensors (n, heads, L) of a gathered call's rows in t."""
    pos = call.k_pos if keys else call.q_pos
    heads = torch.arange(t.shape[1], device=t.device)[None, :, None]
    return call.row[:, None, None].expand_as(pos[:, None, :]), heads, pos[:, None, :]


def _take(t, call, keys=False):
    """The call's query (or key) rows of t (b, heads, s, ...): a view, or one gather into a contiguous
    (n, heads, L, ...) batch (the op is several times slower on strided input, and one indexing op
    beats a copy per segment: each is a parallel region)."""
    if call.view is not None:
        seg = call.view
        return t[:, :, seg.ks:seg.ke] if keys else t[:, :, seg.qs:seg.qe]
    return t[_index(t, call, keys)]


def _put(t, call, values, keys=False, accumulate=False):
    """Write (or add) a call's values (n, heads, L, ...) into its rows of t (b, heads, s, ...). Padding
    rows repeat a real row: writes keep the real rows only; adds must get zeros from padding rows."""
    if call.view is not None:
        seg = call.view
        rows = (slice(None), slice(None), slice(seg.ks, seg.ke) if keys else slice(seg.qs, seg.qe))
        if accumulate:
            t[rows] += values
        else:
            t[rows] = values
        return
    index = _index(t, call, keys)
    if not accumulate:
        real = call.q_valid[:, None, :].expand(-1, t.shape[1], -1)                        # (n, heads, Lq)
        index, values = tuple(i.expand_as(real)[real] for i in index), values[real]
    t.index_put_(index, values, accumulate=accumulate)


# ----------------------------------------------------------------------------- one call

def _call_visible(call, s_q: int, s_k: int, device):
    """The call's mask as the explicit path's bool ``visible`` (None: every key): the top-left
    causal rule and the 0 / −inf bias."""
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril() if call.causal else None
    if call.bias is not None:
        keep = call.bias == 0 if keep is None else keep & (call.bias == 0)
    return keep


def _call_forward(q, k, v, call, scale):
    """(out, lse) of one call; q (n, h, Lq, d), k/v (n, h_kv, Lk, d). Rows with no visible key (dense
    calls of unsorted ids only): out 0, lse −inf."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, call.causal, attn_mask=call.bias, scale=scale)
    else:
        out, lse = explicit_forward(q, k, v, scale, _call_visible(call, q.shape[2], k.shape[2], q.device))
    if call.bias is not None and call.bias.shape[-2] > 1:
        empty = torch.isinf(call.bias).all(-1)                                # (n | 1, 1, Lq)
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def _call_backward(dout, q, k, v, out, lse, call, scale):
    """(dq, dk, dv) of one call given the (global) out and lse of its query rows. Only a call with
    a bias can hold a row that sees no key (lse −inf); without one every row sees a key of this
    call, so its lse, and the global lse ≥ it, is finite."""
    if q.device.type != "cpu":
        return explicit_backward(dout, q, k, v, out, lse, scale,
                                 _call_visible(call, q.shape[2], k.shape[2], q.device))
    if call.bias is not None:  # empty rows: P = exp(−inf − 0) = 0, and O = 0 ⇒ δ = 0
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(q.dtype if q.dtype == torch.float64 else torch.float32),
        0.0, call.causal, attn_mask=call.bias, scale=scale)


# ----------------------------------------------------------------------------- whole attention

def _covers_everything(calls, s_q, s_k) -> bool:
    return len(calls) == 1 and calls[0].view == Segment(None, 0, s_q, 0, s_k)


def attention_forward_torch(q, k, v, mask, scale):
    """(out (b, h, s_q, d) in q's dtype, lse (b, h, s_q) fp32, float64 for float64 inputs)."""
    b, heads, s_q, head_dim = q.shape
    s_k = k.shape[2]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    calls = plan(mask, b, s_q, s_k, q.dtype, q.device)
    if _covers_everything(calls, s_q, s_k):
        out, lse = _call_forward(q, k, v, calls[0], scale)
        return out, lse.to(lse_dtype)
    out = q.new_zeros(b, heads, s_q, head_dim)
    lse = torch.full((b, heads, s_q), float("-inf"), dtype=lse_dtype, device=q.device)
    for c in calls:
        o, l = _call_forward(_take(q, c), _take(k, c, keys=True), _take(v, c, keys=True), c, scale)
        _put(out, c, o)
        _put(lse, c, l.to(lse_dtype))
    return out, lse


def attention_backward_torch(dout, q, k, v, out, lse, mask, scale):
    """(dq, dk, dv) in the dtypes of q, k, v; rows and keys outside every segment get 0."""
    b, _, s_q, _ = q.shape
    s_k = k.shape[2]
    calls = plan(mask, b, s_q, s_k, q.dtype, q.device)
    if _covers_everything(calls, s_q, s_k):
        return _call_backward(dout, q, k, v, out, lse, calls[0], scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, dk, dv = (torch.zeros(t.shape, dtype=compute, device=t.device) for t in (q, k, v))
    for c in calls:
        g_dout = _take(dout, c)
        if c.q_valid is not None:  # padding query rows: dO = 0, so they add nothing to dk, dv and get dq = 0
            g_dout = g_dout.masked_fill(~c.q_valid[:, None, :, None], 0.0)
        g_q, g_k, g_v = _call_backward(g_dout, _take(q, c), _take(k, c, keys=True), _take(v, c, keys=True),
                                       _take(out, c), _take(lse, c), c, scale)
        _put(dq, c, g_q.to(compute), accumulate=True)
        _put(dk, c, g_k.to(compute), keys=True, accumulate=True)   # window chunks share keys; padding keys
        _put(dv, c, g_v.to(compute), keys=True, accumulate=True)   # are seen by no real query: zeros
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
