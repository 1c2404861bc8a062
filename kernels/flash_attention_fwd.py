"""Flash-attention forward: Triton kernel and launcher (the op lives in kernels/flash_attention.py).

Per query block Q_i (BLOCK_M rows) and head h (kv head h // group), an online softmax over key blocks
K_j, V_j (BLOCK_N rows), never forming the s×s score matrix. In base 2 (exp2 is the fast unit):

    S_ij = Q_i K_jᵀ · scale · log2(e)                    (BLOCK_M, BLOCK_N), fp32
    m_new = max(m, rowmax S_ij);  α = 2^(m − m_new);  P_ij = 2^(S_ij − m_new)
    l = α·l + rowsum P_ij;        acc = α·acc + P_ij V_j
    O_i = acc / l;                lse_i = (m + log2 l) · ln 2   (natural-log logsumexp, saved for backward)

Causal attention (query i sees keys ≤ i) splits the key range of a query block starting at m0 into
off-diagonal blocks [0, m0), which need no causal mask, and the diagonal blocks [m0, m0 + BLOCK_M),
which do (BLOCK_N divides BLOCK_M). Heads of any width 16..128 are padded to BLOCK_D, the next power
of two, with masked loads; sequence tails are masked too.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import backend as _backend

LOG2E = 1.4426950408889634
CPU_FWD_META = {"BLOCK_M": 32, "BLOCK_N": 16}  # interpreter blocks: small, several per s = 67


def _fwd_configs():
    """Hopper-oriented search space: BLOCK_M 128, BLOCK_N 64/128, 4/8 warps, 2-4 pipeline stages."""
    return [triton.Config({"BLOCK_M": 128, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4)]


@triton.jit
def mma(a, b, DOT_F32: tl.constexpr):
    """a @ b with an fp32 result; in fp32 ``ieee`` precision when DOT_F32 (see ``dot_in_fp32``)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd_key_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len, head_dim,
                    stride_kn, stride_vn, qk_scale, lo, hi,
                    BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_F32: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with key blocks starting at lo, lo + BLOCK_N, ... < hi."""
    d_ok = offs_d[None, :] < head_dim
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                       # (BLOCK_N,)
        kv_ok = (cols[:, None] < seq_len) & d_ok
        k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_ok, other=0.0)              # (BLOCK_N, BLOCK_D)
        s = mma(q, tl.trans(k), DOT_F32) * qk_scale        # (BLOCK_M, BLOCK_N)
        keep = cols[None, :] < seq_len
        if CAUSAL_MASK:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is seen first by every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_fwd_configs(), key=["seq_len", "BLOCK_D", "CAUSAL"])
@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                     n_heads, group, seq_len, head_dim, qk_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (query block, batch·head). Writes O (b, h, s, d) and lse (b, h, s) fp32."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    kv_h = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    row_ok = offs_m[:, None] < seq_len
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok & d_ok, other=0.0)
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len,
                                        head_dim, stride_kn, stride_vn, qk_scale, 0, start_m,
                                        BLOCK_N, False, DOT_F32)
        acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len,
                                        head_dim, stride_kn, stride_vn, qk_scale, start_m,
                                        start_m + BLOCK_M, BLOCK_N, True, DOT_F32)
    else:
        acc, l_i, m_i = _fwd_key_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, seq_len,
                                        head_dim, stride_kn, stride_vn, qk_scale, 0, seq_len,
                                        BLOCK_N, False, DOT_F32)
    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok & d_ok)
    tl.store(lse_ptr + bh.to(tl.int64) * seq_len + offs_m, lse, mask=offs_m < seq_len)


def head_block(head_dim: int) -> int:
    """The padded head width the kernels tile with: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_in_fp32(t: torch.Tensor) -> bool:
    """Whether the kernels' dots run as fp32 ``ieee`` dots rather than on the native input dtype.

    fp32 inputs: yes (full precision, not TF32). bf16 on the interpreter: yes, because Triton 3.9's
    interpreter multiplies bf16 tiles as their raw uint16 storage; upcasting is exact (a bf16×bf16
    product fits fp32, and the GPU's bf16 MMA accumulates in fp32 too). fp16/bf16 on GPU: no.
    """
    return t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and not t.is_cuda)


def check_supported(q, k, mask):
    if mask.window_size is not None or mask.has_documents or mask.shift != 0 or q.shape[2] != k.shape[2]:
        raise NotImplementedError("the Triton flash-attention kernels take causal or full masks with "
                                  "s_q == s_k and q_offset == k_offset; use backend='torch'")


def attention_forward_triton(q, k, v, mask, softmax_scale: float):
    """(out (b, h, s, d) in q's dtype, lse (b, h, s) fp32)."""
    check_supported(q, k, mask)
    q, k, v, causal = q.contiguous(), k.contiguous(), v.contiguous(), mask.causal
    b, n_heads, seq_len, head_dim = q.shape
    group = n_heads // k.shape[1]
    out = torch.full_like(q, float("nan"))                                           # poisoned
    lse = torch.full((b, n_heads, seq_len), float("nan"), device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_M"]), b * n_heads)  # noqa: E731
    _backend.launch(_attn_fwd_kernel, grid, q, k, v, out, lse,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                    n_heads, group, seq_len, head_dim, softmax_scale * LOG2E,
                    BLOCK_D=head_block(head_dim), CAUSAL=causal, DOT_F32=dot_in_fp32(q),
                    cpu_meta=CPU_FWD_META)
    return out, lse

