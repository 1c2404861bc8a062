"""The rotary embedding of multi-latent attention: plain rope or YaRN on the decoupled rope part of
q / k (head dim d_pe = ``qk_pos_emb_head_dim``), with DeepSeek's interleaved pairs.

Frequencies (i < d_pe/2), base b, YaRN scaling factor F, original context L:

    extrapolated  f_e,i = b^(−2i/d_pe)          interpolated  f_i,i = f_e,i / F
    YaRN          f_i = f_i,i · (1 − m_i) + f_e,i · m_i,   m_i = 1 − ramp(i; lo, hi)
                  lo = ⌊c(β_fast)⌋, hi = ⌈c(β_slow)⌉ clamped to [0, d_pe − 1],
                  c(r) = d_pe · ln(L / (2π r)) / (2 ln b),  ramp = clamp((i − lo)/(hi − lo), 0, 1)
    rope          f_i = f_e,i

The tables are ``cos(θ)·a`` and ``sin(θ)·a`` with ``θ = pos · [f, f]`` (d_pe wide) and the YaRN
concentration ``a = g(F, mscale) / g(F, mscale_all_dim)``, ``g(F, m) = 0.1·m·ln F + 1`` for F > 1,
else 1 (rope: a = 1): Megatron's ``YarnRotaryEmbedding`` / HF's rope_type 'yarn'. Angles are computed
in fp32 from explicit ``position_ids`` (as ``rope.rotary_cos_sin``).

Applying (Megatron's ``apply_rotary_pos_emb(..., multi_latent_attention=True)``, HF's
``rope_interleave``): the pairs ``(x_{2i}, x_{2i+1})`` are first de-interleaved to
``[x_0, x_2, …, x_1, x_3, …]``, then rotated rotate-half style; the result stays de-interleaved
(q and k alike, so q·k is unchanged by the order).

Softmax scale of the attention: ``g(F, mscale_all_dim)² / √(qk_head_dim + qk_pos_emb_head_dim)``
(Megatron's MLA, for either rope type).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rope import rotate_half

ROPE_TYPES = ("rope", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """g(F, m) = 0.1·m·ln F + 1 for F > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_bounds(beta_fast: float, beta_slow: float, dim: int, base: float,
                     context: int) -> tuple[int, int]:
    low = math.floor(_correction_dim(beta_fast, dim, base, context))
    high = math.ceil(_correction_dim(beta_slow, dim, base, context))
    return max(low, 0), min(high, dim - 1)


@dataclass(frozen=True)
class MLARotary:
    """The rope settings of an MLA layer (Megatron's MLATransformerConfig names)."""
    rope_type: str = "yarn"
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")

    def inv_freq(self, dim: int, device=None) -> torch.Tensor:
        """``(dim/2,)`` fp32 frequencies (module docstring)."""
        exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
        extrapolated = 1.0 / self.rotary_base ** exponents
        if self.rope_type == "rope":
            return extrapolated
        interpolated = extrapolated / self.rotary_scaling_factor
        low, high = yarn_ramp_bounds(self.beta_fast, self.beta_slow, dim, self.rotary_base,
                                     self.original_max_position_embeddings)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
                / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp                                     # weight of the extrapolated part
        return interpolated * (1 - keep) + extrapolated * keep

    def concentration(self) -> float:
        """The factor a folded into the cos / sin tables (1 for plain rope)."""
        if self.rope_type == "rope":
            return 1.0
        factor = self.rotary_scaling_factor
        return yarn_get_mscale(factor, self.mscale) / yarn_get_mscale(factor, self.mscale_all_dim)

    def softmax_scale(self, q_head_dim: int) -> float:
        m = yarn_get_mscale(self.rotary_scaling_factor, self.mscale_all_dim)
        return m * m / math.sqrt(q_head_dim)

    def cos_sin(self, position_ids: torch.Tensor, dim: int):
        """``(cos·a, sin·a)`` of shape ``(b, 1, s, dim)`` fp32 for ``position_ids (b, s)``."""
        if dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {dim}")
        angles = position_ids.float()[..., None] * self.inv_freq(dim, position_ids.device)
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        scale = self.concentration()
        return angles.cos() * scale, angles.sin() * scale


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """De-interleave the last dim of ``x [b, heads, s, d]`` and rotate it (in fp32, float64 for
    float64 input; returned in x's dtype)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    pairs = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).to(compute)
    rotated = pairs * cos.to(compute) + rotate_half(pairs) * sin.to(compute)
    return rotated.to(x.dtype)
