"""ParallelMLP: fc1 column-parallel (activation fused into its GEMM), fc2 row-parallel.

  gelu:    x ─fc1 [ffn/tp rows], epilogue gelu→ (s, b, ffn/tp) ─fc2→ (s or s/tp, b, h)
           (``gelu_tanh``: the same with GPT-2's tanh approximation in the epilogue)
  swiglu:  master fc1 ``[gate (ffn rows); up (ffn rows)]`` split with stride 2, so rank r holds
           ``[gate_r; up_r]``; ``a = silu(x W_gateᵀ + b_g) · (x W_upᵀ + b_u)`` → fc2.

No communication other than the linears' own (the activation is element-wise on this rank's
columns). ``forward`` returns ``(output, bias)`` for the caller's bias-dropout-add (bias None at
tp = 1: fc2's GEMM adds it, ``RowParallelLinear(..., fold_bias=True)``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._group import resolve_tp_group
from .init import normal_init
from .linear import ColumnParallelLinear, RowParallelLinear

MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")


class ParallelMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu",
                 add_bias_linear: bool = True, sequence_parallel: bool = False,
                 init_method_std: float = 0.02, output_layer_init_std: float | None = None,
                 params_dtype: torch.dtype = torch.float32, group=None, state=None):
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
        self.tp = resolve_tp_group(group, state)
        if ffn_hidden_size < 1 or ffn_hidden_size % self.tp.size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by "
                             f"tensor-parallel size tp={self.tp.size}")
        self.activation = activation
        gated = activation == "swiglu"
        common = dict(bias=add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, group=self.tp.group)
        self.linear_fc1 = ColumnParallelLinear(
            hidden_size, 2 * ffn_hidden_size if gated else ffn_hidden_size,
            stride=2 if gated else 1, activation=None if gated else activation,
            init_method=normal_init(init_method_std), **common)
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=True,
            init_method=normal_init(output_layer_init_std or init_method_std), **common)

    def forward(self, hidden_states: torch.Tensor):
        intermediate = self.linear_fc1(hidden_states)        # (s, b, ffn/tp) or (s, b, 2·ffn/tp)
        if self.activation == "swiglu":
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up                  # (s, b, ffn/tp)
        return self.linear_fc2(intermediate, fold_bias=True)  # (s or s/tp, b, h), bias
