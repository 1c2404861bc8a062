"""ParallelAttention: causal self-attention with heads split over the TP group.

Master fused-QKV weight ``[(nh + 2·ng)·d, h]`` (nh query heads, ng query groups = KV heads, head
dim d = ``kv_channels``, h / nh unless given, e.g. Qwen3's head_dim) in Megatron's grouped
layout: for each group g, ``[q heads of g (nh/ng · d rows); k_g (d); v_g (d)]``, groups one after
another. A contiguous (stride 1) column-parallel split then gives each
rank whole groups — its heads' q, k and v — for any tp dividing ng, and the draw is layout
independent. Dataflow on rank r (h_l = nh/tp heads, g_l = ng/tp groups):

  x (s or s/tp, b, h) ─ColumnParallel(QKV)→ (s, b, (h_l + 2 g_l)·d)
    → q [b, h_l, s, d], k/v [b, g_l, s, d]  ─q/k norm (qk_layernorm)→
  ─rope(position_ids)→ ─flash_attention(causal)→ (s, b, h_l·d) ─RowParallel(proj)→ (s or s/tp, b, h)

On CPU without sequence parallelism the QKV and projection GEMMs run on batch-first tokens
(b, s, ·) and the output is an (s, b, h) view of the projection's (b, s, h): ATen's CPU flash
attention is faster on batch-first q/k/v (``qkv_layout.py``); the values are the same.

Attention dropout (``attention_dropout > 0`` in training) with the model's
``dropout_coordinates``: the kernels' ``AttentionDropout``, a mask of (seed, layer, global sample,
global head, global query and key positions), the same at every tp / cp layout: inside the
flash kernels (regenerated per tile in backward; on CPU the kernels' torch path materialises it),
on the explicit fp32 softmax → dropout → @ v path for head dims the kernels do not take, and at
cp > 1 inside every block of the context-parallel attention. Without coordinates (a layer used
on its own) the explicit path draws from the model-parallel RNG stream
(``get_rng_tracker().fork()``), as this rank's heads are a partitioned region. The explicit path also serves head dims the flash kernel does not
support (``kernels.flash_attention`` takes 16 ≤ d ≤ 128; tiny test models use d = 4).
``forward`` returns ``(output, bias)`` (bias added by the caller's bias-dropout-add; ``None``
without ``add_bias_linear``, and at tp = 1, where no reduction separates the projection GEMM from
its bias and the GEMM adds it: ``RowParallelLinear(..., fold_bias=True)``).

Masks beyond causal: ``window_size=W`` (flash_attention's sliding window: the last W positions,
the query's own included) and ``forward(..., document_ids=ids)`` ``(b, s)`` int (packed
documents: attend only within equal ids, ``--reset-attention-mask``).

Context parallelism (cp > 1, from ``state`` or ``cp_group=``): the local sequence is this cp
rank's two load-balanced chunks (parallel/context_split.py), ``position_ids`` / ``document_ids``
are those of the local tokens, and the core attention is ``context_parallel_attention`` with
``cp_comm_type`` ``p2p`` (ring) | ``all_gather`` | ``a2a`` (tp_layers/context_parallel.py).

Inference (``forward(..., inference_context=ctx)``, a ``tpfuse.inference.InferenceContext``): the
step's k/v ``[b, g_l, s, d]`` (this rank's KV heads only: GQA and TP shrink the cache alike) are
written into the context's cache at ``ctx.sequence_len_offset``, and q attends over every cached
key, query i sitting at position ``offset + i`` (causal across the whole cache) and only to keys
of its own document (the context's document ids mask left padding): flash_attention with
``q_offset`` and document ids. Prefill is the step with offset 0; each decode step is one more
query row (s_q = 1 over offset + 1 cached keys).

``qk_layernorm`` (Megatron's ``--qk-layernorm``, Qwen3's q_norm / k_norm): after the
QKV split and before rotary, every query head and every key head (the g_l KV heads under GQA) is
normalised over the head dim, ``q ← norm(q; w_q)``, ``k ← norm(k; w_k)``, with the layer's
``normalization`` / ``layernorm_epsilon`` and weights ``(d,)`` shared by all heads (``q_layernorm``
/ ``k_layernorm``, Megatron's names), replicated on every TP rank; as each rank sees only its
heads, their gradients are all-reduced over TP (``norm.py``, ``head_split``). The KV cache holds
the normalised, rotated keys.

``rotary_pos_emb``: the ``(cos, sin)`` tables of the model forward (computed once for all
layers); None: computed here from ``position_ids``. ``recompute_core_attention`` (selective
recompute ``core_attn``): rotary + attention run under ``checkpointing.checkpoint``, keeping only
q/k/v (views of the QKV output) and re-running in backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.parallel.checks import is_int
from tpfuse.parallel.context_split import local_token_index

from . import _deps
from ._group import resolve_cp_group, resolve_tp_group
from .checkpointing import checkpoint
from .context_parallel import (canonical_comm_type, check_context_parallel_heads,
                               context_parallel_attention)
from .init import normal_init
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import Norm
from .qkv_layout import batch_first_attention, split_qkv
from .random import ATTENTION_PROBS, dropout_site, get_rng_tracker
from .rope import apply_rotary, default_position_ids, rotary_cos_sin

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
FLASH_HEAD_DIMS = (_deps.MIN_HEAD_DIM, _deps.MAX_HEAD_DIM)  # what kernels.flash_attention takes


def check_heads(hidden_size: int, num_attention_heads: int, num_query_groups: int, tp: int) -> None:
    """ValueError naming the values when heads / groups / hidden do not split."""
    if num_attention_heads < 1 or hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by "
                         f"num_attention_heads={num_attention_heads}")
    if num_query_groups < 1 or num_attention_heads % num_query_groups:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by "
                         f"num_query_groups={num_query_groups}")
    if num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by "
                         f"tensor-parallel size tp={tp}")
    if num_query_groups % tp:
        raise ValueError(f"num_query_groups={num_query_groups} is not divisible by "
                         f"tensor-parallel size tp={tp}")


def check_attention_inputs(cp_size: int, inference_context, batch_seq: tuple,
                           position_ids, document_ids) -> None:
    """An attention layer's forward inputs, before any collective: no KV cache under context
    parallelism, position / document ids of shape (b, s) (s the whole sequence)."""
    if inference_context is not None and cp_size > 1:
        raise ValueError(f"inference_context with context_parallel_size={cp_size}: the "
                         "KV cache holds whole sequences; generate with cp = 1")
    for name, ids in (("position_ids", position_ids), ("document_ids", document_ids)):
        if ids is not None and tuple(ids.shape) != tuple(batch_seq):
            raise ValueError(f"{name} shape {tuple(ids.shape)} != (b, s) = {tuple(batch_seq)}")


def check_context_parallel_layer(cp_size: int, comm_type: str, heads_local: int,
                                 groups_local: int, attention_dropout: float,
                                 window_size: int | None) -> None:
    """ValueError naming the values for settings context-parallel attention cannot take."""
    if window_size is not None and (not is_int(window_size) or window_size < 1):
        raise ValueError(f"window_size={window_size!r} must be a positive int (positions a query "
                         "sees, its own included) or None")
    if cp_size == 1:
        return
    check_context_parallel_heads(comm_type, heads_local, groups_local, cp_size)


class ParallelAttention(nn.Module):
    def __init__(self, hidden_size: int, num_attention_heads: int, *,
                 num_query_groups: int | None = None, add_bias_linear: bool = True,
                 attention_dropout: float = 0.0, position_embedding_type: str = "learned_absolute",
                 rotary_base: float = 10000, sequence_parallel: bool = False,
                 init_method_std: float = 0.02, output_layer_init_std: float | None = None,
                 params_dtype: torch.dtype = torch.float32, recompute_core_attention: bool = False,
                 group=None, state=None, window_size: int | None = None,
                 cp_comm_type: str = "p2p", cp_group=None, layer_number: int = 1,
                 add_qkv_bias: bool = False, qk_layernorm: bool = False,
                 normalization: str = "LayerNorm", layernorm_epsilon: float = 1e-5,
                 kv_channels: int | None = None):
        super().__init__()
        self.layer_number = layer_number
        self.tp = resolve_tp_group(group, state)
        self.cp = resolve_cp_group(cp_group, state, group)
        self.recompute_core_attention = recompute_core_attention
        groups = num_query_groups or num_attention_heads
        check_heads(hidden_size, num_attention_heads, groups, self.tp.size)
        self.window_size, self.cp_comm_type = window_size, canonical_comm_type(cp_comm_type)
        check_context_parallel_layer(self.cp.size, self.cp_comm_type,
                                     num_attention_heads // self.tp.size, groups // self.tp.size,
                                     attention_dropout, window_size)
        if position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding_type must be one of {POSITION_EMBEDDINGS}, "
                             f"got {position_embedding_type!r}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.head_dim = kv_channels or hidden_size // num_attention_heads
        if position_embedding_type == "rope" and self.head_dim % 2 and kv_channels is None:
            raise ValueError(f"rope needs an even head dim, got hidden_size/num_attention_heads="
                             f"{self.head_dim}")
        if position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got kv_channels={self.head_dim}")
        self.heads_local = num_attention_heads // self.tp.size
        self.groups_local = groups // self.tp.size
        self.heads_per_group = num_attention_heads // groups
        self.sequence_parallel, self.attention_dropout = sequence_parallel, attention_dropout
        self.rope, self.rotary_base = position_embedding_type == "rope", rotary_base
        common = dict(bias=add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, group=self.tp.group)
        qkv_rows = (num_attention_heads + 2 * groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            hidden_size, qkv_rows, init_method=normal_init(init_method_std),
            **dict(common, bias=add_bias_linear or add_qkv_bias))
        self.linear_proj = RowParallelLinear(
            num_attention_heads * self.head_dim, hidden_size, input_is_parallel=True,
            skip_bias_add=True, init_method=normal_init(output_layer_init_std or init_method_std),
            **common)
        if qk_layernorm:
            head_norm = dict(normalization=normalization, eps=layernorm_epsilon,
                             params_dtype=params_dtype, group=self.tp.group, head_split=True)
            self.q_layernorm = Norm(self.head_dim, **head_norm)
            self.k_layernorm = Norm(self.head_dim, **head_norm)
        else:
            self.q_layernorm = self.k_layernorm = None

    def full_sequence_length(self, hidden_states: torch.Tensor) -> int:
        local = hidden_states.shape[0]
        return local * self.tp.size if self.sequence_parallel else local

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_context=None, rotary_pos_emb=None,
                document_ids: torch.Tensor | None = None, dropout_coordinates=None):
        seq, batch = self.full_sequence_length(hidden_states), hidden_states.shape[1]
        check_attention_inputs(self.cp.size, inference_context, (batch, seq), position_ids,
                               document_ids)                   # before the QKV all-gather
        batch_first = batch_first_attention(hidden_states, self.sequence_parallel, self.tp.size)
        if batch_first:
            hidden_states = hidden_states.transpose(0, 1)        # (b, s, h); a copy in the GEMM
                                                                 # unless rows are batch-major
        qkv = self.linear_qkv(hidden_states)                     # (s | b, b | s, (h_l + 2 g_l)·d)
        q, k, v = split_qkv(qkv, self.groups_local, self.heads_per_group, self.head_dim,
                            batch_first)                         # [b, heads | g_l, s, d] views
        if self.q_layernorm is not None:                         # per head over d, before rope
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        cos = sin = None
        if self.rope:
            if rotary_pos_emb is None:
                if position_ids is None:
                    position_ids = self.default_position_ids(batch, seq, hidden_states.device)
                rotary_pos_emb = rotary_cos_sin(position_ids, self.head_dim, self.rotary_base)
            cos, sin = rotary_pos_emb                            # (b, 1, s, d) each
        if inference_context is not None:
            q, k = self._rotate(q, k, cos, sin)
            context = self._cached_attention(q, k, v, inference_context)
        elif self.recompute_core_attention and self.training:
            context = checkpoint(self._core_attention, q, k, v, cos, sin,   # keeps q, k, v
                                 document_ids, dropout_coordinates)
        else:
            context = self._core_attention(q, k, v, cos, sin, document_ids, dropout_coordinates)
        width = self.heads_local * self.head_dim
        if batch_first:                                           # a view of the torch path's output
            output, bias = self.linear_proj(context.transpose(1, 2).reshape(batch, seq, width),
                                            fold_bias=True)      # (b, s, h)
            return output.transpose(0, 1), bias                  # (s, b, h) view
        context = context.permute(2, 0, 1, 3).reshape(seq, batch, width)
        return self.linear_proj(context, fold_bias=True)          # (s or s/tp, b, h), bias

    @staticmethod
    def _rotate(q, k, cos, sin):
        if cos is None:
            return q, k
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _core_attention(self, q, k, v, cos, sin, document_ids=None, dropout_coordinates=None):
        """Rotary (when cos/sin are given) and causal attention (within the window and the
        documents): [b, h_l, s, d] → [b, h_l, s, d] (the region ``core_attn`` recompute re-runs);
        context-parallel over the cp group when cp > 1 (s = this rank's s/cp tokens)."""
        q, k = self._rotate(q, k, cos, sin)
        dropout = self.attention_dropout if self.training else 0.0
        drop = self._attention_dropout(dropout, dropout_coordinates, q.shape[0])
        if self.cp.size > 1:
            if dropout > 0 and drop is None:
                raise ValueError("attention dropout under context parallelism needs the model's "
                                 "dropout_coordinates (global sample and positions of the tokens)")
            return context_parallel_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), self.cp, self.cp_comm_type,
                window_size=self.window_size, document_ids=document_ids, dropout=drop)
        flash_dims = FLASH_HEAD_DIMS[0] <= self.head_dim <= FLASH_HEAD_DIMS[1]
        if drop is not None and flash_dims:         # the kernels draw the mask per tile
            return _deps.flash_attention(q, k, v, causal=True, window_size=self.window_size,
                                         q_document_ids=document_ids,
                                         k_document_ids=document_ids, dropout=drop)
        if dropout > 0 or not flash_dims:
            return self._explicit_attention(q, k, v, dropout, q_document_ids=document_ids,
                                            k_document_ids=document_ids, drop=drop)
        return _deps.flash_attention(q, k, v, causal=True,   # strided views in and out
                                     window_size=self.window_size, q_document_ids=document_ids,
                                     k_document_ids=document_ids)

    def _attention_dropout(self, p: float, coordinates, batch: int):
        """The kernels' ``AttentionDropout`` of this layer (None without dropout or coordinates):
        global sample ``first_sample + i``, global head ``tp_rank · h_l + j``; the attention
        calls' offsets are the tokens' global positions (cp = 1: 0..s−1; cp > 1: the chunks')."""
        if p == 0 or coordinates is None:
            return None
        key = _deps.dropout_key(coordinates.seed, dropout_site(self.layer_number, ATTENTION_PROBS))
        return _deps.AttentionDropout(p, key, coordinates.first_sample,
                                      self.tp.rank * self.heads_local)

    def default_position_ids(self, batch: int, seq: int, device) -> torch.Tensor:
        """``(b, s)`` positions of the local tokens: 0..s−1, or under context parallelism the
        global positions of this rank's two chunks."""
        if self.cp.size == 1:
            return default_position_ids(batch, seq, device)
        index = local_token_index(seq * self.cp.size, self.cp.size, self.cp.rank, device)
        return index.expand(batch, seq)

    def _cached_attention(self, q, k, v, inference_context):
        """Append k/v [b, g_l, s, d] to the KV cache; q [b, h_l, s, d] attends over the cache.

        flash_attention with ``q_offset`` = tokens already cached (a decode step: s_q = 1 over
        s_k = offset + 1 keys) and the context's document ids — the Triton kernel on a GPU, reading
        the cache's strided views in place; the explicit path for head dims the kernel does not take."""
        offset = inference_context.sequence_len_offset
        keys, values = inference_context.update_kv_cache(self, k, v)   # [b, g_l, offset + s, d]
        q_ids, k_ids = inference_context.document_ids(offset, q.shape[2])
        if FLASH_HEAD_DIMS[0] <= self.head_dim <= FLASH_HEAD_DIMS[1]:
            return _deps.flash_attention(q, keys, values, causal=True, q_offset=offset,
                                         window_size=self.window_size,
                                         q_document_ids=q_ids, k_document_ids=k_ids)
        return self._explicit_attention(q, keys, values, 0.0, q_offset=offset,
                                        q_document_ids=q_ids, k_document_ids=k_ids)

    def _explicit_attention(self, q, k, v, dropout: float, q_offset: int = 0,
                            q_document_ids=None, k_document_ids=None, drop=None):
        """softmax(q kᵀ/√d + mask) → dropout (TP stream) → @ v, in fp32 (flash has no dropout):
        the kernels' explicit path (``kernels.flash_attention_reference.explicit_probs``).

        q [b, h_l, s_q, d], k/v [b, g_l, s_k, d]; query i sits at position q_offset + i, key j
        at j; masked: key_pos > query_pos, keys outside the sliding window (query_pos − key_pos
        ≥ window_size), and keys of another document ((b, s_q) / (b, s_k) ids, when given)."""
        mask = _deps.AttentionMask(causal=True, window_size=self.window_size,
                                   q_document_ids=q_document_ids, k_document_ids=k_document_ids,
                                   q_offset=q_offset)
        visible = mask.visible(q.shape[2], k.shape[2], q.device)                # (b | 1, 1, s_q, s_k)
        probs, _ = _deps.explicit_probs(q, k, 1.0 / math.sqrt(self.head_dim), visible)
        if drop is not None:                         # layout-invariant: global coordinates
            b, h, s_q, s_k = probs.shape
            probs = probs * drop.factor(b, h, s_q, s_k, q_offset, 0, probs.device, probs.dtype)
        elif dropout > 0:
            with get_rng_tracker().fork():
                probs = F.dropout(probs, dropout, training=True)
        return (probs @ _deps.repeat_kv(v, self.heads_per_group, probs.dtype)).to(q.dtype)
