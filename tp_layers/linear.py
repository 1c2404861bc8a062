"""Column- and row-parallel linear layers (drop-in for ``nn.Linear``), sequence-first ``[s, b, h]``.

Notation: tp ranks, this rank r, ``W`` the master ``[out, in]`` weight, ``x`` the input.

ColumnParallelLinear — ``W`` split by rows (output features): rank r holds ``W_r [out/tp, in]``.
  forward     ``y_r = x W_rᵀ + b_r``                                   (s, b, out/tp)
  dgrad       ``dx = Σ_r dy_r W_r``  — the all-reduce of ``copy_to_region``'s backward
  wgrad       ``dW_r = dy_rᵀ x``,  ``db_r = Σ_tokens dy_r``             (local, no communication)
  sequence parallel: ``x`` is this rank's chunk (s/tp, b, in); the forward is the fused
  ``all_gather_matmul`` (gather s overlapped with the GEMM) and the dgrad becomes a reduce-scatter
  over s. ``gather_output`` all-gathers the last dimension → (s, b, out) on every rank.

RowParallelLinear — ``W`` split by columns (input features): rank r holds ``W_r [out, in/tp]``.
  forward     ``y = Σ_r x_r W_rᵀ + b``  — the all-reduce of ``reduce_from_region`` (s, b, out)
  dgrad       ``dx_r = dy W_r``                                          (local)
  wgrad       ``dW_r = dyᵀ x_r``
  sequence parallel: the sum is the fused ``matmul_reduce_scatter`` → (s/tp, b, out).
  The bias is *not* sharded and is added once, after the reduction. Under sequence parallelism a
  rank's bias gradient only covers its sequence chunk, so the bias enters through
  ``copy_to_region`` (identity forward, all-reduce backward): the gradient is all-reduced *inside
  autograd*, and every TP rank ends backward with the same full bias gradient (the replicated
  parameter is marked ``param.sequence_parallel = True``; do not reduce it again).

Weight gradients (every path, plain and fused comm-GEMM) go through ``kernels/wgrad.weight_grad``:
accumulated in fp32 into ``weight.main_grad`` when the trainer set one (gradient-accumulation
fusion), else returned to autograd in the weight's dtype.

Initialisation is layout-independent (see ``init.py``); ``from_dense`` shards an existing layer.
"""
from __future__ import annotations

import torch
from torch import nn

from . import _deps
from ._group import resolve_tp_group
from .init import check_partitionable, draw_master_weight, shard, unshard

ACTIVATIONS = (None, "gelu", "gelu_tanh", "relu")


def check_sequence_divisible(seq_len: int, tp: int, what: str = "sequence length") -> None:
    """ValueError before any collective when a sequence cannot be split over the TP ranks."""
    if seq_len % tp != 0:
        raise ValueError(
            f"{what} {seq_len} is not divisible by tensor-parallel size tp={tp} "
            "(sequence_parallel splits the sequence over the TP ranks)")


