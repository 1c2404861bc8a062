"""Tensor-parallel layers: drop-in nn.Modules over a TP process group (sequence-first ``[s, b, h]``).

``ColumnParallelLinear`` / ``RowParallelLinear`` (linear.py), ``VocabParallelEmbedding``
(embedding.py), ``vocab_parallel_cross_entropy`` (loss.py), ``Norm`` (norm.py), ``ParallelAttention``
(attention.py), ``ParallelMLP`` (mlp.py), ``TransformerLayer`` (transformer_layer.py); the RNG tracker
lives in ``tpfuse.tp_layers.random``, master-weight slicing in ``tpfuse.tp_layers.init``.
"""
from .attention import ParallelAttention
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import vocab_parallel_cross_entropy
from .mlp import ParallelMLP
from .norm import Norm
from .random import get_rng_tracker, model_parallel_seed
from .transformer_layer import TransformerLayer

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "Norm", "ParallelAttention", "ParallelMLP",
    "TransformerLayer", "get_rng_tracker", "model_parallel_seed",
]
