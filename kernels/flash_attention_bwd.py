"""Flash-attention backward: Triton kernels and launcher (the op lives in kernels/flash_attention.py).

With the forward's logsumexp L (so P = exp(S − L) is recomputed per tile, never stored), for
S = scale · Q Kᵀ, P = softmax(S), O = P V and upstream dO:

    δ_i  = Σ_d dO_id · O_id                     (preprocess kernel; equals rowsum(P ⊙ dP))
    dV_j = Σ_i P_ijᵀ dO_i                       dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ⊙ (dP_ij − δ_i)                 dK_j = scale · Σ_i dS_ijᵀ Q_i
                                                 dQ_i = scale · Σ_j dS_ij K_j

Two kernels, no atomics (deterministic): one program per (key block, batch·kv head) accumulates dK, dV
over every query block of every query head sharing that kv head (grouped-query attention sums over
the group in registers); one program per (query block, batch·head) accumulates dQ over key blocks.
Causal tiles are split like the forward: only the diagonal tiles carry the causal mask.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .flash_attention_fwd import LOG2E, check_supported, dot_in_fp32, head_block, mma

_LOG2E = tl.constexpr(LOG2E)  # a global read inside @triton.jit code must be a constexpr
CPU_DELTA_META = {"BLOCK_M": 32}
CPU_DKDV_META = {"BLOCK_M": 16, "BLOCK_N": 32}  # query block divides key block (causal diagonal split)
CPU_DQ_META = {"BLOCK_M": 32, "BLOCK_N": 16}    # key block divides query block


def _dkdv_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn in ((32, 128), (64, 128), (32, 64)) for w, st in ((4, 3), (8, 2))]


def _dq_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn in ((128, 32), (128, 64), (64, 32)) for w, st in ((4, 3), (8, 2))]


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, seq_len, head_dim,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """δ = rowsum(dO ⊙ O) for one block of rows of one (batch, head); O, dO contiguous (b, h, s, d)."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < seq_len) & (offs_d[None, :] < head_dim)
    offsets = bh * seq_len * head_dim + rows[:, None] * head_dim + offs_d[None, :]
    o = tl.load(o_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * seq_len + rows, tl.sum(o * do, axis=1), mask=rows < seq_len)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, offs_n, offs_m, offs_d,
                       seq_len, head_dim, stride_m, qk_scale, lo, hi,
                       BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_F32: tl.constexpr):
    """Add the contributions of query blocks lo, lo + BLOCK_M, ... < hi of one head to (dk, dv)."""
    d_ok = offs_d[None, :] < head_dim
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m                                                       # (BLOCK_M,)
        q_ok = (rows[:, None] < seq_len) & d_ok
        q = tl.load(q_ptrs + start_m * stride_m, mask=q_ok, other=0.0)              # (BLOCK_M, BLOCK_D)
        do = tl.load(do_ptrs + start_m * stride_m, mask=q_ok, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=rows < seq_len, other=0.0) * _LOG2E
        delta = tl.load(delta_ptr + rows, mask=rows < seq_len, other=0.0)
        s_t = mma(k, tl.trans(q), DOT_F32) * qk_scale      # (BLOCK_N, BLOCK_M)
        keep = rows[None, :] < seq_len
        if CAUSAL_MASK:
            keep = keep & (rows[None, :] >= offs_n[:, None])
        p_t = tl.where(keep, tl.exp2(s_t - lse[None, :]), 0.0)
        dv += mma(p_t.to(do.dtype), do, DOT_F32)
        dp_t = mma(v, tl.trans(do), DOT_F32)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += mma(ds_t.to(q.dtype), q, DOT_F32)
    return dk, dv


