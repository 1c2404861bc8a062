"""MultiLatentAttention: DeepSeek-V2/V3 multi-latent attention (Megatron's ``MLASelfAttention``),
heads split over the TP group.

Sizes: n heads (n_l = n/tp on this rank), d_n = ``qk_head_dim`` (the part without position),
d_pe = ``qk_pos_emb_head_dim`` (the decoupled rope part), d_q = d_n + d_pe, d_v = ``v_head_dim``,
r = ``kv_lora_rank``, r_q = ``q_lora_rank``. Dataflow on a rank (x the layer's input, (s, b, h), or
its sequence chunk (s/tp, b, h) under sequence parallelism):

    query   q_lora_rank None:  q = linear_q_proj(x)                       column-parallel, (s, b, n_l·d_q)
            else:  c_q = q_layernorm(linear_q_down_proj(x))              replicated, (s[/tp], b, r_q)
                   q = linear_q_up_proj(c_q)                             column-parallel, (s, b, n_l·d_q)
    latent  [c_kv, k_pe] = linear_kv_down_proj(x)                       replicated, (s[/tp], b, r + d_pe)
            c_kv = kv_layernorm(c_kv);  [k_n, v] = linear_kv_up_proj(c_kv)   column-parallel over heads,
                                                                          (s, b, n_l·(d_n + d_v))
    rope    q = [q_n, rope(q_pe)],  k = [k_n, rope(k_pe)]  — one k_pe (s, b, d_pe) for every head
    core    o = softmax(scale · q kᵀ + causal) v    q, k [b, n_l, s, d_q], v [b, n_l, s, d_v]
    output  linear_proj(o)   row-parallel, (s or s/tp, b, h)

``q_layernorm`` / ``kv_layernorm`` exist only with ``qk_layernorm`` (Megatron's MLA specs put the
norms there under ``--qk-layernorm``, IdentityOp otherwise; DeepSeek's checkpoints have them), with
the layer's ``normalization`` and epsilon. Rope and the softmax scale: ``mla_rope.MLARotary``
(yarn / rope, the concentration folded into the tables, scale = g(F, mscale_all_dim)² / √d_q).
No bias on the q / kv projections (Megatron); ``linear_proj`` has one with ``add_bias_linear``.

Replicated down projections (Megatron's duplicated ``TELinear``): every TP rank holds the whole
``(out, in)`` weight. Without sequence parallelism every rank sees the whole x, and the gradients
reaching ``c_q`` / ``c_kv`` are already complete (the column-parallel up projections all-reduce
their input gradient), so the weights' gradients agree on every rank; ``k_pe`` is used only by this
rank's heads, so it enters through ``copy_to_region`` (its gradient all-reduced over TP). Under
sequence parallelism each rank projects only its tokens (s/tp): the weights enter through
``copy_to_region`` (gradient all-reduced inside autograd, as the SP norm weights in ``norm.py``;
the parameters carry ``sequence_parallel = True``), the up projections' fused all-gathers bring
c_q / c_kv to the whole sequence, and ``k_pe`` is all-gathered over s
(``gather_from_sequence_parallel_region``, whose backward reduce-scatters: the sum over the ranks'
heads of each token's gradient).

Core attention: q/k and v head dims differ, and ``kernels.flash_attention`` takes q, k, v of one
head dim. So v is zero-padded to d_q (or q / k to d_v when d_v > d_q) and the output sliced back: the
padded columns of v give zero output columns and, their output gradient being zero, change neither
the gradient of the rest nor the softmax statistics, so the result is exact. The kernels (Triton on a
GPU, the torch path on CPU) run for padded head dims in [16, 128]; outside that range (DeepSeek-V3's
d_q = 192, tiny test models) the explicit fp32 path of ``attention_blocks.block_forward`` — for
either, the same ``BlockAttention`` call. Context parallelism (cp > 1): ``context_parallel_attention``
on the padded q/k/v with the MLA softmax scale. Dropout needs the model's ``dropout_coordinates``.

Inference (``inference_context``): the cache holds, per token, the normalised latent c_kv (r) and
the rotated rope key (d_pe) — ``[b, 1, S, r]`` and ``[b, 1, S, d_pe]``, the same on every TP rank
(not divided by tp): (r + d_pe) elements per token per layer (DeepSeek-V3, bf16: 1152 bytes) instead
of 2·n_l·… for full keys and values. Each step expands all cached latents through this rank's
``linear_kv_up_proj`` shard (no communication) and attends with ``q_offset`` = the cached tokens.

Selective recompute: ``recompute_core_attention`` (``core_attn``) re-runs the core attention in
backward keeping q / k / v; ``recompute_up_proj`` (Megatron's ``mla_up_proj``) re-runs the up
projections, rope and core attention, keeping only c_q (or x), c_kv and k_pe.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _deps
from ._group import resolve_cp_group, resolve_tp_group
from .attention import check_attention_inputs, check_context_parallel_layer
from .attention_blocks import BlockAttention
from .checkpointing import checkpoint
from .context_parallel import canonical_comm_type, context_parallel_attention
from .init import draw_master_weight, normal_init
from .linear import ColumnParallelLinear, RowParallelLinear
from .mla_rope import MLARotary, apply_interleaved_rotary
from .norm import Norm
from .random import ATTENTION_PROBS, dropout_site
from .rope import default_position_ids
from tpfuse.parallel.context_split import local_token_index


class ReplicatedLinear(nn.Module):
    """``y = x Wᵀ`` with the whole ``W (out, in)`` on every TP rank (no bias). Under sequence
    parallelism at tp > 1 the weight enters through ``copy_to_region``: each rank's gradient covers
    only its tokens, the all-reduce makes it the full one (module docstring)."""

    def __init__(self, input_size: int, output_size: int, *, sequence_parallel: bool = False,
                 init_method=None, params_dtype: torch.dtype = torch.float32, group=None):
        super().__init__()
        self.tp = resolve_tp_group(group)
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel = bool(sequence_parallel)
        weight = draw_master_weight(output_size, input_size, init_method, params_dtype)
        self.weight = nn.Parameter(weight)
        self.weight.tensor_model_parallel = False
        self.weight.partition_dim, self.weight.partition_stride = None, 1
        self.weight.sequence_parallel = self.sequence_parallel and self.tp.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.sequence_parallel and self.tp.size > 1:
            weight = _deps.copy_to_region(weight, self.tp.group)
        return _deps.linear_with_grad_accumulation(x, weight, None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (replicated over tp="
                f"{self.tp.size}), sequence_parallel={self.sequence_parallel}")


def check_mla_sizes(hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_head_dim,
                    qk_pos_emb_head_dim, v_head_dim, tp) -> None:
    """ValueError naming the value that cannot build an MLA layer."""
    sizes = dict(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                 kv_lora_rank=kv_lora_rank, qk_head_dim=qk_head_dim,
                 qk_pos_emb_head_dim=qk_pos_emb_head_dim, v_head_dim=v_head_dim)
    if q_lora_rank is not None:
        sizes["q_lora_rank"] = q_lora_rank
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if qk_pos_emb_head_dim % 2:
        raise ValueError(f"qk_pos_emb_head_dim={qk_pos_emb_head_dim} must be even (rope pairs)")
    if num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by "
                         f"tensor-parallel size tp={tp}")


class MultiLatentAttention(nn.Module):
    takes_batch_first = False       # sequence-first GEMMs (TransformerLayer._attention_input)

    def __init__(self, hidden_size: int, num_attention_heads: int, *,
                 q_lora_rank: int | None = None, kv_lora_rank: int = 32, qk_head_dim: int = 128,
                 qk_pos_emb_head_dim: int = 64, v_head_dim: int = 128,
                 rotary: MLARotary | None = None, add_bias_linear: bool = True,
                 attention_dropout: float = 0.0, sequence_parallel: bool = False,
                 init_method_std: float = 0.02, output_layer_init_std: float | None = None,
                 params_dtype: torch.dtype = torch.float32, recompute_core_attention: bool = False,
                 recompute_up_proj: bool = False, group=None, state=None,
                 window_size: int | None = None, cp_comm_type: str = "p2p", cp_group=None,
                 layer_number: int = 1, qk_layernorm: bool = False,
                 normalization: str = "LayerNorm", layernorm_epsilon: float = 1e-5):
        super().__init__()
        self.layer_number = layer_number
        self.tp = resolve_tp_group(group, state)
        self.cp = resolve_cp_group(cp_group, state, group)
        check_mla_sizes(hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_head_dim,
                        qk_pos_emb_head_dim, v_head_dim, self.tp.size)
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.heads_local = num_attention_heads // self.tp.size
        self.window_size, self.cp_comm_type = window_size, canonical_comm_type(cp_comm_type)
        check_context_parallel_layer(self.cp.size, self.cp_comm_type, self.heads_local,
                                     self.heads_local, attention_dropout, window_size)
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_head_dim, self.qk_pos_emb_head_dim = qk_head_dim, qk_pos_emb_head_dim
        self.v_head_dim, self.q_head_dim = v_head_dim, qk_head_dim + qk_pos_emb_head_dim
        self.rotary = rotary or MLARotary()
        self.softmax_scale = self.rotary.softmax_scale(self.q_head_dim)
        self.sequence_parallel, self.attention_dropout = sequence_parallel, attention_dropout
        self.recompute_core_attention, self.recompute_up_proj = (recompute_core_attention,
                                                                 recompute_up_proj)
        self._build_linears(hidden_size, num_attention_heads, add_bias_linear, init_method_std,
                            output_layer_init_std, params_dtype)
        norm = dict(normalization=normalization, eps=layernorm_epsilon,
                    sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                    group=self.tp.group)
        self.q_layernorm = (Norm(q_lora_rank, **norm)
                            if qk_layernorm and q_lora_rank is not None else None)
        self.kv_layernorm = Norm(kv_lora_rank, **norm) if qk_layernorm else None

    def _build_linears(self, hidden_size, heads, add_bias_linear, init_std, output_std, dtype):
        """Megatron's construction order: linear_proj, the query projection(s), kv down, kv up."""
        init = normal_init(init_std)
        column = dict(bias=False, sequence_parallel=self.sequence_parallel, params_dtype=dtype,
                      group=self.tp.group, init_method=init)
        replicated = dict(sequence_parallel=self.sequence_parallel, params_dtype=dtype,
                          group=self.tp.group, init_method=init)
        self.linear_proj = RowParallelLinear(
            heads * self.v_head_dim, hidden_size, bias=add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, sequence_parallel=self.sequence_parallel, params_dtype=dtype,
            group=self.tp.group, init_method=normal_init(output_std or init_std))
        if self.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(hidden_size, heads * self.q_head_dim,
                                                      **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(hidden_size, self.q_lora_rank,
                                                       **replicated)
            self.linear_q_up_proj = ColumnParallelLinear(self.q_lora_rank,
                                                         heads * self.q_head_dim, **column)
        self.linear_kv_down_proj = ReplicatedLinear(
            hidden_size, self.kv_lora_rank + self.qk_pos_emb_head_dim, **replicated)
        self.linear_kv_up_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim), **column)

    # ---------------------------------------------------------------- forward
    def full_sequence_length(self, hidden_states: torch.Tensor) -> int:
        local = hidden_states.shape[0]
        return local * self.tp.size if self.sequence_parallel else local

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_context=None, rotary_pos_emb=None,
                document_ids: torch.Tensor | None = None, dropout_coordinates=None):
        seq, batch = self.full_sequence_length(hidden_states), hidden_states.shape[1]
        check_attention_inputs(self.cp.size, inference_context, (batch, seq), position_ids,
                               document_ids)
        if rotary_pos_emb is None:
            if position_ids is None:
                position_ids = self.default_position_ids(batch, seq, hidden_states.device)
            rotary_pos_emb = self.rotary.cos_sin(position_ids, self.qk_pos_emb_head_dim)
        cos, sin = rotary_pos_emb                                   # (b, 1, s, d_pe)
        query_input = self._query_input(hidden_states)              # c_q or x
        latent, k_pe = self._kv_latent(hidden_states)               # (s[/tp], b, r), (s, b, d_pe)
        if inference_context is not None:
            context = self._cached_attention(query_input, latent, k_pe, cos, sin,
                                             inference_context)
        elif self.recompute_up_proj and self.training:
            context = checkpoint(self._up_project_and_attend, query_input, latent, k_pe, cos,
                                 sin, document_ids, dropout_coordinates)
        else:
            context = self._up_project_and_attend(query_input, latent, k_pe, cos, sin,
                                                  document_ids, dropout_coordinates)
        width = self.heads_local * self.v_head_dim                  # context [b, n_l, s, d_v]
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, width)
        return self.linear_proj(context, fold_bias=True)            # (s or s/tp, b, h), bias

    def default_position_ids(self, batch: int, seq: int, device) -> torch.Tensor:
        """0..s−1, or under context parallelism the global positions of this rank's chunks."""
        if self.cp.size == 1:
            return default_position_ids(batch, seq, device)
        return local_token_index(seq * self.cp.size, self.cp.size, self.cp.rank,
                                 device).expand(batch, seq)

    def _query_input(self, hidden_states):
        """What the query's column-parallel projection reads: x, or the normalised c_q."""
        if self.q_lora_rank is None:
            return hidden_states
        compressed = self.linear_q_down_proj(hidden_states)
        return compressed if self.q_layernorm is None else self.q_layernorm(compressed)

    def _kv_latent(self, hidden_states):
        """(normalised c_kv (s[/tp], b, r), k_pe (s, b, d_pe) of the whole sequence)."""
        combined = self.linear_kv_down_proj(hidden_states)
        latent, k_pe = combined.split([self.kv_lora_rank, self.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        if self.tp.size > 1 and self.sequence_parallel:
            k_pe = _deps.gather_from_sequence_parallel_region(k_pe, self.tp.group)
        elif self.tp.size > 1:
            k_pe = _deps.copy_to_region(k_pe, self.tp.group)    # backward: Σ over ranks' heads
        return latent, k_pe

    def _query(self, query_input):
        """q ``[b, n_l, s, d_q]`` before rope (a view of the projection's output)."""
        project = self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj
        q = project(query_input)                                    # (s, b, n_l·d_q)
        return q.view(*q.shape[:2], self.heads_local, self.q_head_dim).permute(1, 2, 0, 3)

    def _expand_latent(self, kv):
        """(k_n [b, n_l, s, d_n], v [b, n_l, s, d_v]) of the up projection's (s, b, ·) output."""
        kv = kv.view(*kv.shape[:2], self.heads_local, self.qk_head_dim + self.v_head_dim)
        k_nope, value = kv.permute(1, 2, 0, 3).split([self.qk_head_dim, self.v_head_dim], dim=-1)
        return k_nope, value

    def _rotated(self, q, k_pe_heads, cos, sin):
        """(q with its rope part rotated, the rotated rope key [b, 1, s, d_pe])."""
        q_nope, q_pe = q.split([self.qk_head_dim, self.qk_pos_emb_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_interleaved_rotary(q_pe, cos, sin)], dim=-1)
        return q, apply_interleaved_rotary(k_pe_heads, cos, sin)

    def _keys(self, k_nope, k_pe_rotated):
        return torch.cat([k_nope, k_pe_rotated.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)

    def _up_project_and_attend(self, query_input, latent, k_pe, cos, sin, document_ids=None,
                               dropout_coordinates=None):
        """Up projections, rope and core attention → context [b, n_l, s, d_v] (the region
        ``mla_up_proj`` recompute re-runs)."""
        q = self._query(query_input)
        k_nope, value = self._expand_latent(self.linear_kv_up_proj(latent))
        q, k_rope = self._rotated(q, k_pe.permute(1, 0, 2)[:, None], cos, sin)
        key = self._keys(k_nope, k_rope)
        if self.recompute_core_attention and self.training:
            return checkpoint(self._core_attention, q, key, value, document_ids,
                              dropout_coordinates)
        return self._core_attention(q, key, value, document_ids, dropout_coordinates)

    def _core_attention(self, q, k, v, document_ids=None, dropout_coordinates=None):
        """softmax(scale · q kᵀ + causal / window / documents) v on zero-padded equal head dims
        (module docstring): [b, n_l, s, d_q] ×2, [b, n_l, s, d_v] → [b, n_l, s, d_v]."""
        dropout = self.attention_dropout if self.training else 0.0
        drop = self._attention_dropout(dropout, dropout_coordinates)
        if dropout > 0 and drop is None:
            raise ValueError("attention dropout in MultiLatentAttention needs the model's "
                             "dropout_coordinates (global sample and positions of the tokens)")
        q, k, v_padded = padded_to_one_head_dim(q, k, v)
        if self.cp.size > 1:
            out = context_parallel_attention(
                q.contiguous(), k.contiguous(), v_padded.contiguous(), self.cp,
                self.cp_comm_type, softmax_scale=self.softmax_scale,
                window_size=self.window_size, document_ids=document_ids, dropout=drop)
        else:
            mask = _deps.AttentionMask(causal=True, window_size=self.window_size,
                                       q_document_ids=document_ids, k_document_ids=document_ids)
            out = BlockAttention.apply(q, k, v_padded, self.softmax_scale, mask, drop)
        return out[..., :v.shape[-1]]

    def _attention_dropout(self, p: float, coordinates):
        if p == 0 or coordinates is None:
            return None
        key = _deps.dropout_key(coordinates.seed, dropout_site(self.layer_number, ATTENTION_PROBS))
        return _deps.AttentionDropout(p, key, coordinates.first_sample,
                                      self.tp.rank * self.heads_local)

    # ---------------------------------------------------------------- inference
    def _cached_attention(self, query_input, latent, k_pe, cos, sin, inference_context):
        """Cache the step's c_kv and rotated k_pe; q attends over every cached token's keys and
        values, expanded from the cached latents by this rank's kv up-projection shard."""
        if self.tp.size > 1 and self.sequence_parallel:     # the cache holds whole sequences
            latent = _deps.gather_from_sequence_parallel_region(latent, self.tp.group)
        q = self._query(query_input)
        q, k_rope = self._rotated(q, k_pe.permute(1, 0, 2)[:, None], cos, sin)
        offset = inference_context.sequence_len_offset
        latents, rope_keys = inference_context.update_kv_cache(
            self, latent.permute(1, 0, 2)[:, None], k_rope)   # [b, 1, offset + s, r | d_pe]
        expanded = F.linear(latents[:, 0].transpose(0, 1), self.linear_kv_up_proj.weight)
        k_nope, value = self._expand_latent(expanded)          # (offset + s, b, ·) rows
        key = self._keys(k_nope, rope_keys)
        q_ids, k_ids = inference_context.document_ids(offset, q.shape[2])
        mask = _deps.AttentionMask(causal=True, window_size=self.window_size, q_offset=offset,
                                   q_document_ids=q_ids, k_document_ids=k_ids)
        q, key, v_padded = padded_to_one_head_dim(q, key, value)
        return BlockAttention.apply(q, key, v_padded, self.softmax_scale, mask,
                                    None)[..., :self.v_head_dim]


def padded_to_one_head_dim(q, k, v):
    """q, k, v zero-padded along the head dim to max(d_q, d_v) (exact: module docstring)."""
    width = max(q.shape[-1], v.shape[-1])
    q, k = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k))
    return q, k, F.pad(v, (0, width - v.shape[-1])) if v.shape[-1] < width else v
