"""VocabParallelEmbedding: the embedding table split by vocabulary rows over the TP group.

Rank r holds rows ``[r·V/tp, (r+1)·V/tp)`` of the master ``[V, h]`` table. Each rank looks up the
ids that fall in its range, writes zeros for the others, and the partial results are summed:

  forward   ``e = Σ_r mask_r(ids) · W_r[ids − start_r]``
            - without sequence parallelism: ids ``(...)`` → all-reduce → ``(..., h)`` on every rank
              (a drop-in for ``nn.Embedding``; GPT passes ``(b, s)`` and gets ``(b, s, h)``);
            - with ``sequence_parallel=True``: ids ``(b, s)`` → transpose to sequence-first and
              reduce-scatter over s → this rank's chunk ``(s/tp, b, h)`` (Megatron's
              ``reduce_scatter_embeddings``).
  wgrad     ``dW_r[i] = Σ_{tokens with id = start_r + i} de``  (local rows only)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _deps
from ._group import resolve_tp_group
from .init import check_partitionable, draw_master_weight, shard
from .linear import check_sequence_divisible


class VocabParallelEmbedding(nn.Module):
    """The table ``[V, h]`` split by rows over the TP group (``group``, else ``state.tp_group``,
    else the default state's); ``params_dtype`` None is fp32; ``master_weight`` (full ``[V, h]``)
    replaces the draw from ``init_method``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 sequence_parallel: bool = False, params_dtype: torch.dtype | None = None,
                 master_weight: torch.Tensor | None = None, group=None, state=None):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.tp = resolve_tp_group(group, state)
        sequence_parallel = bool(sequence_parallel)
        params_dtype = params_dtype or torch.float32
        check_partitionable(num_embeddings, self.tp.size, 1, "num_embeddings (vocab size)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.vocab_per_rank = num_embeddings // self.tp.size
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        if master_weight is None:
            master_weight = draw_master_weight(num_embeddings, embedding_dim, init_method, params_dtype)
        elif tuple(master_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"master_weight shape {tuple(master_weight.shape)} != "
                             f"{(num_embeddings, embedding_dim)}")
        weight = shard(master_weight.detach().to(params_dtype), 0, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(weight)  # (V/tp, h)
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim, self.weight.partition_stride = 0, 1

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """Shard an existing ``nn.Embedding`` (its table is the master; rows split over tp)."""
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"from_dense expects an nn.Embedding, got {type(embedding).__name__}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim,
                    params_dtype=kwargs.pop("params_dtype", embedding.weight.dtype),
                    master_weight=embedding.weight.detach().cpu(), **kwargs)
        return layer.to(embedding.weight.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp, group = self.tp.size, self.tp.group
        if self.sequence_parallel:
            if input_ids.dim() != 2:
                raise ValueError(f"sequence_parallel embedding expects ids (b, s), got shape "
                                 f"{tuple(input_ids.shape)}")
            check_sequence_divisible(input_ids.shape[1], tp)
        if tp == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.vocab_per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)   # (..., h)
            out = out.masked_fill(outside[..., None], 0.0)
        if not self.sequence_parallel:
            return out if tp == 1 else _deps.reduce_from_region(out, group)
        out = out.transpose(0, 1).contiguous()                              # (s, b, h) partial
        if tp == 1:
            return out
        return _deps.reduce_scatter_to_sequence_parallel_region(  # (s/tp, b, h)
            out, group, options=self.tp.options)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (tp={self.tp.size}), "
                f"sequence_parallel={self.sequence_parallel}")
