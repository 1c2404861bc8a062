"""flash_attention: memory-efficient exact attention, forward and backward, with grouped-query heads,
causal / sliding-window / document masks, position offsets and the logsumexp.

    O = softmax(scale · Q Kᵀ + M) V,   q (b, h, s_q, d),  k, v (b, h_kv, s_k, d),  h % h_kv == 0

Query head ``i`` reads kv head ``i // (h / h_kv)`` (as ``repeat_interleave`` of k, v along heads would).
M is 0 where key j is visible to query i and −inf elsewhere (kernels/flash_attention_mask.py): query i sits
at position ``q_offset + i``, key j at ``k_offset + j``; ``causal`` keeps key_pos ≤ query_pos;
``window_size=W`` keeps query_pos − key_pos < W (the last W positions including the query itself, as
Mistral's / HF's ``sliding_window``); document ids keep equal ids only. A decode step is s_q = 1 with
``q_offset = s_k − 1``. A query with no visible key gets out 0 and lse −inf.

The logsumexp ``lse_i = log Σ_j exp(S_ij)`` (fp32) makes attention over a key range splittable: the
attention over keys A ∪ B is ``merge_attention`` of the attentions over A and over B, and the backward
over B needs only the merged out and lse (ring attention calls ``attention_forward`` /
``attention_backward`` per key block):

    forward   O = P V,  P = exp(S − lse),  S = scale · Q Kᵀ + M
    dgrad     δ = rowsum(dO ⊙ O);  dS = P ⊙ (dO Vᵀ − δ);  dQ = scale · dS K
    wgrad     dV = Σ_group Pᵀ dO;  dK = scale · Σ_group dSᵀ Q   (Σ over the query heads of a kv head)

Dropout on the probabilities (``dropout``: a ``kernels.philox.AttentionDropout``): the mask of
each element is a function of its global sample, head and query / key positions, regenerated in
the backward (the Triton kernels draw it per tile, no s_q×s_k tensor); the lse is the undropped
softmax's, so partial attentions merge as without dropout:

    forward   O = (P ⊙ Z) V,  Z = keep / (1 − p)
    dgrad     dS = P ⊙ (Z ⊙ (dO Vᵀ) − δ),  δ = rowsum(dO ⊙ O);   wgrad  dV = Σ_group (P ⊙ Z)ᵀ dO

One query row per head (a decode step) runs the flash-decoding forward (kernels/flash_attention_decode.py:
keys split over programs, partial (out, lse) merged), any other s_q the tiled forward.

File shape: Triton kernels and launchers (kernels/flash_attention_fwd.py, _decode.py, _bwd.py) → the torch path
(kernels/flash_attention_torch.py, the CPU default) → the plain-torch reference (kernels/flash_attention_reference.py,
checked here) → autograd Function → public ops. ``attention_reference`` is the explicit masked softmax every path is tested against.
"""
from __future__ import annotations

import torch

