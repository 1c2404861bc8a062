"""Token permutation for mixture-of-experts: scatter tokens into expert-grouped rows and gather the
experts' rows back, weighted by the routing probabilities.

A *row map* ``row_map (T, k)`` (int) says where token t's j-th routing slot lives among the
permuted rows (−1: the slot is unused, e.g. a dropped token)::

  permute    rows[row_map[t, j]] = x[t]                         rows (R, H); rows no slot points
                                                                at stay 0 (capacity padding)
             backward   dx[t] = Σ_j drows[row_map[t, j]]        (= unpermute without probs)
  unpermute  y[t] = Σ_j p[t, j] · rows[row_map[t, j]]           y (T, H); p = 1 when probs is None
             backward   drows[row_map[t, j]] = p[t, j] · dy[t]  (0 for rows nobody reads)
                        dp[t, j]            = ⟨dy[t], rows[row_map[t, j]]⟩

Each kernel runs one program per token and walks the hidden dim in blocks; the slots j are a
compile-time loop (k is the router's top-k, or 1 for a plain row reordering). Sums are fp32; the
outputs keep the rows' dtype (the probabilities' dtype for dp).

File shape: Triton kernels → launchers → torch paths (also the reference) → autograd Functions →
``permute_tokens`` / ``unpermute_tokens``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend as _backend

CPU_BLOCK_H = 16            # interpreter: small blocks so test widths span several of them
GPU_BLOCK_H = 1024


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _permute_kernel(x_ptr, map_ptr, rows_ptr, H, stride_x, stride_rows,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """rows[row_map[t, j]] = x[t] for every used slot j of token t."""
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_row = offs < H
        value = tl.load(x_ptr + t * stride_x + offs, mask=in_row)
        for j in tl.static_range(TOPK):
            row = tl.load(map_ptr + t * TOPK + j).to(tl.int64)
            tl.store(rows_ptr + row * stride_rows + offs, value, mask=in_row & (offs * 0 + row >= 0))


@triton.jit
def _unpermute_kernel(rows_ptr, map_ptr, probs_ptr, y_ptr, H, stride_rows, stride_y,
                      HAS_PROBS: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[t] = Σ_j p[t, j] · rows[row_map[t, j]] (p = 1 without probs), summed in fp32."""
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_row = offs < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            row = tl.load(map_ptr + t * TOPK + j).to(tl.int64)
            value = tl.load(rows_ptr + row * stride_rows + offs, mask=in_row & (offs * 0 + row >= 0),
                            other=0.0).to(tl.float32)
            if HAS_PROBS:
                value = value * tl.load(probs_ptr + t * TOPK + j).to(tl.float32)
            acc += value
        tl.store(y_ptr + t * stride_y + offs, acc.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _unpermute_backward_kernel(dy_ptr, rows_ptr, map_ptr, probs_ptr, drows_ptr, dprobs_ptr, H,
                               stride_dy, stride_rows, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """drows[row_map[t, j]] = p[t, j]·dy[t] and dp[t, j] = ⟨dy[t], rows[row_map[t, j]]⟩."""
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(TOPK):
        row = tl.load(map_ptr + t * TOPK + j).to(tl.int64)
        p = tl.load(probs_ptr + t * TOPK + j).to(tl.float32)
        dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            used = (offs < H) & (offs * 0 + row >= 0)
            g = tl.load(dy_ptr + t * stride_dy + offs, mask=offs < H, other=0.0).to(tl.float32)
            value = tl.load(rows_ptr + row * stride_rows + offs, mask=used, other=0.0)
            tl.store(drows_ptr + row * stride_rows + offs,
                     (p * g).to(drows_ptr.dtype.element_ty), mask=used)
            dot += g * value.to(tl.float32)
        tl.store(dprobs_ptr + t * TOPK + j, tl.sum(dot, axis=0).to(dprobs_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- launchers

def _block_h(t: torch.Tensor) -> int:
    return GPU_BLOCK_H if t.is_cuda else CPU_BLOCK_H


def permute_triton(x, row_map, num_rows):
    """``rows (num_rows, H)``: each used slot's token row; unused rows are 0."""
    rows = torch.zeros((num_rows, x.shape[1]), device=x.device, dtype=x.dtype)
    if x.shape[0] and x.shape[1]:
        _backend.launch(_permute_kernel, (x.shape[0],), x, row_map, rows, x.shape[1],
                        x.stride(0), rows.stride(0), TOPK=row_map.shape[1],
                        BLOCK_H=_block_h(x))
    return rows


def unpermute_triton(rows, row_map, probs):
    """``y (T, H)``: the probability-weighted sum of each token's rows."""
    y = torch.empty((row_map.shape[0], rows.shape[1]), device=rows.device, dtype=rows.dtype)
    if y.numel():
        _backend.launch(_unpermute_kernel, (y.shape[0],), rows, row_map,
                        probs if probs is not None else row_map, y, rows.shape[1],
                        rows.stride(0), y.stride(0), HAS_PROBS=probs is not None,
                        TOPK=row_map.shape[1], BLOCK_H=_block_h(rows))
    return y


def unpermute_backward_triton(dy, rows, row_map, probs):
    """``(drows, dprobs)`` of unpermute with probabilities (see the module docstring)."""
    drows = torch.zeros_like(rows)
    dprobs = torch.empty_like(probs)
    if dy.shape[0]:
        _backend.launch(_unpermute_backward_kernel, (dy.shape[0],), dy, rows, row_map, probs,
                        drows, dprobs, rows.shape[1], dy.stride(0), rows.stride(0),
                        TOPK=row_map.shape[1], BLOCK_H=_block_h(rows))
    return drows, dprobs


# ----------------------------------------------------------------------------- torch paths

def _used_slots(row_map):
    """(token index, row) of every used slot, in (t, j) order."""
    used = row_map >= 0
    tokens = torch.arange(row_map.shape[0], device=row_map.device)[:, None].expand_as(row_map)
    return tokens[used], row_map[used].long()


def permute_torch(x, row_map, num_rows):
    rows = x.new_zeros((num_rows, x.shape[1]))
    tokens, targets = _used_slots(row_map)
    rows[targets] = x[tokens]
    return rows


def _gather_slots(rows, row_map):
    """(T, k, H) fp32: row ``row_map[t, j]`` per slot (unused slots read row 0, or a zero row
    when there are no rows at all, e.g. a rank whose experts received no token)."""
    if rows.shape[0] == 0:
        rows = rows.new_zeros((1, rows.shape[1]))
    return rows[row_map.clamp(min=0).long()].float()


def unpermute_torch(rows, row_map, probs):
    used = row_map >= 0
    weights = used.float() if probs is None else probs.float() * used           # (T, k)
    gathered = _gather_slots(rows, row_map)                                     # (T, k, H)
    return (gathered * weights[..., None]).sum(1).to(rows.dtype)


def unpermute_backward_torch(dy, rows, row_map, probs):
    used = row_map >= 0
    gathered = _gather_slots(rows, row_map)                                     # (T, k, H)
    dprobs = ((gathered * dy.float()[:, None, :]).sum(-1) * used).to(probs.dtype)
    drows = torch.zeros_like(rows)
    tokens, targets = _used_slots(row_map)
    drows[targets] = (probs[used].float()[:, None] * dy[tokens].float()).to(rows.dtype)
    return drows, dprobs


_PATHS = {  # path: (permute, unpermute, unpermute backward with probs)
    "triton": (permute_triton, unpermute_triton, unpermute_backward_triton),
    "torch": (permute_torch, unpermute_torch, unpermute_backward_torch),
}


# ----------------------------------------------------------------------------- autograd

class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_map, num_rows, path):
        ctx.save_for_backward(row_map)
        ctx.path = path
        return _PATHS[path][0](x, row_map, num_rows)            # (R, H)

    @staticmethod
    def backward(ctx, drows):
        (row_map,) = ctx.saved_tensors
        dx = _PATHS[ctx.path][1](drows.contiguous(), row_map, None)   # (T, H)
        return dx, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_map, probs, path):
        ctx.save_for_backward(rows, row_map, probs)
        ctx.path = path
        return _PATHS[path][1](rows, row_map, probs)            # (T, H)

    @staticmethod
    def backward(ctx, dy):
        rows, row_map, probs = ctx.saved_tensors
        dy = dy.contiguous()
        if probs is None:
            return _PATHS[ctx.path][0](dy, row_map, rows.shape[0]), None, None, None
        drows, dprobs = _PATHS[ctx.path][2](dy, rows, row_map, probs)
        return drows, None, dprobs, None


def _check(tokens_or_rows, row_map, what):
    if tokens_or_rows.dim() != 2 or row_map.dim() != 2:
        raise ValueError(f"{what} needs a 2-D tensor and a (T, k) row_map, got "
                         f"{tuple(tokens_or_rows.shape)} and {tuple(row_map.shape)}")
    if row_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_map must be int32 or int64, got {row_map.dtype}")


def permute_tokens(x, row_map, num_rows: int, *, backend=None):
    """``x (T, H)`` → ``rows (num_rows, H)`` with ``rows[row_map[t, j]] = x[t]``; rows that no
    slot points at are zeros. Every used ``row_map`` entry must be distinct and < num_rows."""
    _check(x, row_map, "permute_tokens")
    if row_map.shape[0] != x.shape[0]:
        raise ValueError(f"row_map has {row_map.shape[0]} tokens, x has {x.shape[0]}")
    path = _backend.resolve(backend, x)
    return _Permute.apply(x.contiguous(), row_map.contiguous(), int(num_rows), path)


def unpermute_tokens(rows, row_map, probs=None, *, backend=None):
    """``rows (R, H)`` → ``y (T, H)`` with ``y[t] = Σ_j probs[t, j] · rows[row_map[t, j]]``
    (unused slots skipped; probs (T, k) or None for weights 1). Differentiable in rows and probs."""
    _check(rows, row_map, "unpermute_tokens")
    if probs is not None and probs.shape != row_map.shape:
        raise ValueError(f"probs {tuple(probs.shape)} must match row_map "
                         f"{tuple(row_map.shape)}")
    path = _backend.resolve(backend, rows)
    return _Unpermute.apply(rows.contiguous(), row_map.contiguous(),
                            None if probs is None else probs.contiguous(), path)
