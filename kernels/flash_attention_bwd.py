"""Flash-attention backward: Triton kernels and launcher (the op lives in kernels/flash_attention.py).

With the logsumexp L of the (possibly merged) forward, P = exp(S − L) is recomputed per tile, never
stored; for S = scale · Q Kᵀ (+ mask), O = P V and upstream dO:

    δ_i  = Σ_d dO_id · O_id                     (preprocess kernel; equals rowsum(P ⊙ dP))
    dV_j = Σ_i P_ijᵀ dO_i                       dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ⊙ (dP_ij − δ_i)                 dK_j = scale · Σ_i dS_ijᵀ Q_i
                                                 dQ_i = scale · Σ_j dS_ij K_j

One program per (key block, batch·kv head) holds K_j, V_j and accumulates dK_j, dV_j over every query
tile of every query head sharing that kv head (grouped-query heads summed in registers). K is
pre-scaled once, K' = K · scale · log2(e), so the score tile is one GEMM in base 2 and
dQ = dS K' · ln 2. Default: the same program adds each tile's dS K' into an fp32 dQ with atomics —
five GEMMs per tile (S, dP, dV, dK, dQ). ``deterministic``: a second kernel, one program per (query
block, batch·head), accumulates dQ over key tiles in a fixed order (recomputing S and dP: seven GEMMs).
Tile skipping, masking, TMA loads and config pruning follow the forward (kernels/flash_attention_fwd.py):
``query_range`` is ``key_range`` seen from a key block. An empty row (lse = −inf) reads lse = +inf, so
its P = 2^(S − inf) = 0.

Dropout (DROPOUT, an ``AttentionDropout``): the mask Z of each tile is regenerated from the global
(sample, head, query, key) coordinates exactly as in the forward; dV_j = Σ_i (P ⊙ Z)_ijᵀ dO_i and
dS = P ⊙ (Z ⊙ dP − δ) (δ = rowsum(dO ⊙ O) of the dropped output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend
from . import flash_attention_fwd as _fwd  # tma_usable looked up at call time (tests force the TMA path)
from .flash_attention_fwd import (DROP_TUNE_KEY, LN2, LOG2E, NO_KEY, SHARED_MEMORY_BYTES, configs,
                                  dropout_arguments, dropped, element_size, empty_in_layout_of, head_source,
                                  key_range, load_rows, mask_arguments, mask_constexprs, mma, prune_with,
                                  tile_grid, tma_source, tune_bucket, unit_stride_in_d, visible)

_LOG2E = tl.constexpr(LOG2E)  # a global read inside @triton.jit code must be a constexpr
_LN2 = tl.constexpr(LN2)
CPU_DELTA_META = {"BLOCK_M": 32}
CPU_DKDV_META = {"BLOCK_M": 16, "BLOCK_N": 32}  # query tile divides key block
CPU_DQ_META = {"BLOCK_M": 32, "BLOCK_N": 16}    # key tile divides query block


# Resource models of the compiled sm_90 kernels, calibrated on ptxas' report for every config below
# (bf16/fp16 at d = 64 and 128): a config whose estimate passes compiles without spills and fits the
# 227 KB of shared memory; the autotuner never times the others.

def dkdv_shared_bytes(block_m, block_n, block_d, stages, elt):
    """K, V and the pre-scaled K (twice: both GEMM operand layouts); Q and dO tiles per pipeline stage;
    the P/dS tile transposed for the dQ GEMM; lse and δ per stage."""
    return (3 * block_n * block_d + 2 * stages * block_m * block_d + 2 * block_m * block_n) * elt + 8 * stages * block_m


def dkdv_registers(block_m, block_n, block_d, warps):
    """fp32 dK, dV accumulators + the S/P and dP/dS tiles, per thread."""
    return (2 * block_n * block_d + 2 * block_m * block_n) / (32 * warps)


def dkdv_fits(c, block_d, elt, dropout=False):
    """Below 160 registers of estimate, a third pipeline stage only below 96, and at d = 128 query tiles
    of at most 32 rows (measured: 64×64 at 8 warps, d = 128, estimate 96, uses all 255 registers and
    spills 24-84 bytes under Triton 3.6 with pointer loads or every mask rule, 16 with 3 stages).
    Dropout's mask fits the same configs (measured at d = 128: at most 255 registers, no spills)."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    estimate = dkdv_registers(bm, bn, block_d, c.num_warps) * elt / 2
    return (estimate < 160 and (c.num_stages == 2 or estimate < 96) and (block_d < 128 or bm <= 32)
            and dkdv_shared_bytes(bm, bn, block_d, c.num_stages, elt) <= SHARED_MEMORY_BYTES)