from . import backend as _backend
from .flash_attention_bwd import attention_backward_triton
from .flash_attention_decode import attention_decode_triton
from .flash_attention_fwd import attention_forward_triton
from .flash_attention_mask import build_mask, check_softmax_scale
from .flash_attention_reference import compute_dtype, explicit_backward, explicit_forward
from .flash_attention_torch import attention_backward_torch, attention_forward_torch

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(q, k, v, dtypes=_DTYPES):
    """ValueError naming the offending setting; returns the head dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be [b, heads, s, d], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    b, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape[0], k.shape[3]) != (b, head_dim):
        raise ValueError(f"flash_attention: k/v shape {tuple(k.shape)} must match q shape {tuple(q.shape)} "
                         "in batch and head dim")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"flash_attention: heads={heads} must be a multiple of kv_heads={kv_heads}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim d={head_dim} must be in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in dtypes:
        raise ValueError(f"flash_attention: q/k/v dtypes ({q.dtype}, {k.dtype}, {v.dtype}) must be equal "
                         f"and one of {dtypes}")
    return head_dim


def _settings(q, k, v, causal, softmax_scale, masks, dtypes=_DTYPES):
    """(AttentionMask, scale) after every check, so a bad call fails before any work."""
    head_dim = _check_inputs(q, k, v, dtypes)
    return build_mask(q, k, causal, **masks), check_softmax_scale(softmax_scale, head_dim)


# ----------------------------------------------------------------------------- plain-torch reference

def attention_reference(q, k, v, causal=True, softmax_scale=None, *, window_size=None, q_document_ids=None,
                        k_document_ids=None, q_offset=0, k_offset=0, return_lse=False):
    """Explicit masked softmax(scale · Q Kᵀ + M) V in fp32 (float64 stays float64), materialising s_q×s_k
    (``flash_attention_reference.explicit_forward`` after the checks of ``flash_attention``).

    The arguments of ``flash_attention``. Returns ``out`` in q's dtype, and with ``return_lse`` also
    ``lse (b, h, s_q)`` in the compute dtype. Empty rows: out 0, lse −inf, gradients 0.
    """
    mask, scale = _settings(q, k, v, causal, softmax_scale, dict(
        window_size=window_size, q_document_ids=q_document_ids, k_document_ids=k_document_ids,
        q_offset=q_offset, k_offset=k_offset), _DTYPES + (torch.float64,))
    out, lse = explicit_forward(q, k, v, scale, mask.visible(q.shape[2], k.shape[2], q.device))
    return (out, lse) if return_lse else out


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Attention over key sets A ∪ B from the attentions over A and over B (disjoint key sets):

        lse = log(e^lse_a + e^lse_b),   out = e^(lse_a − lse) · out_a + e^(lse_b − lse) · out_b

    out ``(b, h, s, d)``, lse ``(b, h, s)``; a row empty in one part takes the other's values, a row empty
    in both stays out 0, lse −inf. Returns ``(out, lse)`` in the dtypes of out_a and lse_a.
    """
    compute = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    lse = torch.logaddexp(lse_a.to(compute), lse_b.to(compute))                   # (b, h, s)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)   # both parts empty: weights e^(−inf − 0) = 0
    weight_a = torch.exp(lse_a.to(compute) - finite)[..., None]
    weight_b = torch.exp(lse_b.to(compute) - finite)[..., None]
    out = weight_a * out_a.to(compute) + weight_b * out_b.to(compute)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


# ----------------------------------------------------------------------------- non-autograd building blocks

def _dropout_factor(q, k, mask, dropout, dtype):
    b, h, s_q, _ = q.shape
    return dropout.factor(b, h, s_q, k.shape[2], mask.q_offset, mask.k_offset, q.device, dtype)


def _forward(q, k, v, mask, scale, backend, dropout=None):
    path = _backend.resolve(backend, q, k, v)
    if dropout is not None and path == "torch":   # the explicit softmax: the mask materialised
        visible = mask.visible(q.shape[2], k.shape[2], q.device)
        return explicit_forward(q, k, v, scale, visible,
                                _dropout_factor(q, k, mask, dropout, compute_dtype(q)))
    if dropout is not None:
        return attention_forward_triton(q, k, v, mask, scale, dropout)
    if path == "torch":
        return attention_forward_torch(q, k, v, mask, scale)
    if q.shape[2] == 1:  # a decode step: the keys split over programs (flash-decoding)
        return attention_decode_triton(q, k, v, mask, scale)
    return attention_forward_triton(q, k, v, mask, scale)


def _backward(dout, q, k, v, out, lse, mask, scale, deterministic, backend, dropout=None):
    path = _backend.resolve(backend, q, k, v)
    if dropout is not None and path == "torch":
        visible = mask.visible(q.shape[2], k.shape[2], q.device)
        return explicit_backward(dout, q, k, v, out, lse, scale, visible,
                                 _dropout_factor(q, k, mask, dropout, compute_dtype(q)))
    if path == "torch":
        return attention_backward_torch(dout, q, k, v, out, lse, mask, scale)
    return attention_backward_triton(dout, q, k, v, out, lse, mask, scale, deterministic, dropout)


