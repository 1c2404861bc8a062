"""The optimizer over FSDP's shards: AdamW (SGD, Muon) on each rank's rows of every sharded
parameter (Muon assembles each whole matrix over the mesh group first, ``training/muon.py``).

With ``--use-torch-fsdp2`` the fp32 sharded parameters FSDP keeps (``param._local_tensor``, rows
``[lo, hi)`` of the TP shard, ``training/fsdp.py``) *are* the main parameters: the update writes
them in place and FSDP gathers them (cast to the compute dtype) in the next forward, so there is
no separate main copy and nothing to copy back or all-gather after the step. The gradient of a
piece is the sharded fp32 gradient FSDP reduce-scattered (``param.grad._local_tensor``).

A piece is the flat range ``[lo·r, hi·r)`` of the TP shard flattened (r elements per row), the
form ``MixedPrecisionOptimizer.state_dict`` saves for the distributed optimizer, so checkpoints
reshard between FSDP, the distributed optimizer and plain data parallelism through the same path
(``checkpoint/reshard.py``).

Global norm: every rank counts its own shard (disjoint rows over the dp·cp mesh; an expert
parameter over edp), a TP-replicated parameter on TP rank 0 only, never the last stage's copy of
the tied embedding (``training/grad_norm.py``): each element of the model is counted once.
"""
from __future__ import annotations

import math

import torch

from .data_parallel import is_expert
from .fsdp import padded_shard_numel, shard_rows
from .grad_norm import counted_on_this_rank
from .optimizer import MixedPrecisionOptimizer, Piece


class ShardPiece(Piece):
    """A piece whose ``main`` is the model's own fp32 shard (FSDP's local tensor)."""

    def __post_init__(self):
        self.separate_main = False

    def model_view(self) -> torch.Tensor:
        return self.main

    def grad_view(self) -> torch.Tensor:
        grad = self.model_param.grad
        if grad is None:
            return torch.zeros_like(self.main)
        return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def _rows_range(param, fsdp) -> tuple[int, int]:
    """The flat range of ``param``'s TP shard that this rank's FSDP shard holds."""
    rank, size = fsdp.mesh_rank_and_size(param)
    shape = tuple(param.shape)
    per_row = math.prod(shape[1:])
    lo, hi = shard_rows(shape[0], size, rank)
    return lo * per_row, hi * per_row


class FullyShardedOptimizer(MixedPrecisionOptimizer):
    """``MixedPrecisionOptimizer`` whose pieces are this rank's FSDP shards (module docstring);
    ``buffers`` is the ``FullyShardedModel``."""

    def __init__(self, model_chunks, fsdp, state, **kwargs):
        super().__init__(model_chunks, fsdp, state, **kwargs)
        self.fsdp = fsdp
        self.sharding_strategy = fsdp.config.strategy

    def _build_pieces(self, fsdp, state) -> list:
        pieces = []
        for position, param in enumerate(self.model_params):
            sharded = fsdp.is_sharded(param)
            local = param._local_tensor if sharded else param.data
            start, end = _rows_range(param, fsdp) if sharded else (0, param.numel())
            if local.numel() != end - start:
                raise ValueError(f"FSDP shard of a {tuple(param.shape)} parameter holds "
                                 f"{local.numel()} elements, the row split says {end - start}")
            if start == end:
                continue                           # fewer rows than ranks: this one holds none
            pieces.append(ShardPiece(param, position, start, end, local,
                                     counted_on_this_rank(param, state, sharded=sharded),
                                     is_expert(param)))
        return pieces

    def _build_grad_views(self) -> list:
        return []                                  # FSDP makes new sharded gradients each step

    def _shard_group(self, param):
        """The mesh group FSDP cuts ``param``'s rows over (None: unsharded, whole on each)."""
        return param.fsdp_group if self.buffers.is_sharded(param) else None

    def _main_grads(self) -> list:
        grads = []
        for piece in self.pieces:
            grad = piece.grad_view()
            piece.main.grad = grad if grad.dtype == torch.float32 else grad.float()
            grads.append(piece.main.grad)
        return grads

    def memory_bytes(self) -> dict:
        """Bytes this rank holds between steps: the padded fp32 shards of parameters and
        gradients (``fsdp.padded_shard_numel``), the optimizer state of the unpadded shard."""
        parameters = 0
        for param in self.model_params:
            _, size = self.fsdp.mesh_rank_and_size(param)
            parameters += padded_shard_numel(tuple(param.shape), size) * 4
        return {"parameters": parameters, "main_parameters": 0, "gradients": parameters,
                "optimizer_state": self.state_bytes()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The distributed optimizer's form; with 16-bit compute each piece also carries its fp32
        shard as ``main_param`` (what a layout with separate main copies restores them from)."""
        state = super().state_dict()
        if self.fsdp.config.compute_dtype != torch.float32:
            for piece in self.pieces:
                state["params"][piece.position]["main_param"] = piece.main.reshape(-1)
        return state

    @torch.no_grad()
    def load_piece(self, piece, entry: dict | None) -> None:
        """Moments and step as the base class; the fp32 shard from ``main_param`` when the entry
        has one (a 16-bit checkpoint's master copy), else it keeps the loaded model weights."""
        super().load_piece(piece, entry)
        source = entry.get("main_param")
        if source is not None:
            piece.main.copy_(source.view(piece.main.shape))
