"""GroupedExperts: the local experts of one MoE layer, weights stacked for the grouped GEMM.

Expert e:  ``y = act(x W1_e + b1_e) W2_e + b2_e`` with ``W1_e (h, F1)``, ``W2_e (F, h)``;
F1 = F for gelu / gelu_tanh, 2F for swiglu (columns ``[gate | up]``,
``act = silu(gate) · up``).

Stacked on this rank: ``weight1 (L, h, F1/etp)``, ``weight2 (L, F/etp, h)``, ``bias1 (L, F1/etp)``,
``bias2 (L, h)`` for its L = E/ep experts ``first .. first + L − 1`` (first = ep rank · L) and its
expert-tensor-parallel shard: fc1 split by columns (stride 2 under swiglu, so a rank holds its gate
and the matching up columns), fc2 by rows — so fc2's output is a partial sum over etp, which the
dispatcher's combine sums. ``bias2`` is added on etp rank 0 only (the sum holds it once) and
enters through ``copy_to_region`` over etp, so every etp rank ends backward with its full gradient.

Layout-independent masters: the full ``(E, h, F1)`` and ``(E, F, h)`` are drawn (fc1 with
N(0, init_std), fc2 with N(0, output_layer_init_std); biases 0) and each rank keeps its slice, so
any ep / etp layout holds the slices of the single-process layer.

Compute: ``grouped=True`` → two grouped GEMMs over all local experts (``kernels.grouped_gemm``);
else a loop over the experts (Megatron's SequentialMLP) with ``kernels.matmul``, gelu fused into
fc1's epilogue. Both read the same parameters. Under zero-bubble ZB-H1 the grouped GEMMs' weight
gradients run in the W action; the loop's stay in the input-gradient pass.

Parameter attributes (Megatron's names): ``allreduce = False`` (reduced over expert data
parallel, not dp); dim 0 indexes the local experts; ``tensor_model_parallel`` / ``partition_dim``
/ ``partition_stride`` refer to the etp group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.kernels.grouped_gemm import grouped_gemm
from tpfuse.kernels.matmul import matmul
from tpfuse.parallel.mappings import copy_to_region
from tpfuse.tp_layers.init import normal_init, shard


def _draw(shape, std, dtype):
    master = torch.empty(shape, dtype=torch.float32)
    normal_init(std)(master)
    return master.to(dtype)


def _expert_param(tensor, partition_dim=None, stride=1):
    param = nn.Parameter(tensor)
    param.allreduce = False
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim, param.partition_stride = partition_dim, stride
    return param


class GroupedExperts(nn.Module):
    def __init__(self, config, groups, *, output_layer_init_std: float, grouped: bool):
        super().__init__()
        hidden, ffn, dtype = config.hidden_size, config.moe_ffn_hidden_size, config.params_dtype
        experts, self.groups, self.grouped = config.num_moe_experts, groups, grouped
        self.activation = config.activation
        self.gated = config.activation == "swiglu"
        self.num_local = experts // groups.ep_size
        first = groups.ep_rank * self.num_local
        mine = slice(first, first + self.num_local)
        stride = 2 if self.gated else 1
        etp, etp_rank = groups.etp_size, groups.etp_rank
        master1 = _draw((experts, hidden, stride * ffn), config.init_method_std, dtype)
        master2 = _draw((experts, ffn, hidden), output_layer_init_std, dtype)
        self.weight1 = _expert_param(shard(master1[mine], 2, etp, etp_rank, stride), 2, stride)
        self.weight2 = _expert_param(shard(master2[mine], 1, etp, etp_rank), 1)
        if config.add_bias_linear:
            bias1 = torch.zeros(self.num_local, stride * ffn // etp, dtype=dtype)
            self.bias1 = _expert_param(bias1, 1, stride)
            self.bias2 = _expert_param(torch.zeros(self.num_local, hidden, dtype=dtype))
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)

    def _activation(self, h1):
        if self.gated:
            gate, up = h1.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h1, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def _bias2(self):
        """bias2 once in the etp sum: scaled by 1 on etp rank 0, by 0 elsewhere."""
        bias2 = self.bias2
        if self.groups.etp_size > 1:
            bias2 = copy_to_region(bias2, self.groups.etp) * float(self.groups.etp_rank == 0)
        return bias2

    def forward(self, rows, tokens_per_expert):
        """``rows (M, h)`` grouped by local expert (``tokens_per_expert`` rows each) →
        ``(M, h)``, a partial sum over etp."""
        if self.grouped:
            return self._grouped(rows, tokens_per_expert)
        return self._loop(rows, tokens_per_expert)

    def _grouped(self, rows, sizes):
        expert_of_row = None
        if self.bias1 is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(self.num_local, device=rows.device),
                torch.tensor(sizes, device=rows.device), output_size=rows.shape[0])
        h1 = grouped_gemm(rows, self.weight1, sizes)                       # (M, F1/etp)
        if expert_of_row is not None:
            h1 = h1 + self.bias1[expert_of_row]
        h2 = grouped_gemm(self._activation(h1), self.weight2, sizes)       # (M, h) partial
        if expert_of_row is not None:
            h2 = h2 + self._bias2()[expert_of_row]
        return h2

    def _loop(self, rows, sizes):
        bias2 = self._bias2() if self.bias2 is not None else None
        outputs, start = [], 0
        for local, count in enumerate(sizes):
            x = rows[start:start + count]                                  # (M_e, h)
            bias1 = None if self.bias1 is None else self.bias1[local]
            if self.gated:
                h = self._activation(matmul(x, self.weight1[local], bias1))
            else:
                h = matmul(x, self.weight1[local], bias1, self.activation)   # fused epilogue
            outputs.append(matmul(h, self.weight2[local], None if bias2 is None else bias2[local]))
            start += count
        return torch.cat(outputs) if outputs else rows.new_zeros((0, rows.shape[1]))