def attention_forward(q, k, v, causal=True, softmax_scale=None, *, window_size=None, q_document_ids=None,
                      k_document_ids=None, q_offset=0, k_offset=0, backend=None, dropout=None):
    """``(out (b, h, s_q, d), lse (b, h, s_q) fp32)`` of attention over these keys only; no autograd.

    The same arguments as ``flash_attention``. Partial results over disjoint key blocks combine with
    ``merge_attention`` (also with ``dropout``: an ``AttentionDropout``, its lse undropped).
    """
    mask, scale = _settings(q, k, v, causal, softmax_scale, dict(
        window_size=window_size, q_document_ids=q_document_ids, k_document_ids=k_document_ids,
        q_offset=q_offset, k_offset=k_offset))
    return _forward(q, k, v, mask, scale, backend, dropout)


def attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None, *, window_size=None,
                       q_document_ids=None, k_document_ids=None, q_offset=0, k_offset=0,
                       deterministic=False, backend=None, dropout=None):
    """``(dq, dk, dv)`` of attention over these keys, given dout and the out / lse of the *whole*
    attention (after every ``merge_attention``): the contribution of this key block; no autograd.

    dk, dv are complete for these keys; dq sums over the key blocks. ``deterministic`` selects the
    Triton backward without atomics (the torch path is always deterministic).
    """
    mask, scale = _settings(q, k, v, causal, softmax_scale, dict(
        window_size=window_size, q_document_ids=q_document_ids, k_document_ids=k_document_ids,
        q_offset=q_offset, k_offset=k_offset))
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"attention_backward: dout {tuple(dout.shape)} and out {tuple(out.shape)} must have "
                         f"q's shape {tuple(q.shape)}, lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    return _backward(dout, q, k, v, out, lse, mask, scale, bool(deterministic), backend, dropout)


# ----------------------------------------------------------------------------- autograd Function

class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, deterministic, backend, dropout):
        out, lse = _forward(q, k, v, mask, scale, backend, dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (mask, scale, deterministic, backend, dropout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q, k, v, causal=True, softmax_scale=None, *, window_size=None, q_document_ids=None,
                    k_document_ids=None, q_offset=0, k_offset=0, return_lse=False, deterministic=False,
                    backend=None, dropout=None):
    """Attention of q ``(b, heads, s_q, d)`` over k, v ``(b, kv_heads, s_k, d)`` → ``(b, heads, s_q, d)``.

    - ``softmax_scale``: defaults to 1/√d; must be a positive finite number.
    - ``causal``: key_pos ≤ query_pos, positions ``q_offset + i`` and ``k_offset + j`` (so s_q ≠ s_k and a
      query chunk attending to a key chunk elsewhere in the sequence are expressed by the offsets).
    - ``window_size=W``: also query_pos − key_pos < W (Mistral / HF ``sliding_window``: W positions,
      the query's own included; with ``causal=False`` only the past is limited).
    - ``q_document_ids (b, s_q)``, ``k_document_ids (b, s_k)`` int: attend only within equal ids; ids
      that never decrease along the sequence (packed documents) let whole tiles be skipped.
    - ``return_lse``: also return ``lse (b, heads, s_q)`` fp32 (not differentiable); empty rows give
      out 0 and lse −inf.
    - ``deterministic``: the Triton backward accumulates dq in a second kernel, in a fixed order, instead
      of with fp32 atomics inside the dK/dV kernel (the default: 5 GEMMs per tile instead of 7).

    - ``dropout``: a ``kernels.philox.AttentionDropout`` (layout-invariant mask of the global
      sample, head and positions ``q_offset + i`` / ``k_offset + j``), or None.

    Differentiable in q, k, v.
    """
    mask, scale = _settings(q, k, v, causal, softmax_scale, dict(
        window_size=window_size, q_document_ids=q_document_ids, k_document_ids=k_document_ids,
        q_offset=q_offset, k_offset=k_offset))
    out, lse = _FlashAttention.apply(q, k, v, mask, scale, bool(deterministic), backend, dropout)
    return (out, lse) if return_lse else out
