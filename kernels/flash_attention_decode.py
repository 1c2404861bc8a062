"""Flash-decoding: the attention forward of a decode step (one query row per head, s_q = 1).

The forward kernel (kernels/flash_attention_fwd.py) would run one program per (batch, head) over every
key: b·h programs for a whole GPU, each reading its kv head's keys once per query head of the group.
Here instead:

- the ``group`` query heads of one kv head are the rows of one tile (K and V are read once per kv head;
  the tile is padded to 16 rows, tl.dot's minimum; groups of more than MAX_BLOCK_H heads take several);
- the visible keys are split over programs, ``keys_per_split`` each, so b · h_kv · splits programs share
  the work; program (split, batch·kv head) writes its split's normalised partial out_s and lse_s (fp32,
  base 2) with the forward's online softmax;
- a second small kernel merges the splits of each (batch, head), as ``merge_attention`` does:

      lse = log Σ_s e^(lse_s),    out = Σ_s e^(lse_s − lse) · out_s

  A split that sees no key has lse_s = −inf and weight 0; a row that sees none gets out 0, lse −inf.

Masks are the forward's rules (kernels/flash_attention_mask.py) for the one query at position ``shift``
(relative to k_offset): causal and window bound the keys that are split (so a decode step at
``q_offset = s_k − 1`` splits all of them), documents bound each split by the query's document interval,
and every tile is masked element by element (cheap next to reading K and V). K and V are read through
their strides (a KV cache's views); pointer loads, no TMA (decoding is bandwidth-bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend
from .flash_attention_fwd import (LN2, LOG2E, empty_in_layout_of, mask_arguments, mask_constexprs, mma,
                                  online_softmax_step, unit_stride_in_d, visible)

_LN2 = tl.constexpr(LN2)
GPU_META = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
CPU_META = {"BLOCK_N": 16}       # interpreter: small key tiles
MIN_KEYS_PER_SPLIT = 256         # GPU: at least four 64-key tiles per program
MAX_SPLITS = 64                  # the merge kernel holds (splits, d) fp32 partials in registers
MAX_BLOCK_H = 64                 # query heads per tile (128 at d = 128 spills: 164-180 bytes)
CPU_MAX_BLOCK_H = 16             # interpreter: a group of 20 heads takes two tiles
CPU_KEYS_PER_SPLIT = 32          # interpreter: several splits at test sizes


@triton.jit
def _attn_decode_split_kernel(q_ptr, k_ptr, v_ptr, o_part_ptr, lse_part_ptr, q_ids_ptr, k_ids_ptr, start_ptr,
                              end_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, n_kv_heads, group, s_k, first_key, last_key,
                              keys_per_split, shift, window, qk_scale,
                              HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """Program (split, batch·kv head, block of BLOCK_H of the group's heads): partial out (b, h, splits, d)
    and lse (b, h, splits), fp32, over the keys [first_key + split·keys_per_split, + keys_per_split) below
    last_key, within the query's document."""
    split = tl.program_id(0)
    n_splits = tl.num_programs(0)
    bkv = tl.program_id(1)
    b = (bkv // n_kv_heads).to(tl.int64)
    kv_h = (bkv % n_kv_heads).to(tl.int64)
    offs_g = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)         # query head kv_h · group + offs_g
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head_ok = offs_g < group
    d_ok = offs_d < HEAD_DIM
    heads = kv_h * group + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)               # (BLOCK_H, BLOCK_D)
    lo = first_key + split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, last_key)
    q_doc = b
    if DOCS:  # the query's document is the key interval [start, end) (a superset when ids are unsorted)
        lo = tl.maximum(lo, tl.load(start_ptr + b))
        hi = tl.minimum(hi, tl.load(end_ptr + b))
        q_doc = tl.load(q_ids_ptr + b)
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                                        # (BLOCK_N,)
        in_split = cols < hi
        kv_mask = in_split[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), DOT_PRECISION) * qk_scale                             # (BLOCK_H, BLOCK_N)
        k_doc = tl.load(k_ids_ptr + b * s_k + cols, mask=in_split, other=-1) if DOCS else cols
        keep = visible(shift - cols, q_doc, k_doc, window, CAUSAL, WINDOW, DOCS) & in_split  # (BLOCK_N,)
        s = tl.where(keep[None, :], s, -float("inf"))
        p, alpha, l_i, m_i = online_softmax_step(s, m_i, l_i)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, -float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))   # base 2
    rows = (b * n_kv_heads * group + heads) * n_splits + split                          # (BLOCK_H,)
    tl.store(o_part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(lse_part_ptr + rows, lse2, mask=head_ok)


@triton.jit
def _attn_decode_merge_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, n_heads, n_splits, stride_ob, stride_oh,
                              HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (batch·head): out = Σ_s 2^(lse_s − lse) out_s, lse = log2 Σ_s 2^(lse_s) (then natural log)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < HEAD_DIM
    lse2 = tl.load(lse_part_ptr + bh * n_splits + offs_s, mask=s_ok, other=-float("inf"))     # (BLOCK_S,)
    top = tl.max(lse2, axis=0)
    top = tl.where(top == -float("inf"), 0.0, top)                     # every split empty: weights 0
    weight = tl.exp2(lse2 - top)
    total = tl.sum(weight, axis=0)
    parts = tl.load(o_part_ptr + (bh * n_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)                         # (BLOCK_S, BLOCK_D)
    empty = total == 0.0
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, -float("inf"), (top + tl.log2(tl.where(empty, 1.0, total))) * _LN2)
    b, h = bh // n_heads, bh % n_heads
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + bh, lse)


