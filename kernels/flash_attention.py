"""flash_attention: memory-efficient exact attention, forward and backward, with grouped-query heads.

    O = softmax(scale · Q Kᵀ + causal mask) V,   q (b, h, s, d),  k, v (b, h_kv, s, d),  h % h_kv == 0

Query head ``i`` reads kv head ``i // (h / h_kv)`` (as ``repeat_interleave`` of k, v along heads would).
The Triton kernels (kernels/flash_attention_fwd.py, kernels/flash_attention_bwd.py) stream key blocks
through an online softmax and never form the s×s matrix; the forward saves the logsumexp
``lse (b, h, s)`` fp32 and the backward recomputes P from it:

    forward   O = P V,  P = exp(S − lse),  S = scale · Q Kᵀ
    dgrad     δ = rowsum(dO ⊙ O);  dS = P ⊙ (dO Vᵀ − δ);  dQ = scale · dS K
    wgrad     dV = Σ_group Pᵀ dO;  dK = scale · Σ_group dSᵀ Q   (Σ over the query heads of a kv head)

File shape: kernels (fwd/bwd files) → launchers (there) → plain-torch reference → autograd Function →
public op. The torch path (backend="torch", the CPU default) is
``F.scaled_dot_product_attention(..., enable_gqa=True)``; ``attention_reference`` is the explicit
softmax composition that tests hold both paths against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend as _backend
from .flash_attention_bwd import attention_backward_triton
from .flash_attention_fwd import attention_forward_triton, default_scale

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(q, k, v, dtypes=_DTYPES):
    """ValueError naming the offending setting; returns (b, heads, kv_heads, s, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be [b, heads, s, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    b, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, seq_len, head_dim):
        raise ValueError(f"flash_attention: k/v shape {tuple(k.shape)} must match q shape {tuple(q.shape)} "
                         "in batch, sequence length and head dim")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"flash_attention: heads={heads} must be a multiple of kv_heads={kv_heads}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim d={head_dim} must be in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in dtypes:
        raise ValueError(f"flash_attention: q/k/v dtypes ({q.dtype}, {k.dtype}, {v.dtype}) must be equal "
                         f"and one of {dtypes}")
    return b, heads, kv_heads, seq_len, head_dim


# ----------------------------------------------------------------------------- plain-torch reference

def attention_reference(q, k, v, causal=True, softmax_scale=None, return_lse=False):
    """Explicit softmax(scale · Q Kᵀ) V in fp32 (float64 stays float64), materialising s×s.

    Returns ``out`` in q's dtype, and with ``return_lse`` also ``lse (b, h, s)`` in the compute dtype.
    """
    _, heads, kv_heads, seq_len, head_dim = _check_inputs(q, k, v, _DTYPES + (torch.float64,))
    scale = default_scale(head_dim) if softmax_scale is None else softmax_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = heads // kv_heads
    k_full = k.to(compute).repeat_interleave(group, dim=1)                        # (b, h, s, d)
    v_full = v.to(compute).repeat_interleave(group, dim=1)
    scores = scale * q.to(compute) @ k_full.transpose(-1, -2)                     # (b, h, s, s)
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                         # (b, h, s)
    out = (torch.exp(scores - lse[..., None]) @ v_full).to(q.dtype)
    return (out, lse) if return_lse else out


def _attention_torch(q, k, v, causal, softmax_scale):
    """SDPA with ``enable_gqa`` (on CPU as fast as or faster than repeating kv heads, fwd and bwd)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


# ----------------------------------------------------------------------------- autograd Function

class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = attention_forward_triton(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward_triton(grad_out, q, k, v, out, lse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal=True, softmax_scale=None, *, backend=None):
    """Attention ``(b, heads, s, d)`` of q ``(b, heads, s, d)`` over k, v ``(b, kv_heads, s, d)``.

    ``softmax_scale`` defaults to 1/sqrt(d); causal: query i attends keys ≤ i. Differentiable in q, k, v.
    """
    _, _, _, _, head_dim = _check_inputs(q, k, v)
    scale = default_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    if _backend.resolve(backend, q, k, v) == "torch":
        return _attention_torch(q, k, v, causal, scale)
    return _FlashAttention.apply(q, k, v, bool(causal), scale)