@triton.autotune(configs=_dkdv_configs(), key=["seq_len", "BLOCK_D", "CAUSAL"])
@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          n_heads, n_kv_heads, group, seq_len, head_dim, qk_scale, softmax_scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          CAUSAL: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (key block, batch·kv head); all tensors contiguous (b, heads, s, d)."""
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b = bkv // n_kv_heads
    kv_h = bkv % n_kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_offsets = bkv.to(tl.int64) * seq_len * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    kv_ok = (offs_n[:, None] < seq_len) & (offs_d[None, :] < head_dim)
    k = tl.load(k_ptr + kv_offsets, mask=kv_ok, other=0.0)                            # (BLOCK_N, BLOCK_D)
    v = tl.load(v_ptr + kv_offsets, mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, group):
        bh = (b * n_heads + kv_h * group + g).to(tl.int64)
        q_ptrs = q_ptr + bh * seq_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
        do_ptrs = do_ptr + bh * seq_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
        lse_row = lse_ptr + bh * seq_len
        delta_row = delta_ptr + bh * seq_len
        if CAUSAL:
            dk, dv = _dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_row, delta_row, offs_n, offs_m,
                                        offs_d, seq_len, head_dim, head_dim, qk_scale, start_n,
                                        start_n + BLOCK_N, BLOCK_M, True, DOT_F32)
            dk, dv = _dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_row, delta_row, offs_n, offs_m,
                                        offs_d, seq_len, head_dim, head_dim, qk_scale, start_n + BLOCK_N,
                                        seq_len, BLOCK_M, False, DOT_F32)
        else:
            dk, dv = _dkdv_query_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_row, delta_row, offs_n, offs_m,
                                        offs_d, seq_len, head_dim, head_dim, qk_scale, 0, seq_len,
                                        BLOCK_M, False, DOT_F32)
    dk = dk * softmax_scale
    tl.store(dk_ptr + kv_offsets, dk.to(dk_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_key_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len, head_dim,
                   stride_n, qk_scale, lo, hi,
                   BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_F32: tl.constexpr):
    """Add the contributions of key blocks lo, lo + BLOCK_N, ... < hi to dq."""
    d_ok = offs_d[None, :] < head_dim
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                       # (BLOCK_N,)
        kv_ok = (cols[:, None] < seq_len) & d_ok
        k = tl.load(k_ptrs + start_n * stride_n, mask=kv_ok, other=0.0)              # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs + start_n * stride_n, mask=kv_ok, other=0.0)
        s = mma(q, tl.trans(k), DOT_F32) * qk_scale        # (BLOCK_M, BLOCK_N)
        keep = cols[None, :] < seq_len
        if CAUSAL_MASK:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), DOT_F32)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, DOT_F32)
    return dq


@triton.autotune(configs=_dq_configs(), key=["seq_len", "BLOCK_D", "CAUSAL"])
@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        n_heads, group, seq_len, head_dim, qk_scale, softmax_scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        CAUSAL: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (query block, batch·head); all tensors contiguous (b, heads, s, d)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    bkv = (bh // n_heads) * (n_heads // group) + (bh % n_heads) // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len
    q_offsets = bh * seq_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    q_ok = row_ok[:, None] & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + q_offsets, mask=q_ok, other=0.0)                              # (BLOCK_M, BLOCK_D)
    do = tl.load(do_ptr + q_offsets, mask=q_ok, other=0.0)
    lse = tl.load(lse_ptr + bh * seq_len + offs_m, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + bh * seq_len + offs_m, mask=row_ok, other=0.0)
    kv_offsets = bkv * seq_len * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    k_ptrs = k_ptr + kv_offsets
    v_ptrs = v_ptr + kv_offsets
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        dq = _dq_key_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len, head_dim,
                            head_dim, qk_scale, 0, start_m, BLOCK_N, False, DOT_F32)
        dq = _dq_key_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len, head_dim,
                            head_dim, qk_scale, start_m, start_m + BLOCK_M, BLOCK_N, True, DOT_F32)
    else:
        dq = _dq_key_blocks(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len, head_dim,
                            head_dim, qk_scale, 0, seq_len, BLOCK_N, False, DOT_F32)
    dq = dq * softmax_scale
    tl.store(dq_ptr + q_offsets, dq.to(dq_ptr.dtype.element_ty), mask=q_ok)


def attention_backward_triton(grad_out, q, k, v, out, lse, mask, softmax_scale: float, deterministic: bool):
    """(dq, dk, dv) for q (b, h, s, d), k/v (b, kv_h, s, d), out, lse (b, h, s) fp32."""
    check_supported(q, k, mask)
    q, k, v, out, lse, causal = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), mask.causal
    b, n_heads, seq_len, head_dim = q.shape
    n_kv_heads = k.shape[1]
    group = n_heads // n_kv_heads
    block_d = head_block(head_dim)
    grad_out = grad_out.contiguous()
    delta = torch.full_like(lse, float("nan"))                                        # poisoned
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    delta_grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_bwd_delta_kernel, delta_grid, out, grad_out, delta,
                    seq_len, head_dim, BLOCK_M=128, BLOCK_D=block_d, cpu_meta=CPU_DELTA_META)
    common = dict(BLOCK_D=block_d, CAUSAL=causal, DOT_F32=dot_in_fp32(q))
    qk_scale = softmax_scale * LOG2E
    dkdv_grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_N"]), b * n_kv_heads)  # noqa: E731
    _backend.launch(_attn_bwd_dkdv_kernel, dkdv_grid, q, k, v, grad_out, lse, delta, dk, dv,
                    n_heads, n_kv_heads, group, seq_len, head_dim, qk_scale, softmax_scale,
                    cpu_meta=CPU_DKDV_META, **common)
    dq_grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_bwd_dq_kernel, dq_grid, q, k, v, grad_out, lse, delta, dq,
                    n_heads, group, seq_len, head_dim, qk_scale, softmax_scale,
                    cpu_meta=CPU_DQ_META, **common)
    return dq, dk, dv