def dq_fits(c, block_d, elt, dropout=False):
    """fp32 dQ accumulator + the S/P and dP/dS tiles per thread ≤ 160; Q, dO once, K, V per stage
    (with dropout too: measured at d = 128, no spills)."""
    bm, bn, warps, stages = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    estimate = (bm * block_d + 2 * bm * bn) / (32 * warps) * elt / 2
    return estimate <= 160 and (2 * bm * block_d + 2 * stages * bn * block_d) * elt <= SHARED_MEMORY_BYTES


BWD_TMA_ROWS = {"q_ptr": "BLOCK_M", "do_ptr": "BLOCK_M", "k_ptr": "BLOCK_N", "v_ptr": "BLOCK_N"}


def _dkdv_configs():
    """64×128 tiles at 8 warps first (the Hopper shape; spill-free up to d = 64), then smaller ones."""
    return configs(((64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2), (32, 64, 8, 3),
                    (16, 64, 8, 2), (16, 64, 4, 2)), BWD_TMA_ROWS)


def _dq_configs():
    return configs(((128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)), BWD_TMA_ROWS)


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, stride_ob, stride_oh, stride_om,
                           stride_dob, stride_doh, stride_dom, n_heads, s_q,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """δ = rowsum(dO ⊙ O) for one block of rows of one (batch, head); δ (b, h, s_q) fp32."""
    bh = tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    start = tl.program_id(0) * BLOCK_M
    o = load_rows(o_ptr + b * stride_ob + h * stride_oh, b, h, start, tl.arange(0, BLOCK_M), stride_om, s_q, offs_d,
                  HEAD_DIM, False).to(tl.float32)
    do = load_rows(do_ptr + b * stride_dob + h * stride_doh, b, h, start, tl.arange(0, BLOCK_M), stride_dom, s_q,
                   offs_d, HEAD_DIM, False).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * s_q + rows, tl.sum(o * do, axis=1), mask=rows < s_q)


