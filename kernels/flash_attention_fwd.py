"""Flash-attention forward: Triton kernel and launcher (the op lives in kernels/flash_attention.py).

Per query block Q_i (BLOCK_M rows) and head h (kv head h // group), an online softmax over key tiles
K_j, V_j (BLOCK_N rows), never forming the s_q×s_k score matrix. In base 2 (exp2 is the fast unit):

    S_ij = Q_i K_jᵀ · scale · log2(e) (+ −inf where masked)       (BLOCK_M, BLOCK_N), fp32
    m_new = max(m, rowmax S_ij);  α = 2^(m − m_new);  P_ij = 2^(S_ij − m_new)
    l = α·l + rowsum P_ij;        acc = α·acc + P_ij V_j
    O_i = acc / l;                lse_i = (m + log2 l) · ln 2   (natural-log logsumexp)

Which key tiles a query block visits (kernels/flash_attention_mask.py for the rules): ``key_range``
bounds the keys any of its rows may see — causal and window from the positions, documents from the
per-row key interval of the row's document — and the interior where every row sees every key. Tiles
outside the range are skipped (never loaded); interior tiles run without masks; the tiles at the two
edges apply the mask element by element (one loop with a per-tile branch: one loop per kind of tile
keeps more values live and spills). A row that sees nothing keeps m = −inf and l = 0: out 0, lse −inf.
Heads of width 16..128 are padded to BLOCK_D (next power of two).

Q, K, V and O are read and written through their strides (any layout with unit stride in d). On
Hopper, with 16-byte aligned strides, tiles arrive through TMA descriptors over the (b, heads, s, d)
tensors (``USE_TMA``: one box per (batch, head, row block), zero-filled past s and d); otherwise
through masked pointer loads. The launchers and autotune configs (pruned to those that compile
without spills, ``fwd_fits``) are shared with the backward (kernels/flash_attention_bwd.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .flash_attention_mask import document_ranges
from .philox import attention_keep

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host-side tensor descriptors: pointer loads only
    TensorDescriptor = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)  # a global read inside @triton.jit code must be a constexpr
NO_KEY = tl.constexpr(-2 ** 30)  # a key position offset that fails every mask (|positions| < 2^29)
CPU_FWD_META = {"BLOCK_M": 32, "BLOCK_N": 16}  # interpreter blocks: small, several per s = 67
TUNE_KEY = ["q_bucket", "k_bucket", "HEAD_DIM", "CAUSAL", "WINDOW", "DOCS", "DOT_PRECISION"]
DROP_TUNE_KEY = TUNE_KEY + ["DROPOUT"]
SHARED_MEMORY_BYTES = 232448  # per block on sm_90 (227 KB)


# Resource model of the compiled sm_90 kernel, calibrated on ptxas' report for every config below
# (bf16/fp16 at d = 64 and 128): a config that passes compiles without spills and fits the 227 KB of
# shared memory; the autotuner never times the others.

def fwd_fits(c, block_d, elt, dropout=False):
    """Q once and K, V per pipeline stage in shared memory; the fp32 accumulator and score tile per
    thread ≤ 160 registers (measured: 128×64 at 4 warps, d = 128, estimate 192, spills 184 bytes).
    Dropout's Philox words count two more registers per score element (measured: 128×128 at
    8 warps, d = 128, estimate 256, spills 3984 bytes; 128×64, estimate 160, none)."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    estimate = (bm * block_d + bm * bn) / (32 * c.num_warps) * elt / 2
    if dropout:
        estimate += 2 * bm * bn / (32 * c.num_warps)
    return estimate <= 160 and (bm * block_d + 2 * c.num_stages * bn * block_d) * elt <= SHARED_MEMORY_BYTES


def prune_with(fits):
    """early_config_prune: the configs that fit at this head width and dtype; the smallest if none does."""
    def prune(configs, named_args, **kwargs):
        dropout = bool(kwargs.get("DROPOUT", False))
        kept = [c for c in configs
                if fits(c, kwargs["BLOCK_D"], element_size(named_args["q_ptr"]), dropout)]
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]
    return prune