# ----------------------------------------------------------------------------- launcher

def visible_key_span(mask, s_k: int) -> tuple[int, int]:
    """Keys [first, last) the one query may see by causality and the window (documents bound each split)."""
    first, last = 0, s_k
    if mask.causal:
        last = min(last, mask.shift + 1)
    if mask.window_size is not None:
        first = max(first, mask.shift - mask.window_size + 1)
    return first, max(first, last)


def split_plan(n_keys: int, kv_programs: int, device: torch.device, block_n: int) -> tuple[int, int]:
    """(splits, keys_per_split): on a GPU enough programs for two per SM, each over at least
    MIN_KEYS_PER_SPLIT keys (a multiple of the key tile), at most MAX_SPLITS; interpreted, splits of
    CPU_KEYS_PER_SPLIT keys."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = min(MAX_SPLITS, triton.cdiv(2 * sms, kv_programs), max(1, n_keys // MIN_KEYS_PER_SPLIT))
        per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), max(wanted, 1)), block_n) * block_n
    else:
        per_split = CPU_KEYS_PER_SPLIT
    per_split = max(per_split, triton.cdiv(max(n_keys, 1), MAX_SPLITS))
    return max(1, triton.cdiv(n_keys, per_split)), per_split


def attention_decode_triton(q, k, v, mask, softmax_scale: float):
    """(out (b, h, 1, d) in q's dtype and layout order, lse (b, h, 1) fp32) of one query row per head."""
    q, k, v = unit_stride_in_d(q, k, v)
    b, n_heads, s_q, head_dim = q.shape
    if s_q != 1:
        raise ValueError(f"attention_decode_triton: one query row per head (s_q = 1), got s_q = {s_q}")
    n_kv_heads, s_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    meta = dict(GPU_META) if q.is_cuda else dict(CPU_META)
    first, last = visible_key_span(mask, s_k)
    splits, per_split = split_plan(last - first, b * n_kv_heads, q.device, meta["BLOCK_N"])
    o_part = torch.empty((b, n_heads, splits, head_dim), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((b, n_heads, splits), device=q.device, dtype=torch.float32)
    q_ids, k_ids, start, end, _ = mask_arguments(mask, q, k)
    constexprs = mask_constexprs(mask, q)
    block_h = min(max(16, triton.next_power_of_2(group)), MAX_BLOCK_H if q.is_cuda else CPU_MAX_BLOCK_H)
    grid = (splits, b * n_kv_heads, triton.cdiv(group, block_h))
    _backend.launch(_attn_decode_split_kernel, grid, q, k, v, o_part, lse_part, q_ids, k_ids,
                    start, end, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), n_kv_heads, group, s_k, first, last, per_split,
                    mask.shift, mask.window_size or 0, softmax_scale * LOG2E,
                    BLOCK_H=block_h, **constexprs, **meta)
    out = empty_in_layout_of(q)
    lse = torch.empty((b, n_heads, 1), device=q.device, dtype=torch.float32)
    _backend.launch(_attn_decode_merge_kernel, (b * n_heads,), o_part, lse_part, out, lse, n_heads, splits,
                    out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits),
                    BLOCK_D=constexprs["BLOCK_D"])
    return out, lse
