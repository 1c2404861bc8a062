"""Which keys a query may attend to: the mask settings of flash_attention, checked once and passed down.

Query row i sits at position ``q_offset + i``, key row j at ``k_offset + j``. Key j is visible to query i
when every active rule allows it:

    causal             k_offset + j ≤ q_offset + i
    window_size = W    (q_offset + i) − (k_offset + j) < W      (the last W positions, the query's own
                                                                 included: Mistral / HF ``sliding_window``)
    document ids       q_document_ids[b, i] == k_document_ids[b, j]

Only the difference ``shift = q_offset − k_offset`` matters. A query row with no visible key is *empty*:
its output is 0 and its logsumexp −inf.

Document ids that never decrease along the sequence (packed documents, or cu_seqlens) make every
document one contiguous run, so the visible keys of query i form the interval
``[key_start[i], key_end[i])`` — the kernels and the torch path use it to skip tiles and blocks outside a
document. Any other ids are still exact, only masked element by element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpfuse.parallel.checks import is_int

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class AttentionMask:
    """Validated mask settings of one attention call (see the module docstring for the rules)."""
    causal: bool = True
    window_size: int | None = None
    q_document_ids: torch.Tensor | None = None    # (b, s_q) int
    k_document_ids: torch.Tensor | None = None    # (b, s_k) int
    q_offset: int = 0
    k_offset: int = 0

    @property
    def shift(self) -> int:
        """q_offset − k_offset: query i and key j are at the same position when j = i + shift."""
        return self.q_offset - self.k_offset

    @property
    def has_documents(self) -> bool:
        return self.q_document_ids is not None

    def simplified(self, s_q: int, s_k: int) -> "AttentionMask":
        """The same visibility over s_q queries × s_k keys in the form the aligned-mask tile loops
        take where there is one: no causal rule when every key precedes every query, a plain
        causal mask when queries and keys sit at the same positions."""
        if self.window_size is not None or self.has_documents:
            return self
        if not self.causal or self.shift >= s_k - 1:
            return AttentionMask(causal=False)
        if self.shift == 0 and s_q == s_k:
            return AttentionMask(causal=True)
        return self

    def keywords(self) -> dict:
        """The mask keywords of ``flash_attention`` / ``attention_forward`` / ``attention_backward``."""
        return dict(causal=self.causal, window_size=self.window_size,
                    q_document_ids=self.q_document_ids, k_document_ids=self.k_document_ids,
                    q_offset=self.q_offset, k_offset=self.k_offset)

    def visible(self, s_q: int, s_k: int, device) -> torch.Tensor:
        """Bool ``(b or 1, 1, s_q, s_k)``: True where query i may attend to key j (dense; references)."""
        rows = torch.arange(s_q, device=device)[:, None] + self.shift           # query positions − k_offset
        cols = torch.arange(s_k, device=device)[None, :]
        keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
        if self.causal:
            keep &= cols <= rows
        if self.window_size is not None:
            keep &= rows - cols < self.window_size
        keep = keep[None, None]
        if self.has_documents:
            same = self.q_document_ids[:, :, None] == self.k_document_ids[:, None, :]   # (b, s_q, s_k)
            keep = keep & same[:, None]
        return keep


def _check_int(name: str, value, minimum=None) -> int:
    if not is_int(value):
        raise ValueError(f"flash_attention: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"flash_attention: {name} must be >= {minimum}, got {value}")
    return value


def _check_document_ids(name: str, ids: torch.Tensor, shape: tuple, device) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _INT_DTYPES:
        raise ValueError(f"flash_attention: {name} must be an integer tensor, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"flash_attention: {name} shape {tuple(ids.shape)} must be (b, s) = {shape}")
    if ids.device != device:
        raise ValueError(f"flash_attention: {name} is on {ids.device}, q on {device}")


def build_mask(q, k, causal=True, window_size=None, q_document_ids=None, k_document_ids=None,
               q_offset=0, k_offset=0) -> AttentionMask:
    """An AttentionMask for q ``(b, h, s_q, d)`` and k ``(b, h_kv, s_k, d)``; ValueError naming a bad setting."""
    if not isinstance(causal, bool):
        raise ValueError(f"flash_attention: causal must be a bool, got {causal!r}")
    if window_size is not None:
        _check_int("window_size", window_size, minimum=1)
    _check_int("q_offset", q_offset)
    _check_int("k_offset", k_offset)
    if (q_document_ids is None) != (k_document_ids is None):
        raise ValueError("flash_attention: q_document_ids and k_document_ids must be given together "
                         f"(got q_document_ids={'set' if q_document_ids is not None else None}, "
                         f"k_document_ids={'set' if k_document_ids is not None else None})")
    if q_document_ids is not None:
        _check_document_ids("q_document_ids", q_document_ids, (q.shape[0], q.shape[2]), q.device)
        _check_document_ids("k_document_ids", k_document_ids, (k.shape[0], k.shape[2]), q.device)
    return AttentionMask(causal, window_size, q_document_ids, k_document_ids, q_offset, k_offset)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """1/√d when None; ValueError for a scale that is not a positive finite number (NaN included)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"flash_attention: softmax_scale must be a number, got {softmax_scale!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_attention: softmax_scale must be a positive finite number, got {scale}")
    return scale


def _is_sorted(ids: torch.Tensor) -> torch.Tensor:
    """(b,) bool: the row's ids never decrease."""
    return (ids[:, 1:] >= ids[:, :-1]).all(dim=1)


def document_ranges(row_ids: torch.Tensor, col_ids: torch.Tensor):
    """For every row r of ``row_ids (b, R)``: the columns ``[start[r], end[r])`` of ``col_ids (b, C)``
    carrying the same id, and per batch whether that interval is exact.

    Exact when the batch's col ids never decrease (each id one contiguous run); elsewhere the interval
    is all columns (then the caller masks element by element). Returns int32 ``start, end (b, R)`` and
    int32 ``exact (b,)``. No host synchronisation.
    """
    cols = col_ids.shape[1]
    exact = _is_sorted(col_ids) if cols > 1 else torch.ones(col_ids.shape[0], dtype=torch.bool,
                                                            device=col_ids.device)
    sorted_cols = col_ids.to(torch.int64).contiguous()
    rows = row_ids.to(torch.int64).contiguous()
    start = torch.searchsorted(sorted_cols, rows, right=False)
    end = torch.searchsorted(sorted_cols, rows, right=True)
    start = torch.where(exact[:, None], start, 0)
    end = torch.where(exact[:, None], end, cols)
    return start.to(torch.int32), end.to(torch.int32), exact.to(torch.int32)