def set_tma_blocks(nargs, rows_of):
    """Autotune pre-hook: a TMA descriptor's box is one (batch, head)'s tile of the config's block rows."""
    for name, rows in rows_of.items():
        if TensorDescriptor is not None and isinstance(nargs[name], TensorDescriptor):
            nargs[name].block_shape = [1, 1, nargs[rows], nargs["BLOCK_D"]]


def configs(choices, rows_of):
    """Autotune configs from (BLOCK_M, BLOCK_N, warps, stages) tuples; their pre-hook sizes TMA boxes."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st,
                          pre_hook=functools.partial(set_tma_blocks, rows_of=rows_of))
            for bm, bn, w, st in choices]


def element_size(source) -> int:
    """Bytes per element of a tensor or of a TMA descriptor's tensor."""
    is_descriptor = TensorDescriptor is not None and isinstance(source, TensorDescriptor)
    return (source.base if is_descriptor else source).element_size()


FWD_TMA_ROWS = {"q_ptr": "BLOCK_M", "k_ptr": "BLOCK_N", "v_ptr": "BLOCK_N"}  # descriptor → its box's rows


def _fwd_configs():
    """Hopper search space: 128-row query blocks at 8 warps, 64 for short query chunks (decoding)."""
    return configs(((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                    (64, 64, 8, 3)), FWD_TMA_ROWS)


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b with an fp32 result: on the native input dtype (DOT_PRECISION 0), or upcast to fp32 and
    multiplied in ``ieee`` (1) or ``tf32`` (2) precision (see ``dot_precision``)."""
    if DOT_PRECISION == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT_PRECISION == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    else:
        return tl.dot(a, b)


@triton.jit
def head_source(src, b, h, stride_b, stride_h, USE_TMA: tl.constexpr):
    """What ``load_rows`` reads one (batch, head) of a (b, heads, s, d) tensor through: its TMA
    descriptor, or the pointer to the head's first row."""
    if USE_TMA:
        return src
    else:
        return src + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def load_rows(src, b, h, start, offs_rows, stride_row, n_rows, offs_d, HEAD_DIM: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Rows ``start + offs_rows`` of one head's (n_rows, HEAD_DIM) matrix as a (len(offs_rows), BLOCK_D) tile,
    zero past n_rows and HEAD_DIM: one TMA box (the copy engine zero-fills out of bounds), or masked loads
    whose addresses are formed here, per tile, so no tile of 64-bit pointers stays live across a loop."""
    if USE_TMA:
        return src.load([b, h, start, 0]).reshape(offs_rows.shape[0], offs_d.shape[0])
    else:
        rows = start + offs_rows
        return tl.load(src + rows[:, None] * stride_row + offs_d[None, :],
                       mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def tile_grid(lo, lo_full, hi_full, BLOCK: tl.constexpr):
    """On the BLOCK grid: the first tile of the visible range [lo, hi), and the tiles [mid_lo, mid_hi)
    inside [lo_full, hi_full) that need no mask; every other tile in [first, hi) is masked."""
    first = (lo // BLOCK) * BLOCK
    mid_lo = tl.maximum(tl.cdiv(lo_full, BLOCK) * BLOCK, first)
    return first, mid_lo, tl.maximum((hi_full // BLOCK) * BLOCK, mid_lo)


@triton.jit
def key_range(first, last, s_k, shift, window, start_ptr, end_ptr, exact_ptr, offs, row_ok,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Keys [lo, hi) some query row in [first, last] may see, and [lo_full, hi_full) every row sees.
    Key j is visible to row i when j ≤ i + shift (causal) and j > i + shift − window (window)."""
    lo = 0
    hi = s_k
    lo_full = 0
    hi_full = s_k
    if CAUSAL:
        hi = tl.minimum(hi, last + shift + 1)
        hi_full = tl.minimum(hi_full, first + shift + 1)
    if WINDOW:
        lo = tl.maximum(lo, first + shift - window + 1)
        lo_full = tl.maximum(lo_full, last + shift - window + 1)
    if DOCS:  # each row's document is the key interval [start, end)
        starts = tl.load(start_ptr + offs, mask=row_ok, other=0)
        ends = tl.load(end_ptr + offs, mask=row_ok, other=0)
        lo = tl.maximum(lo, tl.min(tl.where(row_ok, starts, s_k), axis=0))
        hi = tl.minimum(hi, tl.max(ends, axis=0))
        lo_full = tl.maximum(lo_full, tl.max(starts, axis=0))
        hi_full = tl.minimum(hi_full, tl.min(tl.where(row_ok, ends, s_k), axis=0))
        hi_full = tl.where(tl.load(exact_ptr) != 0, hi_full, 0)  # unsorted ids: every tile masked
    lo = tl.maximum(lo, 0)
    return lo, tl.maximum(lo_full, lo), tl.minimum(hi_full, hi), hi


@triton.jit
def visible(rel, row_doc, col_doc, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """True where a key is visible to a query, element by element: ``rel`` = query_pos − key_pos and the
    document ids, as broadcastable tiles. Callers form ``rel`` from the loop-varying index inside the
    loop, so no loop-invariant 2-d mask is hoisted out of it (it would stay live in registers). A key
    marked absent by a ``rel`` below −2^29 (see NO_KEY) is never visible."""
    if CAUSAL:
        keep = rel >= 0
    else:
        keep = rel > NO_KEY // 2
    if WINDOW:
        keep = keep & (rel < window)
    if DOCS:
        keep = keep & (row_doc == col_doc)
    return keep


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax in base 2: scores s (rows, BLOCK_N) (−inf where masked),
    running max m_i and sum l_i (rows,) → (P = 2^(s − m_new), α = 2^(m_i − m_new), l_i·α + Σ P,
    m_new); the caller rescales its accumulator by α and adds P·V. A row that has seen no key yet
    keeps m = −inf and takes 0 as its reference, so P = 0 and α = 1, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, axis=1), m_new


@triton.jit
def dropped(p, drop_key, drop_threshold, drop_scale, sample, head, q_global, k_global,
            DROPOUT: tl.constexpr):
    """P ⊙ Z of a tile: kept entries · 1/(1 − p), dropped 0 (``q_global`` (rows, 1) and
    ``k_global`` (1, cols) or transposed: the tile's global positions); P itself without DROPOUT."""
    if DROPOUT:
        keep = attention_keep(drop_key, drop_threshold, sample, head, q_global, k_global)
        return tl.where(keep, p * drop_scale, 0.0)
    else:
        return p


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, q_doc, k_src, v_src, b, kv_h, k_ids_ptr, q_pos, offs_n, offs_d, s_k, window,
               stride_kn, stride_vn, qk_scale, lo, hi, mid_lo, mid_hi, drop_key, drop_threshold, drop_scale,
               drop_sample, drop_head, k_offset, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
               USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with the key tiles lo, lo + BLOCK_N, ... < hi, masking
    those outside [mid_lo, mid_hi); ``q_pos`` = query rows + shift (positions relative to k_offset).
    One loop with a per-tile branch, not one loop per kind of tile: fewer live values, no spills.
    DROPOUT: the accumulator takes P ⊙ Z (mask of the global positions q_pos + k_offset,
    cols + k_offset), the normaliser l the undropped P."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                       # (BLOCK_N,)
        k = load_rows(k_src, b, kv_h, start_n, offs_n, stride_kn, s_k, offs_d, HEAD_DIM, USE_TMA)  # (BLOCK_N, BLOCK_D)
        s = mma(q, tl.trans(k), DOT_PRECISION) * qk_scale                                   # (BLOCK_M, BLOCK_N)
        if (start_n < mid_lo) | (start_n >= mid_hi):
            k_doc = tl.load(k_ids_ptr + cols, mask=cols < s_k, other=-1) if DOCS else cols
            keep = visible(q_pos[:, None] - cols[None, :], q_doc[:, None], k_doc[None, :], window, CAUSAL, WINDOW, DOCS)
            s = tl.where(keep & (cols[None, :] < s_k), s, -float("inf"))  # keys past s_k would join the softmax
        p, alpha, l_i, m_i = online_softmax_step(s, m_i, l_i)
        p = dropped(p, drop_key, drop_threshold, drop_scale, drop_sample, drop_head,
                    (q_pos + k_offset)[:, None], (cols + k_offset)[None, :], DROPOUT)
        v = load_rows(v_src, b, kv_h, start_n, offs_n, stride_vn, s_k, offs_d, HEAD_DIM, USE_TMA)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.autotune(configs=_fwd_configs(), key=DROP_TUNE_KEY,
                 prune_configs_by={"early_config_prune": prune_with(fwd_fits)})
@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_ids_ptr, k_ids_ptr, start_ptr, end_ptr, exact_ptr,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                     n_heads, group, s_q, s_k, shift, window, qk_scale, q_bucket, k_bucket,
                     drop_key, drop_threshold, drop_scale, drop_sample, drop_head, k_offset,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Program (query block, batch·head). Writes O (b, h, s_q, d) and lse (b, h, s_q) fp32. q, k, v are
    pointers, or TMA descriptors over (b, heads, s, d) when USE_TMA."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # an aligned causal diagonal then spans BLOCK_M / BLOCK_N tiles
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // n_heads
    kv_h = (bh % n_heads) // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < s_q
    io_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    h = bh % n_heads
    q = load_rows(head_source(q_ptr, b, h, stride_qb, stride_qh, USE_TMA), b, h, start_m, tl.arange(0, BLOCK_M),
                  stride_qm, s_q, offs_d, HEAD_DIM, USE_TMA)                          # (BLOCK_M, BLOCK_D)
    k_src = head_source(k_ptr, b, kv_h, stride_kb, stride_kh, USE_TMA)
    v_src = head_source(v_ptr, b, kv_h, stride_vb, stride_vh, USE_TMA)
    row_ids = b.to(tl.int64) * s_q + offs_m
    q_doc = tl.load(q_ids_ptr + row_ids, mask=row_ok, other=-2) if DOCS else offs_m
    lo, lo_full, hi_full, hi = key_range(start_m, tl.minimum(start_m + BLOCK_M, s_q) - 1, s_k, shift, window,
                                         start_ptr, end_ptr, exact_ptr + b, row_ids, row_ok, CAUSAL, WINDOW, DOCS)
    first, mid_lo, mid_hi = tile_grid(lo, lo_full, hi_full, BLOCK_N)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_doc, k_src, v_src, b, kv_h, k_ids_ptr + b.to(tl.int64) * s_k,
                               offs_m + shift, offs_n, offs_d, s_k, window, stride_kn, stride_vn, qk_scale,
                               first, hi, mid_lo, mid_hi, drop_key, drop_threshold, drop_scale, drop_sample + b,
                               drop_head + h, k_offset, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, DOCS, DOT_PRECISION,
                               USE_TMA, DROPOUT)
    empty = l_i == 0.0                                                  # no visible key: out 0, lse −inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, -float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=io_ok)
    tl.store(lse_ptr + bh.to(tl.int64) * s_q + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------- launcher helpers

def head_block(head_dim: int) -> int:
    """The padded head width the kernels tile with: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def tune_bucket(length: int) -> int:
    """Sequence lengths the autotuner tells apart: powers of two (decoding does not retune every step)."""
    return min(triton.next_power_of_2(max(length, 16)), 16384)


def dot_precision(t: torch.Tensor) -> int:
    """How the kernels' dots multiply: 0 on the native 16-bit dtype (GPU fp16/bf16), 1 upcast to fp32
    ``ieee``, 2 fp32 as ``tf32``.

    fp32 inputs: ``ieee`` (full precision), or ``tf32`` on a GPU when ``torch.backends.cuda.matmul.allow_tf32``
    (as kernels.matmul; fp32 ``ieee`` dots have no tensor-core path on Hopper and spill). bf16 on the
    interpreter: ``ieee``, because Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16
    storage; upcasting is exact (a bf16×bf16 product fits fp32, and the GPU's bf16 MMA accumulates in fp32).
    """
    if t.dtype == torch.float32:
        return 2 if t.is_cuda and torch.backends.cuda.matmul.allow_tf32 else 1
    return 1 if t.dtype == torch.bfloat16 and not t.is_cuda else 0


def unit_stride_in_d(*tensors):
    """The tensors with a unit stride in the last dim (a copy only for the rare other layout)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def empty_in_layout_of(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialised tensor of t's shape whose dims are laid out in t's stride order (a (b, h, s, d)
    view of a (s, b, h, d) buffer gets the same), dense."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))                  # outermost first
    buffer = torch.empty([t.shape[i] for i in order], dtype=dtype or t.dtype, device=t.device)
    return buffer.permute([order.index(i) for i in range(t.dim())])


def tma_usable(*tensors) -> bool:
    """Whether the kernels read these (b, heads, s, d) tensors through TMA descriptors: a Hopper or newer
    GPU, and every stride but the unit last one (and the base address) 16-byte aligned."""
    if TensorDescriptor is None or not all(t.is_cuda for t in tensors):
        return False
    if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def tma_source(t, use_tma: bool, block_rows: int, block_d: int):
    """What a kernel reads t (b, heads, s, d) through: a TMA descriptor (box: block_rows × block_d of one
    head; the autotune pre-hook resizes it per config), or t itself for pointer loads."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, block_d]) if use_tma else t


def mask_arguments(mask, q, k, rows_are_queries=True):
    """(row ids, col ids, col start, col end, exact) for the kernels; placeholders without documents."""
    if not mask.has_documents:
        dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        return dummy, dummy, dummy, dummy, dummy
    q_ids, k_ids = (ids if ids.dtype in (torch.int32, torch.int64) else ids.to(torch.int32)
                    for ids in (mask.q_document_ids, mask.k_document_ids))
    q_ids, k_ids = q_ids.contiguous(), k_ids.contiguous()
    rows, cols = (q_ids, k_ids) if rows_are_queries else (k_ids, q_ids)
    start, end, exact = document_ranges(rows, cols)
    return q_ids, k_ids, start, end, exact


def dropout_arguments(dropout, mask):
    """(key, threshold, scale, first sample, head offset, k_offset) and the DROPOUT constexpr of
    the attention kernels; zeros without dropout."""
    if dropout is None:
        return (0, 0, 1.0, 0, 0, 0), False
    return (dropout.key, dropout.threshold, dropout.scale, dropout.first_sample,
            dropout.head_offset, mask.k_offset), True


def mask_constexprs(mask, q):
    return dict(CAUSAL=mask.causal, WINDOW=mask.window_size is not None, DOCS=mask.has_documents,
                DOT_PRECISION=dot_precision(q), HEAD_DIM=q.shape[-1], BLOCK_D=head_block(q.shape[-1]))


def attention_forward_triton(q, k, v, mask, softmax_scale: float, dropout=None):
    """(out (b, h, s_q, d) in q's dtype and layout order, lse (b, h, s_q) fp32); ``dropout``: an
    ``AttentionDropout`` (the lse stays undropped)."""
    drop_args, has_dropout = dropout_arguments(dropout, mask)
    q, k, v = unit_stride_in_d(q, k, v)
    b, n_heads, s_q, _ = q.shape
    s_k = k.shape[2]
    out = empty_in_layout_of(q)
    lse = torch.empty((b, n_heads, s_q), device=q.device, dtype=torch.float32)
    q_ids, k_ids, start, end, exact = mask_arguments(mask, q, k)
    use_tma, block_d = tma_usable(q, k, v), head_block(q.shape[-1])
    q_src = tma_source(q, use_tma, CPU_FWD_META["BLOCK_M"], block_d)
    k_src, v_src = (tma_source(t, use_tma, CPU_FWD_META["BLOCK_N"], block_d) for t in (k, v))
    grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_fwd_kernel, grid, q_src, k_src, v_src, out, lse, q_ids, k_ids, start, end, exact,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                    n_heads, n_heads // k.shape[1], s_q, s_k, mask.shift, mask.window_size or 0,
                    softmax_scale * LOG2E, tune_bucket(s_q), tune_bucket(s_k), *drop_args,
                    USE_TMA=use_tma, DROPOUT=has_dropout, cpu_meta=CPU_FWD_META, **mask_constexprs(mask, q))
    return out, lse
