"""GPT input embedding: vocab-parallel word embedding + learned positions, dropout, [b, s] → [s, b].

    ids (b, s) ─VocabParallelEmbedding→ (s, b, h) all-reduced over TP (no SP: ids looked up as (s, b))
                                      or (s/tp, b, h) reduce-scattered over s (SP)
    positions (b, s) ─nn.Embedding (replicated on the TP ranks)→ (s, b, h), or (s, 1, h) when
               every sequence has the default positions (broadcast in the sum)
               under SP split over s (``scatter_to_sequence_parallel_region``: forward split,
               backward all-gather, so every TP rank gets the full position-weight gradient)
    sum → dropout → (s[/tp], b, h)

With ``dropout_coordinates`` (what GPTModel passes) the dropout mask is the layout-invariant
one of (seed, site 0, global sample, global position, hidden index): ``tp_layers.random``.
Without, dropout on replicated activations draws from the default generator (same mask on every TP rank);
under sequence parallelism each rank holds different tokens and draws from the model-parallel
stream (Megatron's embedding dropout inside ``get_cuda_rng_tracker().fork()``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.parallel.mappings import scatter_to_sequence_parallel_region
from tpfuse.tp_layers import VocabParallelEmbedding
from tpfuse.tp_layers.init import draw_master_weight, normal_init
from tpfuse.tp_layers.random import EMBEDDING_SITE, coordinate_dropout, partitioned_region_rng


class GPTEmbedding(nn.Module):
    def __init__(self, config, word_master_weight, position_master_weight, state):
        super().__init__()
        self.config = config
        self.sequence_parallel = config.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, sequence_parallel=self.sequence_parallel,
            params_dtype=config.params_dtype, master_weight=word_master_weight, state=state)
        self.tp = self.word_embeddings.tp
        if position_master_weight is None:
            self.position_embeddings = None
        else:
            self.position_embeddings = nn.Embedding(
                *position_master_weight.shape,
                _weight=position_master_weight.detach().to(config.params_dtype).clone())
            weight = self.position_embeddings.weight
            weight.tensor_model_parallel = False
            weight.sequence_parallel = False      # its gradient is complete on every TP rank

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                dropout_coordinates=None, dropout_site: int = EMBEDDING_SITE) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = self.word_embeddings(input_ids)                  # (s/tp, b, h)
        else:                                        # ids looked up in (s, b) order: no transpose copy
            hidden = self.word_embeddings(input_ids.t())              # (s, b, h)
        if self.position_embeddings is not None:
            positions = self._positions(position_ids)                 # (s, b or 1, h)
            if self.sequence_parallel:
                positions = scatter_to_sequence_parallel_region(positions, self.tp.group)
            hidden = hidden + positions                # (s[/tp], b, h)
        hidden = hidden.contiguous()
        p = self.config.hidden_dropout
        if self.training and p > 0 and dropout_coordinates is not None:
            rows = dropout_coordinates.rows(dropout_site, hidden.shape[0], hidden.shape[1],
                                            self.tp.rank, self.sequence_parallel)
            hidden = coordinate_dropout(hidden, p, rows)
        elif self.training and p > 0:
            with partitioned_region_rng(self.sequence_parallel and self.tp.size > 1):
                hidden = F.dropout(hidden, p, training=True)
        return hidden

    def _positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Position embeddings ``(s, b, h)``, or ``(s, 1, h)`` broadcast over the batch when every
        sequence has the same positions as a stride-0 batch dim says (the default 0..s−1
        ``expand``): s rows looked up instead of b·s, and their gradient summed over b first."""
        if position_ids.shape[0] > 1 and position_ids.stride(0) == 0:
            return self.position_embeddings(position_ids[0])[:, None]
        return self.position_embeddings(position_ids.t())


def embedding_std(config) -> float:
    """The std of the word and learned position embeddings: ``embedding_init_method_std``, or
    ``init_method_std`` when it is None (Megatron's ``embedding_init_method``)."""
    if config.embedding_init_method_std is None:
        return config.init_method_std
    return config.embedding_init_method_std


def draw_vocab_master(config, std=None):
    """A full ``[V_padded, h]`` vocabulary master (fp32): the real ``vocab_size`` rows drawn from
    the current generator as N(0, std²) (None: ``init_method_std``, the untied output layer's),
    the padding rows zero. So the same seed gives the same model whatever the padding (which
    depends on tp); the padding rows are never read by the embedding, are masked out of the
    loss, get no gradient and so stay zero."""
    init = normal_init(config.init_method_std if std is None else std)
    real = draw_master_weight(config.vocab_size, config.hidden_size, init)
    padding = config.padded_vocab_size - config.vocab_size
    return F.pad(real, (0, 0, 0, padding))


def draw_word_master(config):
    """The full word-embedding master ``[V_padded, h]`` (fp32) from the current generator,
    N(0, embedding_std²) (a tied output layer shares it)."""
    return draw_vocab_master(config, embedding_std(config))


def draw_position_master(config):
    """The learned-position master ``[max_pos, h]`` (fp32) N(0, embedding_std²), or None for
    rope."""
    if config.position_embedding_type != "learned_absolute":
        return None
    init = normal_init(embedding_std(config))
    return draw_master_weight(config.max_position_embeddings, config.hidden_size, init)
