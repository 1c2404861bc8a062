"""SharedExpertMLP: the expert every token goes through, beside the routed ones (Megatron-core's
``SharedExpertMLP``; Qwen2-MoE's ``shared_expert`` with its ``shared_expert_gate``).

    y_shared = MLP_s(x)                                   moe_shared_expert_gate = False
    y_shared = σ(x w_gᵀ) · MLP_s(x)                       moe_shared_expert_gate = True

``MLP_s`` is a dense ``ParallelMLP`` of hidden size ``moe_shared_expert_intermediate_size``,
TP-sharded like the dense MLP (fc1 by columns, fc2 by rows, over the dense TP group) and
replicated over ep. The gate ``w_g (1, h)`` is one scalar per token, replicated on every rank
(Megatron's ``gate_weight``): under sequence parallelism each TP rank gates its own s/tp tokens,
so ``w_g`` enters through ``copy_to_region`` (its gradient all-reduced over TP inside autograd)
and is marked ``sequence_parallel = True``, like the router weight. Without SP every TP rank holds
the same tokens and computes the same full gradient, so no reduction is needed.

Master draws, after the MLP's fc1 and fc2: ``w_g`` from N(0, init_method_std²) (Megatron's
``init_method``), so the layer is the same at any layout.
"""
from __future__ import annotations

import torch
from torch import nn

from tpfuse.parallel.mappings import copy_to_region
from tpfuse.tp_layers import ParallelMLP
from tpfuse.tp_layers.init import draw_master_weight, normal_init


class SharedExpertMLP(ParallelMLP):
    """``SharedExpertMLP(config, groups, output_layer_init_std)``: ``forward(hidden (s_local, b,
    h))`` → ``(s_local, b, h)`` (the fc2 bias included; the gate applied when configured)."""

    def __init__(self, config, groups, *, output_layer_init_std: float):
        super().__init__(
            config.hidden_size, config.moe_shared_expert_intermediate_size,
            activation=config.activation, add_bias_linear=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel, init_method_std=config.init_method_std,
            output_layer_init_std=output_layer_init_std, params_dtype=config.params_dtype,
            group=groups.tp)
        self.gated_output = bool(config.moe_shared_expert_gate)
        self.sequence_parallel = config.sequence_parallel
        self.tp_group, self.tp_size = groups.tp, groups.tp_size
        if self.gated_output:
            master = draw_master_weight(1, config.hidden_size,
                                        normal_init(config.init_method_std), config.params_dtype)
            self.gate_weight = nn.Parameter(master)                           # (1, h)
            self.gate_weight.tensor_model_parallel = False
            self.gate_weight.partition_dim, self.gate_weight.partition_stride = None, 1
            self.gate_weight.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("gate_weight", None)

    def gate_scores(self, hidden):
        """σ(x w_gᵀ) ``(s_local, b, 1)``."""
        weight = self.gate_weight
        if self.sequence_parallel and self.tp_size > 1:
            weight = copy_to_region(weight, self.tp_group)      # backward: all-reduce over TP
        return torch.sigmoid(torch.nn.functional.linear(hidden, weight))

    def forward(self, hidden):
        output, bias = super().forward(hidden)                              # (s_local, b, h)
        if bias is not None:
            output = output + bias
        if self.gated_output:
            output = output * self.gate_scores(hidden)
        return output
