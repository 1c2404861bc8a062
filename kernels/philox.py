"""Counter-based dropout masks: Philox4x32-10 keyed by (seed, site), counted by global coordinates.

A dropout mask element is a pure function of where the element sits in the *global* problem,
never of how the problem is laid out over processes:

    key     = (seed, site)                       64 bits: seed in the low word, site in the high
    counter = (c0, c1, c2, c3)                   4 × 32 bits of global coordinates
    bits    = Philox4x32-10(key, counter)        4 words; word w of the counter's quad
    keep    = (bits >> 1) ≥ round(p · 2³¹)       P(keep) = 1 − round(p·2³¹)/2³¹

The site names the dropout (a layer and which of its dropouts); the counters are
- hidden dropout of a (sample, position, hidden) element:  (hidden // 4, position, sample, 0),
  word hidden % 4 (one Philox call per quad of consecutive hidden columns);
- attention dropout of (sample, head, query position, key position): (key, query, sample, head),
  word 0.

So tensor-, sequence-, context-, pipeline- and data-parallel layouts, which only change which
process holds an element, draw the same mask as one process. The Triton side is Triton's own
``tl.philox`` (what ``tl.randint`` runs); ``philox4x32`` below is the same function in torch
int64 arithmetic, bit-for-bit (tests/kernels/test_kernels_philox.py compares them in the
interpreter).

File shape: Triton helpers → plain-torch Philox → masks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
ROUNDS = 10
WORD = 0xFFFFFFFF
SITE_LIMIT = 2**31


# ----------------------------------------------------------------------------- Triton helpers

@triton.jit
def philox_keep(key, c0, c1, c2, c3, threshold):
    """Four boolean blocks (one per Philox word): (bits >> 1) ≥ threshold."""
    r0, r1, r2, r3 = tl.philox(key, c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32),
                               c3.to(tl.uint32))
    return ((r0 >> 1).to(tl.int32) >= threshold, (r1 >> 1).to(tl.int32) >= threshold,
            (r2 >> 1).to(tl.int32) >= threshold, (r3 >> 1).to(tl.int32) >= threshold)


@triton.jit
def philox_keep_first(key, c0, c1, c2, c3, threshold):
    """One boolean block from the first Philox word (the attention dropout's)."""
    r0, _r1, _r2, _r3 = tl.philox(key, c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32),
                                  c3.to(tl.uint32))
    return (r0 >> 1).to(tl.int32) >= threshold


@triton.jit
def attention_keep(key, threshold, sample, head, q_pos, k_pos):
    """The attention dropout's keep booleans over broadcastable tiles of global query positions
    ``q_pos`` and key positions ``k_pos`` (int32), for one global sample and head (scalars):
    counter (key, query, sample, head), word 0."""
    c0 = k_pos + 0 * q_pos
    c1 = q_pos + 0 * k_pos
    return philox_keep_first(key, c0, c1, 0 * c0 + sample, 0 * c0 + head, threshold)


# ----------------------------------------------------------------------------- torch Philox

def _mul_hi_lo(multiplier: int, x: torch.Tensor):
    """(⌊m·x / 2³²⌋, m·x mod 2³²) for x in [0, 2³²) held in int64, without overflow: x split in
    16-bit halves, each product < 2⁴⁸."""
    low, high = x & 0xFFFF, x >> 16
    t_low, t_high = low * multiplier, high * multiplier
    hi = (t_high + (t_low >> 16)) >> 16
    lo = (((t_high & 0xFFFF) << 16) + t_low) & WORD
    return hi, lo


def philox4x32(key: int, c0, c1, c2, c3, rounds: int = ROUNDS):
    """Philox4x32 (Triton's ``tl.philox`` with a 64-bit seed ``key``) on int64 tensors holding
    uint32 words (broadcast together); returns the four output words as int64 tensors."""
    k0, k1 = key & WORD, (key >> 32) & WORD
    counters = (c0, c1, c2, c3)
    device = next((c.device for c in counters if isinstance(c, torch.Tensor)), None)
    if device is None:
        raise ValueError("philox4x32 needs at least one counter word as a tensor (its device "
                         "is where the words are drawn)")
    c0, c1, c2, c3 = torch.broadcast_tensors(*(
        torch.as_tensor(c, device=device).to(torch.int64) & WORD for c in counters))
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & WORD, (k1 + PHILOX_KEY_B) & WORD
    return c0, c1, c2, c3


