"""TransformerLayer: pre-norm attention and MLP blocks with bias-dropout-add residuals.

    x ─norm→ ParallelAttention ─bias_dropout_add(+x)→ y ─norm→ ParallelMLP ─bias_dropout_add(+y)→ out

``hidden_states`` is ``(s, b, h)``, or this rank's chunk ``(s/tp, b, h)`` with sequence
parallelism (the attention sees the full sequence after its QKV all-gather; rotary angles come
from ``position_ids (b, s)`` over the full sequence, default 0..s−1). Under context parallelism s
is this cp rank's s/cp tokens (its two load-balanced chunks). ``document_ids (b, s)`` keep
attention inside packed documents; ``window_size`` / ``cp_comm_type``: ParallelAttention's.

Hidden and attention dropout with ``dropout_coordinates`` (``random.DropoutCoordinates``, what
a GPT model passes): every mask is a function of (seed, ``layer_number``, the element's global
sample, position and hidden / head index), the same at every layout (``kernels/philox.py``).
Without coordinates (a layer used on its own) the hidden dropout's seed is drawn from the active
generator:
without sequence parallelism the activations are replicated over TP, so the seed comes from the
default generator and every TP rank drops the same elements; with sequence parallelism each rank
holds different tokens, so the seed comes from the model-parallel stream (``fork()``). Norm
weights and the row-parallel biases have their gradients all-reduced over TP under sequence
parallelism (see ``norm.py`` / ``linear.py``).

Selective recompute (Megatron's ``recompute_modules``): ``"core_attn"`` re-runs rotary +
attention in backward, keeping only q/k/v (the QKV output); ``"mlp"`` re-runs pre-MLP norm, MLP
and its bias-dropout-add, keeping only the block's input; ``"layernorm"`` frees each norm's
output once the next block has consumed it and re-runs the norm when the block's output gradient
arrives (``tp_layers/checkpointing.py``). Only while training with gradients enabled.

``rotary_pos_emb``: the ``(cos, sin)`` tables (``rope.rotary_cos_sin``), computed once per model
forward and shared by every layer; without them a rope layer computes its own.

Master weights are drawn in construction order: QKV, attention projection, fc1, fc2.
``qk_layernorm``: ParallelAttention's q / k norms over the head dim (the layer's normalization
and epsilon).

``mlp_builder`` (a callable returning a module with ParallelMLP's ``forward(x) -> (out, bias)``)
replaces the ParallelMLP, built at the same point of the draw order (e.g. an MoE layer).
``self_attention_builder`` likewise replaces the ParallelAttention (a module with its ``forward``
signature and ``(out, bias)`` result, e.g. ``mla.MultiLatentAttention``).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _deps
from ._group import resolve_cp_group, resolve_tp_group
from .checkpointing import RECOMPUTE_MODULES, DiscardedOutput, checkpoint
from .attention import ParallelAttention
from .mlp import ParallelMLP
from .norm import Norm
from .qkv_layout import batch_first_attention
from .random import ATTENTION_OUTPUT, MLP_OUTPUT, dropout_site, partitioned_region_rng


class TransformerLayer(nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int, *,
                 num_query_groups: int | None = None, normalization: str = "LayerNorm",
                 layernorm_epsilon: float = 1e-5, activation: str = "gelu",
                 add_bias_linear: bool = True, hidden_dropout: float = 0.0,
                 attention_dropout: float = 0.0,
                 position_embedding_type: str = "learned_absolute", rotary_base: float = 10000,
                 sequence_parallel: bool = False, init_method_std: float = 0.02,
                 output_layer_init_std: float | None = None,
                 params_dtype: torch.dtype = torch.float32, recompute_modules=(), state=None,
                 group=None, window_size: int | None = None, cp_comm_type: str = "p2p",
                 mlp_builder=None, layer_number: int = 1, add_qkv_bias: bool = False,
                 qk_layernorm: bool = False, self_attention_builder=None):
        super().__init__()
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout must be in [0, 1), got {hidden_dropout}")
        unknown = set(recompute_modules) - set(RECOMPUTE_MODULES)
        if unknown:
            raise ValueError(f"recompute_modules {sorted(unknown)} not among {RECOMPUTE_MODULES}")
        self.recompute_modules = tuple(recompute_modules)
        self.tp = resolve_tp_group(group, state)
        self.hidden_size, self.hidden_dropout = hidden_size, hidden_dropout
        self.sequence_parallel, self.layer_number = sequence_parallel, layer_number
        norm = dict(normalization=normalization, eps=layernorm_epsilon,
                    sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                    group=self.tp.group)
        common = dict(add_bias_linear=add_bias_linear, sequence_parallel=sequence_parallel,
                      init_method_std=init_method_std, output_layer_init_std=output_layer_init_std,
                      params_dtype=params_dtype, group=self.tp.group)
        self.input_norm = Norm(hidden_size, **norm)
        if self_attention_builder is not None:
            self.self_attention = self_attention_builder()
        else:
            self.self_attention = ParallelAttention(
                hidden_size, num_attention_heads, num_query_groups=num_query_groups,
                attention_dropout=attention_dropout,
                position_embedding_type=position_embedding_type, rotary_base=rotary_base,
                recompute_core_attention="core_attn" in recompute_modules,
                window_size=window_size, cp_comm_type=cp_comm_type, add_qkv_bias=add_qkv_bias,
                qk_layernorm=qk_layernorm, normalization=normalization,
                layernorm_epsilon=layernorm_epsilon,
                cp_group=resolve_cp_group(None, state, group).group, layer_number=layer_number,
                **common)
        self.pre_mlp_norm = Norm(hidden_size, **norm)
        self.mlp = (mlp_builder() if mlp_builder is not None else
                    ParallelMLP(hidden_size, ffn_hidden_size, activation=activation, **common))

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_context=None, rotary_pos_emb=None,
                document_ids: torch.Tensor | None = None, dropout_coordinates=None):
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be (s, b, {self.hidden_size}), got "
                             f"{tuple(hidden_states.shape)}")
        recompute = self.recompute_modules if self.training else ()
        input_norm = (DiscardedOutput(self.input_norm) if "layernorm" in recompute
                      else self.input_norm)
        attn_out, attn_bias = self.self_attention(self._attention_input(hidden_states, input_norm),
                                                  position_ids,
                                                  inference_context=inference_context,
                                                  rotary_pos_emb=rotary_pos_emb,
                                                  document_ids=document_ids,
                                                  dropout_coordinates=dropout_coordinates)
        if "layernorm" in recompute:
            input_norm.discard(attn_out)             # the QKV GEMM has taken its input
        hidden_states = self._bias_dropout_add(attn_out, attn_bias, hidden_states,
                                               dropout_coordinates, ATTENTION_OUTPUT)
        if "mlp" in recompute:
            return checkpoint(self._mlp_block, hidden_states, False, dropout_coordinates)
        return self._mlp_block(hidden_states, "layernorm" in recompute, dropout_coordinates)

    def _attention_input(self, hidden_states, input_norm):
        """The input norm's output (s, b, h) for the attention. When the attention runs
        batch-first (CPU without sequence parallelism: ``qkv_layout.py``) the norm works on a
        (b, s, h) copy of the hidden states and the attention gets an (s, b, h) view of its
        output: the norm's forward and backward read contiguous rows, and the QKV GEMM takes the
        (b, s, h) rows as they are. The one copy is the one the GEMM would otherwise make."""
        if not batch_first_attention(hidden_states, self.sequence_parallel, self.tp.size):
            return input_norm(hidden_states)
        return input_norm(hidden_states.transpose(0, 1).contiguous()).transpose(0, 1)

    def _mlp_block(self, hidden_states, recompute_norm: bool, dropout_coordinates=None):
        """pre-MLP norm → MLP → bias-dropout-add(+hidden_states): (s or s/tp, b, h)."""
        norm = DiscardedOutput(self.pre_mlp_norm) if recompute_norm else self.pre_mlp_norm
        mlp_out, mlp_bias = self.mlp(norm(hidden_states))
        if recompute_norm:
            norm.discard(mlp_out)                    # fc1 has taken its input
        return self._bias_dropout_add(mlp_out, mlp_bias, hidden_states, dropout_coordinates,
                                      MLP_OUTPUT)

    def _bias_dropout_add(self, x, bias, residual, dropout_coordinates=None, kind=MLP_OUTPUT):
        if not (self.training and self.hidden_dropout > 0):
            if bias is None:                         # the bias went into the GEMM: nothing to fuse
                return residual + x
            return _deps.bias_dropout_add(x, bias, residual, 0.0, False, seed=0)
        if dropout_coordinates is not None:          # (s[/tp], b, h): rows token-major
            rows = dropout_coordinates.rows(dropout_site(self.layer_number, kind), x.shape[0],
                                            x.shape[1], self.tp.rank, self.sequence_parallel)
            return _deps.bias_dropout_add(x, bias, residual, self.hidden_dropout, True,
                                          coordinates=rows)
        with partitioned_region_rng(self.sequence_parallel):
            return _deps.bias_dropout_add(x, bias, residual, self.hidden_dropout, True)
