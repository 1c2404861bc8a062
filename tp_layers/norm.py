"""LayerNorm / RMSNorm over the hidden dim, with weights replicated on every TP rank.

Under sequence parallelism each rank normalises only its sequence chunk, so each rank's weight
gradient covers only its tokens. The weights therefore enter the op through ``copy_to_region``
(identity forward, all-reduce backward): the gradient is all-reduced over the TP group *inside
autograd* and every TP rank ends backward with the same full gradient (Megatron has shipped the
bug where final-layernorm grads differ across TP ranks). Such parameters carry
``param.sequence_parallel = True``; nothing downstream must reduce them over TP again.

A q / k norm (``head_split=True``, Megatron's ``qk_layernorm``) normalises each head over the head
dim with one weight shared by all heads; each TP rank holds only its heads, so its weight
gradient is the sum over those heads alone. The full gradient is the sum over every head, i.e.
over the TP ranks: the same ``copy_to_region`` all-reduce, here at any tp > 1 with or without
sequence parallelism (the parameters carry ``sequence_parallel = True`` then, for the same
reason).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _deps
from ._group import resolve_tp_group

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class Norm(nn.Module):
    """``normalization="LayerNorm"`` (weight 1, bias 0) or ``"RMSNorm"`` (weight 1).

    ``head_split``: the input is this TP rank's heads ``(..., d)`` (a q / k norm), so the weight
    gradient is all-reduced over TP whatever ``sequence_parallel`` says."""

    def __init__(self, hidden_size: int, *, normalization: str = "LayerNorm", eps: float = 1e-5,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 group=None, state=None, head_split: bool = False):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        if eps <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {eps}")
        self.tp = resolve_tp_group(group, state)
        self.normalization, self.eps, self.sequence_parallel = normalization, eps, sequence_parallel
        self.head_split = head_split
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        params = [self.weight]
        if normalization == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype))
            params.append(self.bias)
        else:
            self.register_parameter("bias", None)
        for p in params:
            p.tensor_model_parallel = False
            p.sequence_parallel = sequence_parallel or (head_split and self.tp.size > 1)

    def _replicated(self, *params) -> tuple:
        """The parameters as used in forward; their grads are TP-all-reduced (weight and bias in
        one collective) when each rank's input is only part of the data (a sequence chunk under
        sequence parallelism, or its heads)."""
        if (self.sequence_parallel or self.head_split) and self.tp.size > 1:
            return _deps.copy_many_to_region(params, self.tp.group)
        return params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            (weight,) = self._replicated(self.weight)
            return _deps.rms_norm(x, weight, self.eps)
        weight, bias = self._replicated(self.weight, self.bias)
        return _deps.layer_norm(x, weight, bias, self.eps)
