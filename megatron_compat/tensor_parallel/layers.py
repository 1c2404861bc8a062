"""megatron-core 0.16's ``tensor_parallel.layers``: Megatron's constructor signatures and
return conventions over tpfuse's layers.

``ColumnParallelLinear(input_size, output_size, *, config, init_method, bias=True, ...)`` and
``RowParallelLinear(input_size, output_size, *, config, init_method, bias, input_is_parallel,
skip_bias_add, ...)`` always return ``(output, bias)`` (bias None unless ``skip_bias_add``);
``VocabParallelEmbedding(num_embeddings, embedding_dim, *, init_method,
reduce_scatter_embeddings=False, config, tp_group=None)`` returns the embeddings. Initialisation
is Megatron's CPU path (the full master weight from the default generator, this rank's slice
kept) whatever ``config.use_cpu_initialization`` says, so the weights do not depend on the layout.
``keep_master_weight_for_test`` keeps that master as ``.master_weight``.
"""
from __future__ import annotations

import warnings

import torch

from tpfuse.kernels.matmul import matmul
from tpfuse.kernels.wgrad import linear_with_grad_accumulation
from tpfuse.parallel import mappings as _m
from tpfuse.parallel.mappings import default_tensor_parallel_group as _tp
from tpfuse.tp_layers import embedding as _embedding
from tpfuse.tp_layers import linear as _linear
from tpfuse.parallel.state import resolve_state_or_none
from tpfuse.tp_layers._group import TPGroup, resolve_tp_group
from tpfuse.tp_layers.init import draw_master_weight

_TP_ATTRIBUTES = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}
_NO_COMMUNICATION = TPGroup(None, 1, 0)     # a forward whose caller communicates


# ----------------------------------------------------------------------------- config → settings
def layer_settings(config, tp_size: int):
    """(sequence_parallel, params_dtype) of a layer built from a Megatron config; sequence
    parallelism at a tensor-parallel size of 1 is switched off with a warning, as Megatron does."""
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if sequence_parallel and tp_size == 1:
        warnings.warn("sequence_parallel=True with a tensor-parallel size of 1: disabled, as "
                      "Megatron does")
        sequence_parallel = False
    return sequence_parallel, getattr(config, "params_dtype", None) or torch.float32


def expert_parallel(config, is_expert: bool) -> bool:
    """Megatron's ``is_expert and expert_parallel``: an expert layer with more than one
    expert-parallel rank (``config.expert_model_parallel_size``, else the default state's)."""
    if not is_expert:
        return False
    size = getattr(config, "expert_model_parallel_size", None)
    if size is None:
        state = resolve_state_or_none()
        size = state.ep_size if state is not None else 1
    return size > 1


def communicates_outside(tp: TPGroup, is_expert: bool, expert_parallel_: bool) -> bool:
    """Megatron's ``explicit_expert_comm``: an expert layer with etp > 1 or ep > 1 does no
    tensor-parallel collective of its own (the MoE dispatcher communicates)."""
    return is_expert and (tp.size > 1 or expert_parallel_)


def mark_allreduce(params, is_expert: bool, expert_parallel_: bool) -> None:
    """Megatron's ``param.allreduce``: False for expert parameters with ep > 1 (reduced over
    the expert data-parallel group instead)."""
    for param in params:
        if param is not None:
            param.allreduce = not (is_expert and expert_parallel_)


def _master_for(rows, cols, init_method, config, keep, skip):
    """The master weight drawn as the native layer would (or zeros without a draw, Megatron's
    ``perform_initialization=False``); None lets the native layer draw it."""
    params_dtype = getattr(config, "params_dtype", None) or torch.float32
    if skip or not getattr(config, "perform_initialization", True):
        return torch.zeros(rows, cols, dtype=params_dtype)
    if not keep:
        return None
    return draw_master_weight(rows, cols, init_method, params_dtype)