def _check_sizes(input_size: int, output_size: int) -> None:
    for name, value in (("input_size", input_size), ("output_size", output_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _master(master_weight, master_bias, rows, cols, init_method, dtype, bias):
    """The full master weight / bias: given ones (from_dense), or a fresh draw (bias zeros)."""
    if master_weight is None:
        master_weight = draw_master_weight(rows, cols, init_method, dtype)
    elif tuple(master_weight.shape) != (rows, cols):
        raise ValueError(f"master_weight shape {tuple(master_weight.shape)} != {(rows, cols)}")
    if not bias:
        return master_weight.detach().to(dtype), None
    if master_bias is None:
        master_bias = torch.zeros(rows, dtype=dtype)
    elif tuple(master_bias.shape) != (rows,):
        raise ValueError(f"master_bias shape {tuple(master_bias.shape)} != {(rows,)}")
    return master_weight.detach().to(dtype), master_bias.detach().to(dtype)


def _mark(param, partition_dim, stride):
    """Megatron's parameter attributes (checkpoint converters and grad clipping read them)."""
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim
    param.partition_stride = stride
    return param


class ColumnParallelLinear(nn.Module):
    """``y = act(x Wᵀ + b)`` with ``W`` split by output features (see the module docstring).

    ``activation`` (``None | "gelu" | "gelu_tanh" | "relu"``, a tpfuse extension) is fused into the
    GEMM epilogue. Returns a tensor, or ``(output, bias_shard)`` when ``skip_bias_add``.

    The TP group is ``group`` (a ProcessGroup), else ``state.tp_group``, else the default
    state's; ``params_dtype`` None is fp32. ``self.comm`` is the group the forward communicates
    over (``self.tp``; a subclass whose caller communicates replaces it by a group of one).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, init_method=None, stride: int = 1,
                 params_dtype: torch.dtype | None = None, activation: str | None = None,
                 master_weight: torch.Tensor | None = None,
                 master_bias: torch.Tensor | None = None, group=None, state=None):
        super().__init__()
        _check_sizes(input_size, output_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if activation is not None and skip_bias_add:
            raise ValueError(f"activation={activation!r} cannot be fused with skip_bias_add=True")
        self.tp = self.comm = resolve_tp_group(group, state)
        check_partitionable(output_size, self.tp.size, stride, "output_size")
        self.input_size, self.output_size, self.stride = input_size, output_size, stride
        self.gather_output, self.sequence_parallel = gather_output, bool(sequence_parallel)
        self.skip_bias_add, self.activation = skip_bias_add, activation
        weight, bias_full = _master(master_weight, master_bias, output_size, input_size,
                                    init_method, params_dtype or torch.float32, bias)
        rank, size = self.tp.rank, self.tp.size
        self.weight = _mark(nn.Parameter(shard(weight, 0, size, rank, stride)), 0, stride)
        if bias_full is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _mark(nn.Parameter(shard(bias_full[:, None], 0, size, rank, stride)[:, 0]),
                              0, stride)

    @classmethod
    def from_dense(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """Shard an existing ``nn.Linear`` (its weight is the master; rows split over tp)."""
        return _from_dense(cls, linear, kwargs)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """``weight`` (optional, ``(out/tp, in)``) replaces ``self.weight`` for this call — the
        tied output layer passes the vocab-parallel embedding table (Megatron's convention)."""
        tp, group = self.comm.size, self.comm.group
        shard_shape = (self.output_size // self.tp.size, self.input_size)   # this rank's weight
        if weight is None:
            weight = self.weight
        elif tuple(weight.shape) != shard_shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != this rank's {shard_shape}")
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and tp > 1:
            # (s/tp, b, in) -> (s, b, out/tp): gather over s fused with the GEMM; only the shard
            # is kept for backward, which re-gathers it inside the dgrad ring (Korthikanti et al.)
            y = _deps.all_gather_matmul(x, weight, group, bias=bias, activation=self.activation,
                                        keep_gathered=False, options=self.tp.options)
        else:
            if tp > 1:
                x = _deps.copy_to_region(x, group)  # backward: all-reduce dx
            y = _deps.linear_with_grad_accumulation(x, weight, bias, self.activation)  # (s, b, out/tp)
        if self.gather_output and tp > 1:
            y = _deps.gather_from_region(y, group)  # (s, b, out), rank-major blocks
            if self.stride > 1:  # undo the round-robin dealing: master column order
                y = unshard(list(y.chunk(tp, dim=-1)), -1, self.stride)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (tp={self.tp.size}, "
                f"stride={self.stride}), sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` split by input features (see the module docstring).

    Returns a tensor, or ``(output, bias)`` when ``skip_bias_add``: the full bias, routed through
    ``copy_to_region`` under sequence parallelism so its gradient is all-reduced over the TP group.
    Group, ``params_dtype`` and ``self.comm`` as for ``ColumnParallelLinear``.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, init_method=None, stride: int = 1,
                 params_dtype: torch.dtype | None = None,
                 master_weight: torch.Tensor | None = None,
                 master_bias: torch.Tensor | None = None, group=None, state=None):
        super().__init__()
        _check_sizes(input_size, output_size)
        self.tp = self.comm = resolve_tp_group(group, state)
        sequence_parallel = bool(sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        check_partitionable(input_size, self.tp.size, stride, "input_size")
        self.input_size, self.output_size, self.stride = input_size, output_size, stride
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.skip_bias_add = skip_bias_add
        weight, bias_full = _master(master_weight, master_bias, output_size, input_size,
                                    init_method, params_dtype or torch.float32, bias)
        self.weight = _mark(nn.Parameter(shard(weight, 1, self.tp.size, self.tp.rank, stride)),
                            1, stride)
        if bias_full is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _mark(nn.Parameter(bias_full.clone()), None, 1)
            self.bias.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """Shard an existing ``nn.Linear`` (its weight is the master; columns split over tp)."""
        return _from_dense(cls, linear, kwargs)

    def forward(self, x: torch.Tensor, *, fold_bias: bool = False):
        """``fold_bias`` (with ``skip_bias_add``): where no reduction sits between the GEMM and
        the bias (a communication group of one), add the bias in the GEMM's epilogue and return
        ``(output + bias, None)`` — the same sum for a caller that adds the returned bias (a
        bias-dropout-add), one pass over the output fewer. Without ``skip_bias_add`` the bias is
        always folded there."""
        tp, group = self.comm.size, self.comm.group
        if not self.input_is_parallel and tp > 1:
            x = _deps.scatter_to_region(x, group)  # (s, b, in) -> (s, b, in/tp)
        if tp == 1 and (fold_bias or not self.skip_bias_add):
            y = _deps.linear_with_grad_accumulation(x, self.weight, self.bias)  # (s, b, out)
            return (y, None) if self.skip_bias_add else y
        if self.sequence_parallel and tp > 1:
            check_sequence_divisible(x.shape[0], tp)
            y = _deps.matmul_reduce_scatter(x, self.weight, group,  # (s/tp, b, out)
                                            options=self.tp.options)
        else:
            y = _deps.linear_with_grad_accumulation(x, self.weight)  # (s, b, out) partial sum
            if tp > 1:
                y = _deps.reduce_from_region(y, group)
        bias = self.bias
        if bias is not None and self.sequence_parallel and tp > 1:
            bias = _deps.copy_to_region(bias, group)  # backward: all-reduce the chunk-wise grads
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (tp={self.tp.size}, stride={self.stride}), "
                f"out={self.output_size}, sequence_parallel={self.sequence_parallel}")


def _from_dense(cls, linear: nn.Linear, kwargs: dict):
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"from_dense expects an nn.Linear, got {type(linear).__name__}")
    for key in ("master_weight", "master_bias", "bias"):
        if key in kwargs:
            raise ValueError(f"from_dense takes {key} from the dense layer; do not pass {key}=")
    has_bias = linear.bias is not None
    layer = cls(linear.in_features, linear.out_features, bias=has_bias,
                params_dtype=kwargs.pop("params_dtype", linear.weight.dtype),
                master_weight=linear.weight.detach().cpu(),
                master_bias=linear.bias.detach().cpu() if has_bias else None, **kwargs)
    return layer.to(linear.weight.device)
