"""Rotary position embeddings (RoPE), "rotate-half" layout (GPT-NeoX / Megatron non-interleaved).

For head dim d, frequencies ``f_i = base^(−2i/d)``, i < d/2, and angle ``θ = pos · f_i``, the pair
``(x_i, x_{i+d/2})`` is rotated by θ:

    x_i'       = x_i cos θ − x_{i+d/2} sin θ
    x_{i+d/2}' = x_{i+d/2} cos θ + x_i sin θ

i.e. ``x' = x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = [−x₂, x₁]``. Angles are computed
in fp32 from explicit ``position_ids`` on the full sequence.
"""
from __future__ import annotations

import torch


def default_position_ids(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """``(b, s)`` positions 0..s−1 for every sequence."""
    return torch.arange(seq_len, device=device).expand(batch, seq_len)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos, sin of shape ``(b, 1, s, d)`` (fp32) for ``position_ids (b, s)``."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = base ** (-exponents / head_dim)                          # (d/2,)
    angles = position_ids.float()[..., None] * inv_freq                 # (b, s, d/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]               # (b, 1, s, d)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, d]`` (computed in fp32, returned in x's dtype)."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