# ----------------------------------------------------------------------------- layers
class ColumnParallelLinear(_linear.ColumnParallelLinear):
    """Megatron's constructor over the native layer: ``sequence_parallel`` and ``params_dtype``
    from ``config``, ``is_expert`` shards over the expert tensor-parallel group, ``tp_group``
    is the native ``group``; ``forward`` returns ``(output, bias or None)``."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True,
                 gather_output=False, stride=1, keep_master_weight_for_test=False,
                 skip_bias_add=False, skip_weight_param_allocation=False,
                 embedding_activation_buffer=None, grad_output_buffer=None, is_expert=False,
                 tp_comm_buffer_name=None, disable_grad_reduce=False, tp_group=None):
        tp = resolve_tp_group(tp_group, None, expert=is_expert)
        sequence_parallel, params_dtype = layer_settings(config, tp.size)
        ep = expert_parallel(config, is_expert)
        outside = communicates_outside(tp, is_expert, ep)
        if gather_output and outside:
            raise ValueError("gather_output=True is not supported for expert layers whose "
                             "communication happens outside the layer (is_expert=True)")
        if disable_grad_reduce and (sequence_parallel or gather_output):
            raise ValueError("disable_grad_reduce=True is supported without sequence "
                             "parallelism and gather_output only")
        master = _master_for(output_size, input_size, init_method, config,
                             keep_master_weight_for_test, skip_weight_param_allocation)
        super().__init__(input_size, output_size, bias=bias, gather_output=gather_output,
                         sequence_parallel=sequence_parallel, skip_bias_add=skip_bias_add,
                         init_method=init_method, stride=stride, params_dtype=params_dtype,
                         master_weight=master, group=tp.group)
        self.tp = self.comm = tp       # the same group, with its state's communication options
        if outside or disable_grad_reduce:   # no collective here (disable: no dgrad all-reduce)
            self.comm = _NO_COMMUNICATION
        mark_allreduce((self.weight, self.bias), is_expert, ep)
        self.config, self.is_expert = config, is_expert
        self.disable_grad_reduce = disable_grad_reduce
        self.output_size_per_partition = output_size // self.tp.size
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        if keep_master_weight_for_test:
            self.master_weight = master
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """``(output, bias)``; ``weight`` replaces (or, without allocation, supplies) the
        weight; ``runtime_gather_output`` overrides ``gather_output`` for this call."""
        if weight is None and self.weight is None:
            raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                               "and skip_weight_param_allocation is True")
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        saved, self.gather_output = self.gather_output, bool(gather)
        try:
            out = super().forward(input_, weight)
        finally:
            self.gather_output = saved
        return out if self.skip_bias_add else (out, None)


class RowParallelLinear(_linear.RowParallelLinear):
    """Megatron's constructor over the native layer (settings as for ``ColumnParallelLinear``);
    ``forward`` returns ``(output, bias or None)``."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel,
                 skip_bias_add, stride=1, keep_master_weight_for_test=False, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None):
        tp = resolve_tp_group(tp_group, None, expert=is_expert)
        sequence_parallel, params_dtype = layer_settings(config, tp.size)
        ep = expert_parallel(config, is_expert)
        outside = communicates_outside(tp, is_expert, ep)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        if outside and not skip_bias_add:
            raise ValueError("an expert RowParallelLinear whose reduction happens outside the "
                             "layer (is_expert=True) needs skip_bias_add=True, as in Megatron")
        master = _master_for(output_size, input_size, init_method, config,
                             keep_master_weight_for_test, False)
        super().__init__(input_size, output_size, bias=bias,
                         input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                         skip_bias_add=skip_bias_add, init_method=init_method, stride=stride,
                         params_dtype=params_dtype, master_weight=master, group=tp.group)
        self.tp = self.comm = tp       # the same group, with its state's communication options
        if outside:
            self.comm = _NO_COMMUNICATION
        mark_allreduce((self.weight, self.bias), is_expert, ep)
        self.config, self.is_expert = config, is_expert
        self.input_size_per_partition = input_size // self.tp.size
        if keep_master_weight_for_test:
            self.master_weight = master

    def forward(self, input_):
        """``(output, bias)``: the bias is added unless ``skip_bias_add`` (then returned)."""
        out = super().forward(input_)
        return out if self.skip_bias_add else (out, None)


class VocabParallelEmbedding(_embedding.VocabParallelEmbedding):
    """Megatron's constructor over the native layer: ``reduce_scatter_embeddings`` is the
    native ``sequence_parallel``, ``params_dtype`` comes from ``config``."""

    def __init__(self, num_embeddings, embedding_dim, *, init_method,
                 reduce_scatter_embeddings=False, config, tp_group=None):
        tp = resolve_tp_group(tp_group, None)
        _, params_dtype = layer_settings(config, tp.size)
        master = None
        if not getattr(config, "perform_initialization", True):
            master = torch.zeros(num_embeddings, embedding_dim, dtype=params_dtype)
        super().__init__(num_embeddings, embedding_dim, init_method=init_method,
                         sequence_parallel=reduce_scatter_embeddings, params_dtype=params_dtype,
                         master_weight=master, group=tp.group)
        self.tp = tp                   # the same group, with its state's communication options
        self.config, self.reduce_scatter_embeddings = config, reduce_scatter_embeddings
        self.vocab_start_index = self.vocab_start
        self.vocab_end_index = self.vocab_start + self.vocab_per_rank
        self.num_embeddings_per_partition = self.vocab_per_rank
        self.deterministic_mode = getattr(config, "deterministic_mode", False)


# ----------------------------------------------------------------------------- functions
def linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None,
        tp_group=None):
    """``y = x Wᵀ + b`` with x all-gathered over the sequence first (``sequence_parallel``; its
    grad reduce-scattered) or its grad all-reduced (``allreduce_dgrad``). The weight gradient
    goes where tpfuse's linear layers put it: accumulated in fp32 into ``weight.main_grad`` when
    the trainer set one (Megatron's gradient-accumulation fusion), else ``weight.grad``."""
    if grad_output_buffer is not None:
        raise ValueError("grad_output_buffer (deferred embedding wgrad) is not supported")
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel cannot both be True")
    group = _tp(tp_group)
    if sequence_parallel:
        input = _m.gather_from_sequence_parallel_region(input, group)
    elif allreduce_dgrad:
        input = _m.copy_to_region(input, group)
    if not weight.requires_grad:
        return matmul(input, weight.t(), bias)
    return linear_with_grad_accumulation(input, weight, bias)


def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                              sequence_parallel, tp_group, grad_output_buffer=None,
                              wgrad_deferral_limit=None, async_grad_allreduce=None):
    """The same forward and input gradient, with no weight gradient."""
    return linear_with_grad_accumulation_and_async_allreduce(
        input, weight.detach(), bias, False, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, tp_group=tp_group)


def param_is_not_tensor_parallel_duplicate(param, tp_group=None):
    """True for a sharded parameter, or on tensor-parallel rank 0 for a replicated one."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return _m.group_rank(_tp(tp_group)) == 0


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):
    for attribute in _TP_ATTRIBUTES:
        if hasattr(tensor, attribute):
            raise ValueError(f"tensor already has {attribute}={getattr(tensor, attribute)!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor):
    for attribute, default in _TP_ATTRIBUTES.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, default)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor):
    for attribute in _TP_ATTRIBUTES:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))
