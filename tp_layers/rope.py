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


LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x rotary scaling (Megatron's ``--use-rope-scaling``, HF's rope_type 'llama3'),
    with Llama 3's constants: original context C = 8192, low / high frequency factors 1 / 4.

    A frequency of wavelength λ = 2π / f is kept when λ < C / 4 (high frequencies), divided by
    ``factor`` when λ > C / 1 (low frequencies), and in between interpolated:
    f' = (1 − t) · f / factor + t · f with t = (C / λ − 1) / (4 − 1)."""
    low, high, context = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
    wavelength = 2 * torch.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, interpolated, scaled)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                   scaling_factor: float | None = None):
    """cos, sin of shape ``(b, 1, s, d)`` (fp32) for ``position_ids (b, s)``; ``scaling_factor``:
    Llama 3's frequency scaling by that factor (``llama3_scaled``), None: none."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = base ** (-exponents / head_dim)                          # (d/2,)
    if scaling_factor is not None:
        inv_freq = llama3_scaled(inv_freq, scaling_factor)
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
