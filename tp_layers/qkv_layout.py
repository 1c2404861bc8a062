"""The fused QKV output as per-head q, k, v ``[b, heads, s, d]`` views, and which token order it has.

The QKV GEMM's output rows follow its input's token order: sequence-first ``(s, b, ...)`` as the
layer's hidden states, or batch-first ``(b, s, ...)`` when the GEMM is fed the transposed input.
Per query group g it holds ``[q heads of g (hpg); k_g; v_g]`` (Megatron's grouped layout), so the
output viewed as ``(tokens..., g_l, hpg + 2, d)`` gives q, k and v by slicing, no copy.

Token order: ``batch_first_attention`` says which one the attention runs on. On CPU ATen's flash
attention (the torch path of ``kernels.flash_attention``) reads q/k/v tiles along the sequence, so
it is faster on batch-first views (sequence stride (h_l + 2 g_l)·d) than on sequence-first ones
(stride b times that): the QKV GEMM then reads batch-first rows (TransformerLayer runs its input
norm on a (b, s, h) copy of the hidden states and passes an (s, b, h) view of the result; called
on sequence-first rows, the GEMM copies them) and the projection a batch-first input, whose
(b, s, h) output the attention returns as an (s, b, h) view. With
sequence parallelism over tp > 1 ranks the QKV GEMM is the fused all-gather over s, whose output
is sequence-first; on a GPU the Triton kernels take either order at the same speed, so neither
transposes.

``split_qkv`` returns the three views through an autograd Function whose backward writes dq, dk
and dv into one fresh qkv-shaped gradient: autograd's own slicing backward would zero-fill three
qkv-sized tensors, copy each part in and add the three up.
"""
from __future__ import annotations

import torch

_TO_HEADS = {False: (1, 2, 0, 3), True: (0, 2, 1, 3)}       # (s, b, …) / (b, s, …) → [b, ·, s, d]
_FROM_HEADS = {False: (2, 0, 1, 3), True: (0, 2, 1, 3)}     # the inverse permutations


def batch_first_attention(hidden_states: torch.Tensor, sequence_parallel: bool, tp: int) -> bool:
    """Whether the attention runs on batch-first QKV (see the module docstring)."""
    return not hidden_states.is_cuda and not (sequence_parallel and tp > 1)


def _parts(qkv: torch.Tensor, heads_per_group: int):
    """(q (…, g, hpg, d), k (…, g, d), v (…, g, d)) views of qkv (t0, t1, g, hpg + 2, d)."""
    return (qkv[:, :, :, :heads_per_group], qkv[:, :, :, heads_per_group],
            qkv[:, :, :, heads_per_group + 1])


class _SplitQKV(torch.autograd.Function):
    """q ``[b, g·hpg, s, d]``, k and v ``[b, g, s, d]`` of qkv ``(t0, t1, g, hpg + 2, d)``."""

    @staticmethod
    def forward(ctx, qkv, heads_per_group, batch_first):
        ctx.shape, ctx.settings = qkv.shape, (heads_per_group, batch_first)
        q, k, v = _parts(qkv, heads_per_group)
        q = q.reshape(*q.shape[:2], -1, q.shape[-1])             # (t0, t1, heads, d)
        return tuple(t.permute(*_TO_HEADS[batch_first]) for t in (q, k, v))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        heads_per_group, batch_first = ctx.settings
        grad = dq.new_empty(ctx.shape)                          # every element written below
        q, k, v = _parts(grad, heads_per_group)
        back = _FROM_HEADS[batch_first]
        q.copy_(dq.permute(*back).unflatten(2, (ctx.shape[2], heads_per_group)))
        k.copy_(dk.permute(*back))
        v.copy_(dv.permute(*back))
        return grad, None, None


def split_qkv(qkv: torch.Tensor, groups: int, heads_per_group: int, head_dim: int,
              batch_first: bool):
    """``(q, k, v)`` ``[b, heads, s, d]`` / ``[b, g, s, d]`` of the QKV GEMM output ``(s, b, n)``,
    or ``(b, s, n)`` with ``batch_first``; n = groups · (heads_per_group + 2) · head_dim."""
    qkv = qkv.view(*qkv.shape[:2], groups, heads_per_group + 2, head_dim)
    return _SplitQKV.apply(qkv, heads_per_group, batch_first)