@triton.jit
def query_range(first, last, s_q, shift, window, start_ptr, end_ptr, exact_ptr, offs, col_ok,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Query rows [lo, hi) that may see some key in [first, last], and [lo_full, hi_full) that see them
    all: ``key_range`` with the roles swapped (row i sees key j when i ≥ j − shift, i < j − shift + window)."""
    lo = 0
    hi = s_q
    lo_full = 0
    hi_full = s_q
    if CAUSAL:
        lo = tl.maximum(lo, first - shift)
        lo_full = tl.maximum(lo_full, last - shift)
    if WINDOW:
        hi = tl.minimum(hi, last - shift + window)
        hi_full = tl.minimum(hi_full, first - shift + window)
    if DOCS:  # each key's document is the query interval [start, end)
        starts = tl.load(start_ptr + offs, mask=col_ok, other=0)
        ends = tl.load(end_ptr + offs, mask=col_ok, other=0)
        lo = tl.maximum(lo, tl.min(tl.where(col_ok, starts, s_q), axis=0))
        hi = tl.minimum(hi, tl.max(ends, axis=0))
        lo_full = tl.maximum(lo_full, tl.max(starts, axis=0))
        hi_full = tl.minimum(hi_full, tl.min(tl.where(col_ok, ends, s_q), axis=0))
        hi_full = tl.where(tl.load(exact_ptr) != 0, hi_full, 0)
    lo = tl.maximum(lo, 0)
    return lo, tl.maximum(lo_full, lo), tl.minimum(hi_full, hi), hi


@triton.jit
def _dkdv_tiles(dk, dv, k_scaled, v, k_doc, q_src, do_src, b, h, dq_base, lse_ptr, delta_ptr, q_ids_ptr,
                k_pos, offs_m, offs_d, s_q, window, stride_qm, stride_dom, stride_dqm, lo, hi, mid_lo, mid_hi,
                drop_key, drop_threshold, drop_scale, drop_sample, drop_head, q_offset, k_global,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                DOCS: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                DROPOUT: tl.constexpr):
    """Add the query tiles lo, lo + BLOCK_M, ... < hi of one head to (dk, dv) [and dq], masking those
    outside [mid_lo, mid_hi). ``k_pos`` = shift − key rows (NO_KEY past s_k). Rows past s_q (q = dO = 0,
    lse = δ = 0) add nothing to dK, dV (P·0, P·(0 − 0)); masked tiles mask the rules and keys past s_k."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m                                                       # (BLOCK_M,)
        q = load_rows(q_src, b, h, start_m, offs_m, stride_qm, s_q, offs_d, HEAD_DIM, USE_TMA)  # (BLOCK_M, BLOCK_D)
        do = load_rows(do_src, b, h, start_m, offs_m, stride_dom, s_q, offs_d, HEAD_DIM, USE_TMA)
        lse = tl.load(lse_ptr + rows, mask=rows < s_q, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=rows < s_q, other=0.0)
        lse = tl.where(lse == -float("inf"), float("inf"), lse * _LOG2E)   # empty rows: P = 2^(S − inf) = 0
        s_t = mma(k_scaled, tl.trans(q), DOT_PRECISION) - lse[None, :]                          # (BLOCK_N, BLOCK_M)
        if (start_m < mid_lo) | (start_m >= mid_hi):
            q_doc = tl.load(q_ids_ptr + rows, mask=rows < s_q, other=-2) if DOCS else rows
            keep = visible(rows[None, :] + k_pos[:, None], q_doc[None, :], k_doc[:, None], window,
                           CAUSAL, WINDOW, DOCS)                                          # (BLOCK_N, BLOCK_M)
            s_t = tl.where(keep, s_t, -float("inf"))
        p_t = tl.exp2(s_t)
        q_global = (rows + q_offset)[None, :]                                          # (1, BLOCK_M)
        dv += mma(dropped(p_t, drop_key, drop_threshold, drop_scale, drop_sample, drop_head, q_global, k_global,
                          DROPOUT).to(do.dtype), do, DOT_PRECISION)
        dp_t = dropped(mma(v, tl.trans(do), DOT_PRECISION), drop_key, drop_threshold, drop_scale, drop_sample,
                       drop_head, q_global, k_global, DROPOUT)
        ds_t = p_t * (dp_t - delta[None, :])                                              # (BLOCK_N, BLOCK_M)
        dk += mma(ds_t.to(q.dtype), q, DOT_PRECISION)
        if ATOMIC_DQ:
            dq = mma(tl.trans(ds_t.to(q.dtype)), k_scaled, DOT_PRECISION) * _LN2              # (BLOCK_M, BLOCK_D)
            dq_ok = (rows[:, None] < s_q) & (offs_d[None, :] < HEAD_DIM)
            tl.atomic_add(dq_base + rows[:, None] * stride_dqm + offs_d[None, :], dq, mask=dq_ok, sem="relaxed")
    return dk, dv


@triton.autotune(configs=_dkdv_configs(), key=DROP_TUNE_KEY + ["ATOMIC_DQ"], reset_to_zero=["dq_ptr"],
                 prune_configs_by={"early_config_prune": prune_with(dkdv_fits)})
@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                          q_ids_ptr, k_ids_ptr, start_ptr, end_ptr, exact_ptr,
                          stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                          stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn,
                          stride_dvb, stride_dvh, stride_dvn,
                          n_heads, n_kv_heads, s_q, s_k, shift, window, qk_scale, softmax_scale, q_bucket, k_bucket,
                          drop_key, drop_threshold, drop_scale, drop_sample, drop_head, k_offset,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                          ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                          DROPOUT: tl.constexpr):
    """Program (key block, batch·kv head): dK, dV of the block [and its dQ contributions, atomically].
    q, k, v, dO are pointers, or TMA descriptors over (b, heads, s, d) when USE_TMA."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # an aligned causal diagonal then spans BLOCK_N / BLOCK_M tiles
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b = bkv // n_kv_heads
    kv_h = bkv % n_kv_heads
    group = n_heads // n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < s_k
    rows_n = tl.arange(0, BLOCK_N)
    k = load_rows(head_source(k_ptr, b, kv_h, stride_kb, stride_kh, USE_TMA), b, kv_h, start_n, rows_n, stride_kn,
                  s_k, offs_d, HEAD_DIM, USE_TMA)                                       # (BLOCK_N, BLOCK_D)
    v = load_rows(head_source(v_ptr, b, kv_h, stride_vb, stride_vh, USE_TMA), b, kv_h, start_n, rows_n, stride_vn,
                  s_k, offs_d, HEAD_DIM, USE_TMA)
    k_scaled = k.to(tl.float32) * qk_scale
    if DOT_PRECISION == 0:
        k_scaled = k_scaled.to(k.dtype)
    col_ids = b.to(tl.int64) * s_k + offs_n
    k_doc = tl.load(k_ids_ptr + col_ids, mask=col_ok, other=-1) if DOCS else offs_n
    lo, lo_full, hi_full, hi = query_range(start_n, tl.minimum(start_n + BLOCK_N, s_k) - 1, s_q, shift, window,
                                           start_ptr, end_ptr, exact_ptr + b, col_ids, col_ok,
                                           CAUSAL, WINDOW, DOCS)
    hi_full = tl.where(start_n + BLOCK_N <= s_k, hi_full, 0)  # a partial key block masks every tile
    first, mid_lo, mid_hi = tile_grid(lo, lo_full, hi_full, BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    q_ids = q_ids_ptr + b.to(tl.int64) * s_q
    k_pos = tl.where(col_ok, shift - offs_n, NO_KEY)  # keys past s_k fail every rule (no inf · 0 in dQ)
    for g in range(0, group):
        h = kv_h * group + g
        q_src = head_source(q_ptr, b, h, stride_qb, stride_qh, USE_TMA)
        do_src = head_source(do_ptr, b, h, stride_dob, stride_doh, USE_TMA)
        dq_base = dq_ptr + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
        lse_row = lse_ptr + (b * n_heads + h).to(tl.int64) * s_q
        delta_row = delta_ptr + (b * n_heads + h).to(tl.int64) * s_q
        dk, dv = _dkdv_tiles(dk, dv, k_scaled, v, k_doc, q_src, do_src, b, h, dq_base, lse_row, delta_row, q_ids,
                             k_pos, offs_m, offs_d, s_q, window, stride_qm, stride_dom, stride_dqm,
                             first, hi, mid_lo, mid_hi, drop_key, drop_threshold, drop_scale, drop_sample + b,
                             drop_head + h, shift + k_offset, (offs_n + k_offset)[:, None], HEAD_DIM, BLOCK_M,
                             CAUSAL, WINDOW, DOCS, ATOMIC_DQ, DOT_PRECISION, USE_TMA, DROPOUT)
    kv_ok = col_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    dk_ptrs = dk_ptr + b.to(tl.int64) * stride_dkb + kv_h.to(tl.int64) * stride_dkh \
        + offs_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = dv_ptr + b.to(tl.int64) * stride_dvb + kv_h.to(tl.int64) * stride_dvh \
        + offs_n[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * softmax_scale).to(dk_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, q_doc, k_src, v_src, b, kv_h, k_ids_ptr, q_pos, offs_n, offs_d, s_k, window,
              stride_kn, stride_vn, qk_scale, lo, hi, mid_lo, mid_hi, drop_key, drop_threshold, drop_scale,
              drop_sample, drop_head, k_offset, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Add the key tiles lo, lo + BLOCK_N, ... < hi to dq (in units of K, scaled at the end), masking those
    outside [mid_lo, mid_hi) (the only ones reaching past s_k); ``q_pos`` = query rows + shift."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                       # (BLOCK_N,)
        k = load_rows(k_src, b, kv_h, start_n, offs_n, stride_kn, s_k, offs_d, HEAD_DIM, USE_TMA)  # (BLOCK_N, BLOCK_D)
        v = load_rows(v_src, b, kv_h, start_n, offs_n, stride_vn, s_k, offs_d, HEAD_DIM, USE_TMA)
        p = tl.exp2(mma(q, tl.trans(k), DOT_PRECISION) * qk_scale - lse[:, None])             # (BLOCK_M, BLOCK_N)
        if (start_n < mid_lo) | (start_n >= mid_hi):
            k_doc = tl.load(k_ids_ptr + cols, mask=cols < s_k, other=-1) if DOCS else cols
            keep = visible(q_pos[:, None] - cols[None, :], q_doc[:, None], k_doc[None, :], window, CAUSAL, WINDOW,
                           DOCS)
            p = tl.where(keep & (cols[None, :] < s_k), p, 0.0)
        dp = dropped(mma(do, tl.trans(v), DOT_PRECISION), drop_key, drop_threshold, drop_scale, drop_sample,
                     drop_head, (q_pos + k_offset)[:, None], (cols + k_offset)[None, :], DROPOUT)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, DOT_PRECISION)
    return dq


@triton.autotune(configs=_dq_configs(), key=DROP_TUNE_KEY,
                 prune_configs_by={"early_config_prune": prune_with(dq_fits)})
@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        q_ids_ptr, k_ids_ptr, start_ptr, end_ptr, exact_ptr,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                        stride_dqb, stride_dqh, stride_dqm,
                        n_heads, group, s_q, s_k, shift, window, qk_scale, softmax_scale, q_bucket, k_bucket,
                        drop_key, drop_threshold, drop_scale, drop_sample, drop_head, k_offset,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Program (query block, batch·head): dQ over the visible key tiles in order (deterministic). q, k, v,
    dO are pointers, or TMA descriptors over (b, heads, s, d) when USE_TMA."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # an aligned causal diagonal then spans BLOCK_M / BLOCK_N tiles
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    kv_h = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < s_q
    rows_m = tl.arange(0, BLOCK_M)
    q = load_rows(head_source(q_ptr, b, h, stride_qb, stride_qh, USE_TMA), b, h, start_m, rows_m, stride_qm, s_q,
                  offs_d, HEAD_DIM, USE_TMA)                                            # (BLOCK_M, BLOCK_D)
    do = load_rows(head_source(do_ptr, b, h, stride_dob, stride_doh, USE_TMA), b, h, start_m, rows_m, stride_dom,
                   s_q, offs_d, HEAD_DIM, USE_TMA)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * s_q + offs_m, mask=row_ok, other=0.0)
    lse = tl.where(lse == -float("inf"), float("inf"), lse * _LOG2E)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * s_q + offs_m, mask=row_ok, other=0.0)
    k_src = head_source(k_ptr, b, kv_h, stride_kb, stride_kh, USE_TMA)
    v_src = head_source(v_ptr, b, kv_h, stride_vb, stride_vh, USE_TMA)
    row_ids = b.to(tl.int64) * s_q + offs_m
    q_doc = tl.load(q_ids_ptr + row_ids, mask=row_ok, other=-2) if DOCS else offs_m
    lo, lo_full, hi_full, hi = key_range(start_m, tl.minimum(start_m + BLOCK_M, s_q) - 1, s_k, shift, window,
                                         start_ptr, end_ptr, exact_ptr + b, row_ids, row_ok, CAUSAL, WINDOW, DOCS)
    first, mid_lo, mid_hi = tile_grid(lo, lo_full, hi_full, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, q_doc, k_src, v_src, b, kv_h, k_ids_ptr + b.to(tl.int64) * s_k,
                   offs_m + shift, offs_n, offs_d, s_k, window, stride_kn, stride_vn, qk_scale, first, hi, mid_lo,
                   mid_hi, drop_key, drop_threshold, drop_scale, drop_sample + b, drop_head + h, k_offset,
                   HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, DOCS, DOT_PRECISION, USE_TMA, DROPOUT)
    dq_ptrs = dq_ptr + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh \
        + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, (dq * softmax_scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------- launcher

def _sources(q, k, v, grad_out, use_tma, cpu_meta, constexprs):
    """q, k, v, dO as the kernels read them (TMA descriptors sized for the interpreter's blocks; on a GPU the
    autotune pre-hook resizes them per config)."""
    rows = (cpu_meta["BLOCK_M"], cpu_meta["BLOCK_N"], cpu_meta["BLOCK_N"], cpu_meta["BLOCK_M"])
    return [tma_source(t, use_tma, r, constexprs["BLOCK_D"]) for t, r in zip((q, k, v, grad_out), rows)]


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()[:3]]


def attention_backward_triton(grad_out, q, k, v, out, lse, mask, softmax_scale: float, deterministic: bool,
                              dropout=None):
    """(dq, dk, dv) in the dtypes and layout orders of q, k, v; lse (b, h, s_q) fp32 of the whole attention;
    ``dropout``: the forward's ``AttentionDropout`` (its mask regenerated per tile)."""
    drop_args, has_dropout = dropout_arguments(dropout, mask)
    grad_out, q, k, v, out = unit_stride_in_d(grad_out, q, k, v, out)
    lse = lse.float().contiguous()
    b, n_heads, s_q, head_dim = q.shape
    n_kv_heads, s_k = k.shape[1], k.shape[2]
    constexprs = mask_constexprs(mask, q)
    delta = torch.empty_like(lse)
    delta_grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_bwd_delta_kernel, delta_grid, out, grad_out, delta, *_strides(out, grad_out), n_heads, s_q,
                    HEAD_DIM=head_dim, BLOCK_M=64, BLOCK_D=constexprs["BLOCK_D"], cpu_meta=CPU_DELTA_META)
    atomic = not deterministic
    dq = empty_in_layout_of(q, torch.float32 if atomic else q.dtype)
    if atomic:
        dq.zero_()
    dk, dv = empty_in_layout_of(k), empty_in_layout_of(v)
    scalars = (mask.shift, mask.window_size or 0, softmax_scale * LOG2E, softmax_scale, tune_bucket(s_q),
               tune_bucket(s_k), *drop_args)
    use_tma = _fwd.tma_usable(q, k, v, grad_out)
    dkdv_grid = lambda meta: (triton.cdiv(s_k, meta["BLOCK_N"]), b * n_kv_heads)  # noqa: E731
    _backend.launch(_attn_bwd_dkdv_kernel, dkdv_grid, *_sources(q, k, v, grad_out, use_tma, CPU_DKDV_META, constexprs),
                    lse, delta, dq, dk, dv, *mask_arguments(mask, q, k, rows_are_queries=False),
                    *_strides(q, k, v, grad_out, dq, dk, dv), n_heads, n_kv_heads, s_q, s_k, *scalars,
                    ATOMIC_DQ=atomic, USE_TMA=use_tma, DROPOUT=has_dropout, cpu_meta=CPU_DKDV_META, **constexprs)
    if atomic:
        return dq.to(q.dtype), dk, dv
    dq_grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_bwd_dq_kernel, dq_grid, *_sources(q, k, v, grad_out, use_tma, CPU_DQ_META, constexprs),
                    lse, delta, dq, *mask_arguments(mask, q, k), *_strides(q, k, v, grad_out, dq), n_heads,
                    n_heads // n_kv_heads, s_q, s_k, *scalars, USE_TMA=use_tma, DROPOUT=has_dropout,
                    cpu_meta=CPU_DQ_META, **constexprs)
    return dq, dk, dv
