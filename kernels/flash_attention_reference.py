"""The explicit (materialised) masked softmax attention: the one plain-torch attention of tpfuse.

    S = scale · Q Kᵀ, masked to −inf where a key is not visible      (b, h, s_q, s_k)
    lse = log Σ_j e^S,   P = e^(S − lse),   O = P V
    backward, given the out O and lse of the *whole* attention (ring attention passes the merged
    global ones, as the flash backward takes them):
    δ = rowsum(dO ⊙ O),  dS = P ⊙ (dO Vᵀ − δ),  dQ = scale · dS K,
    dK = scale · Σ_group dSᵀ Q,  dV = Σ_group Pᵀ dO          (Σ over the query heads of a kv head)

Query head i reads kv head i // (h / h_kv). ``visible`` is a bool tensor broadcastable to
``(b, h, s_q, s_k)`` (``AttentionMask.visible``), None when every key is visible. A query with no
visible key (an *empty* row) gets out 0 and lse −inf, and no gradient; the forward is written so
that autograd through it stays finite there too. Math in fp32 (float64 inputs: float64); out in
q's dtype, lse in the compute dtype.

Dropout on the probabilities (``drop``: keep / (1 − p), broadcastable to ``(b, h, s_q, s_k)``;
the lse stays the undropped softmax's, so partial attentions still merge by it):

    O = (P ⊙ Z) V;   dV = Σ_group (P ⊙ Z)ᵀ dO;   dS = P ⊙ (Z ⊙ (dO Vᵀ) − δ),  δ = rowsum(dO ⊙ O)

(δ = Σ_j P_ij Z_ij (dO·V_j) = rowsum(dO ⊙ O) still, O being the dropped output.)

Users: ``flash_attention.attention_reference`` (every kernel path is tested against it), the
torch path's calls off the CPU (``flash_attention_torch``), the context-parallel blocks of head
dims the kernels do not take, and the TP attention layer's dropout / small-head-dim path
(``explicit_probs``: the probabilities, for dropout before ``@ V``).
"""
from __future__ import annotations

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def repeat_kv(t: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """k or v ``(b, h_kv, s_k, d)`` → ``(b, h_kv·group, s_k, d)`` in ``dtype``."""
    return t.to(dtype).repeat_interleave(group, dim=1)


def explicit_scores(q, k, scale: float, visible=None) -> torch.Tensor:
    """``scale · Q Kᵀ`` ``(b, h, s_q, s_k)`` in the compute dtype, −inf where not visible."""
    dtype = compute_dtype(q)
    scores = scale * q.to(dtype) @ repeat_kv(k, q.shape[1] // k.shape[1], dtype).transpose(-1, -2)
    return scores if visible is None else scores.masked_fill(~visible, float("-inf"))


def explicit_probs(q, k, scale: float, visible=None):
    """``(P (b, h, s_q, s_k), lse (b, h, s_q))``; empty rows: P 0, lse −inf."""
    scores = explicit_scores(q, k, scale, visible)
    empty = torch.isneginf(scores).all(dim=-1)                                 # (b, h, s_q)
    lse = torch.logsumexp(scores.masked_fill(empty[..., None], 0.0), dim=-1)   # finite everywhere
    probs = torch.exp(scores - lse[..., None])                                 # 0 on masked entries
    return probs, lse.masked_fill(empty, float("-inf"))


def explicit_forward(q, k, v, scale: float, visible=None, drop=None):
    """``(out (b, h, s_q, d) in q's dtype, lse (b, h, s_q))``; ``drop``: the dropout factor."""
    probs, lse = explicit_probs(q, k, scale, visible)
    if drop is not None:
        probs = probs * drop
    out = probs @ repeat_kv(v, q.shape[1] // k.shape[1], probs.dtype)
    return out.to(q.dtype), lse


def explicit_backward(dout, q, k, v, out, lse, scale: float, visible=None, drop=None):
    """``(dq, dk, dv)`` in the dtypes of q, k, v for these keys, given the whole attention's
    ``out`` and ``lse`` (empty rows, lse −inf: P = 0 there, so they add nothing)."""
    scores = explicit_scores(q, k, scale, visible)
    dtype, group = scores.dtype, q.shape[1] // k.shape[1]
    probs = torch.exp(scores - lse.to(dtype).masked_fill(torch.isinf(lse), 0.0)[..., None])
    dout_c = dout.to(dtype)
    delta = (dout_c * out.to(dtype)).sum(-1, keepdim=True)                   # (b, h, s_q, 1)
    dprobs = dout_c @ repeat_kv(v, group, dtype).transpose(-1, -2)
    if drop is not None:
        dprobs = dprobs * drop
    dscores = probs * (dprobs - delta)
    dq = scale * dscores @ repeat_kv(k, group, dtype)
    grouped = (k.shape[0], k.shape[1], group, k.shape[2], k.shape[3])
    dk = (scale * dscores.transpose(-1, -2) @ q.to(dtype)).reshape(grouped).sum(2)
    kept = probs if drop is None else probs * drop
    dv = (kept.transpose(-1, -2) @ dout_c).reshape(grouped).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
