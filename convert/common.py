"""Pieces every architecture's conversion shares: the fused QKV layout, vocabulary padding, and a
checked view of a set of named tensors.

Fused QKV (Megatron's grouped layout, what ``ParallelAttention.linear_qkv`` holds): for each of
the ng query groups g, ``[q rows of g's nh/ng heads; k_g; v_g]`` (each head d rows), groups one
after another:

    q (nh·d, h) → (ng, nh/ng·d, h);  k, v (ng·d, h) → (ng, d, h)
    qkv = cat([q, k, v], dim=1) → ((nh + 2·ng)·d, h)        (biases the same without the h)

so a contiguous TP split hands each rank whole groups. ``split_qkv`` is its exact inverse.
"""
from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q / k / v weights (rows = heads·d) or biases → the grouped fused tensor."""
    tail = q.shape[1:]
    parts = [t.reshape(groups, -1, *tail) for t in (q, k, v)]      # (ng, rows per group, ...)
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """The grouped fused tensor → (q (nh·d, ...), k (ng·d, ...), v (ng·d, ...))."""
    tail = qkv.shape[1:]
    per_group = qkv.reshape(groups, -1, *tail)                      # (ng, (nh/ng + 2)·d, ...)
    q_rows = heads // groups * head_dim
    q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def pad_vocab(table: torch.Tensor, padded_size: int) -> torch.Tensor:
    """``(V, h)`` → ``(V_padded, h)`` with zero rows appended (never produced: generation masks
    ids ≥ V, and their logits are 0 for a tied table)."""
    padding = table.new_zeros(padded_size - table.shape[0], *table.shape[1:])
    return torch.cat([table, padding], dim=0)


def trim_vocab(table: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return table[:vocab_size].contiguous()


class TensorSet:
    """Named tensors taken one by one with their expected shapes; ``finish`` names leftovers.

    ``where`` names the source in errors (a directory); names matching ``ignored`` suffixes
    (buffers some checkpoints carry, e.g. causal-mask or rotary tables) are dropped."""

    def __init__(self, tensors: dict, where: str, ignored: tuple = ()):
        self.where = where
        self.tensors = {name: t for name, t in tensors.items()
                        if not any(name.endswith(suffix) for suffix in ignored)}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.where}: missing tensor {name!r} (expected shape "
                             f"{tuple(shape)})")
        tensor = self.tensors.pop(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(shape)}")
        return tensor

    def finish(self) -> None:
        if self.tensors:
            names = sorted(self.tensors)
            raise ValueError(f"{self.where}: {len(names)} unexpected tensors for this config, "
                             f"e.g. {names[:3]} (a checkpoint of another model?)")


def take_output_layer(source: TensorSet, params: dict, config, embedding_name: str) -> None:
    """``lm_head.weight`` → ``output_layer.weight`` when untied; a tied model's saved copy (some
    checkpoints keep one) must equal the embedding ``embedding_name``."""
    shape = (config.vocab_size, config.hidden_size)
    if config.untie_embeddings_and_output_weights:
        params["output_layer.weight"] = source.take("lm_head.weight", shape)
    elif source.has("lm_head.weight") and not source.take("lm_head.weight", shape).equal(
            params["embedding.word_embeddings.weight"]):
        raise ValueError(f"{source.where}: lm_head.weight differs from {embedding_name} although "
                         "tie_word_embeddings is true")


def plain_topk_router_needs(c) -> list:
    """What both HF MoE families (Mixtral, Qwen2-MoE) route by, as ``(field, holds, needed)``
    rows: softmax scores, no capacity, no group-limited routing, no top-k scaling, no linear
    biases."""
    return [("moe_router_score_function", c.moe_router_score_function == "softmax", "softmax"),
            ("moe_expert_capacity_factor", c.moe_expert_capacity_factor is None, "None"),
            ("moe_router_num_groups", c.moe_router_num_groups is None, "None"),
            ("moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor is None,
             "None"),
            ("add_bias_linear", not c.add_bias_linear, "False")]


def unmet(c, needs: list) -> list:
    """``"field=value (needs needed)"`` for each ``(field, holds, needed)`` row that does not
    hold."""
    return [f"{name}={getattr(c, name)} (needs {needed})" for name, holds, needed in needs
            if not holds]