# ----------------------------------------------------------------------------- masks

def dropout_key(seed: int, site: int) -> int:
    """The 64-bit Philox key of a dropout site under a seed (both below 2³¹)."""
    if not 0 <= seed < 2**31:
        raise ValueError(f"dropout seed must be in [0, 2**31), got {seed}")
    if not 0 <= site < SITE_LIMIT:
        raise ValueError(f"dropout site must be in [0, 2**31), got {site}")
    return (site << 32) | seed


def keep_threshold(p: float) -> int:
    """round(p · 2³¹), capped to int32 (p = 1 then keeps 1 in 2³¹: the op's scale 0 drops it)."""
    return min(int(round(p * 2**31)), 2**31 - 1)


def _keep(bits: torch.Tensor, p: float) -> torch.Tensor:
    return (bits >> 1) >= keep_threshold(p)


@dataclass(frozen=True)
class RowCoordinates:
    """Global coordinates of the rows of a ``(..., H)`` activation flattened to ``(rows, H)``:
    the Philox ``key`` of its dropout site, and each row's global ``positions`` and ``samples``
    (``(rows,)`` int tensors)."""
    key: int
    positions: torch.Tensor
    samples: torch.Tensor

    def check(self, rows: int) -> None:
        for name in ("positions", "samples"):
            t = getattr(self, name)
            if t.shape != (rows,):
                raise ValueError(f"RowCoordinates.{name} must have shape ({rows},), got "
                                 f"{tuple(t.shape)}")


def hidden_keep_mask(p: float, coords: RowCoordinates, hidden: int, device=None) -> torch.Tensor:
    """(rows, hidden) booleans: counter (h // 4, position, sample, 0), word h % 4."""
    device = coords.positions.device if device is None else device
    quads = torch.arange((hidden + 3) // 4, device=device)[None, :]             # (1, Q)
    words = philox4x32(coords.key, quads, coords.positions.to(device)[:, None],
                       coords.samples.to(device)[:, None], 0)                   # 4 × (rows, Q)
    bits = torch.stack(words, dim=-1).reshape(coords.positions.shape[0], -1)    # (rows, 4Q)
    return _keep(bits[:, :hidden], p)


def attention_keep_mask(p: float, key: int, samples, heads, q_positions, k_positions):
    """(b, h, s_q, s_k) booleans: counter (key position, query position, sample, head), word 0.
    Arguments: global sample (b,), head (h,), query (s_q,) and key (s_k,) positions."""
    word, _, _, _ = philox4x32(key, k_positions[None, None, None, :],
                               q_positions[None, None, :, None],
                               samples[:, None, None, None], heads[None, :, None, None])
    return _keep(word, p)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout on the attention probabilities of one call, layout-invariant: element
    (batch row i, head j, query row r, key row c) is kept by ``attention_keep_mask`` of the
    global sample ``first_sample + i``, global head ``head_offset + j`` and the global positions
    ``q_offset + r`` / ``k_offset + c`` (the call's mask offsets). ``key``: ``dropout_key``."""
    p: float
    key: int
    first_sample: int = 0
    head_offset: int = 0

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"attention dropout p must be in [0, 1), got {self.p}")

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    @property
    def threshold(self) -> int:
        return keep_threshold(self.p)

    def keep(self, b: int, h: int, s_q: int, s_k: int, q_offset: int, k_offset: int,
             device=None) -> torch.Tensor:
        """(b, h, s_q, s_k) booleans."""
        def arange(n, start):
            return start + torch.arange(n, device=device)
        return attention_keep_mask(self.p, self.key, arange(b, self.first_sample),
                                   arange(h, self.head_offset), arange(s_q, q_offset),
                                   arange(s_k, k_offset))

    def factor(self, b, h, s_q, s_k, q_offset, k_offset, device, dtype) -> torch.Tensor:
        """(b, h, s_q, s_k) keep / (1 − p) in ``dtype``: what the probabilities are multiplied by."""
        return self.keep(b, h, s_q, s_k, q_offset, k_offset, device).to(dtype) * self.scale
