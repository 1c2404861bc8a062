"""Muon on the 2-D hidden weights: momentum, Newton–Schulz orthogonalisation of the whole matrix,
decoupled weight decay (torch.optim.Muon's update, Megatron's ``--muon-*`` settings).

Which parameters (``is_muon_matrix``; Megatron's ``get_megatron_muon_optimizer`` and the Muon
paper): every 2-D weight of a linear map inside the transformer layers (the fused QKV, the
attention output projection, both MLP linears, a MoE router, the (1, h) shared-expert gate) is
Muon's; AdamW keeps the rest: the word and position embeddings, the output layer
(``is_embedding_or_output_parameter``), norm weights, every bias (the stacked (E, n) expert biases
included), and the 3-D stacked MoE expert weights (E matrices in one tensor, not one matrix:
AdamW, not orthogonalised as a whole).

One step on a matrix W with reduced, unscaled and clipped gradient G (μ ``--muon-momentum``, lr
and weight decay λ those of AdamW's decayed group; torch.optim.Muon's order and rounding)::

    B ← B.lerp(G, 1 − μ)                          (B = μ B + (1 − μ) G, fp32, this rank's elements)
    U ← G.lerp(B, μ) with --muon-use-nesterov, else B
    O ← NS_k(U) · scale(m, n) · --muon-extra-scale-factor          (per QKV part, see below)
    W ← W · (1 − lr·λ) − lr · O

``NS_k`` is ``newton_schulz``: X ← U / max(‖U‖_F, 1e-7) on the wider orientation (Xᵀ when m > n),
then k times X ← a X + (b A + c A²) X with A = X Xᵀ, with Megatron's quintic schedule of five
(a, b, c) (``QUINTIC_COEFFICIENTS``, repeated k / 5 times; torch.optim.Muon's default is one fixed
triple, ``SIMPLE_COEFFICIENTS``). ``--muon-fp32-matmul-prec medium`` runs it in bf16 as torch does
(U cast to bf16 before the norm), ``high`` in fp32 (TF32 GEMMs on a GPU). ``scale(m, n)``
(``--muon-scale-mode``): spectral √max(m, n), unit_rms_norm √(m/n), shape_scaling √max(1, m/n)
(= torch's default ``adjust_lr_fn``; torch's ``match_rms_adamw`` is spectral with an extra factor
of 0.2).

Fused QKV (``--muon-split-qkv``, the default): the weight's rows are, per query group g,
``[q heads of g; k_g; v_g]`` (``tp_layers/qkv_layout.py``); the q rows of all groups form one
matrix, the k rows one and the v rows one (Megatron's ``TensorParallelMuon.orthogonalize``), each
orthogonalised and scaled by its own shape, and put back in place. ``--muon-no-split-qkv``
orthogonalises the fused matrix.

The whole matrix. NS is not elementwise, so every rank assembles the matrix its layout cuts:

- data-parallel shards (``--use-distributed-optimizer``'s flat bucket shards, FSDP's dim-0 row
  blocks): each rank writes U on its own elements into a zero flat buffer of all Muon matrices of
  the group, and one all-reduce (sum) over that data-parallel group gives every rank every element
  exactly (each element is one rank's; the others add zeros);
- tensor-parallel shards with ``--muon-tp-mode duplicated``: one all-gather over the TP group, the
  shards concatenated along their partition dim. NS commutes with permutations of rows and of
  columns (P X Q gives (P X Q)(P X Q)ᵀ = P X Xᵀ Pᵀ, so every term of the polynomial is P (·) Q),
  so the rank-order concatenation (a row permutation of the master for swiglu's stride-2 fc1)
  gives the master's orthogonalised rows, and each rank keeps its own shard: tp > 1 equals one
  process. ``blockwise`` (Megatron's default) orthogonalises each TP shard as its own matrix
  (scaled by the shard's shape), as Megatron does; at tp = 1 the two are the same.

Then each rank applies the update to its own elements only. Optimizer state: one fp32 momentum
buffer B per element this rank updates (4 bytes, against AdamW's 8).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

QUINTIC_COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                        (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                        (2.8366, -3.0525, 1.2012))
SIMPLE_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),)
NS_EPS = 1e-7


@dataclass(frozen=True)
class MuonConfig:
    """Muon's settings (``--muon-*``; ``coefficients``: the (a, b, c) schedule, cycled)."""
    momentum: float = 0.9
    nesterov: bool = False
    split_qkv: bool = True
    scale_mode: str = "spectral"
    matmul_precision: str = "medium"
    num_ns_steps: int = 5
    tp_mode: str = "blockwise"
    extra_scale_factor: float = 1.0
    coefficients: tuple = QUINTIC_COEFFICIENTS

    @classmethod
    def from_settings(cls, optimizer) -> "MuonConfig":
        return cls(optimizer.muon_momentum, optimizer.muon_use_nesterov, optimizer.muon_split_qkv,
                   optimizer.muon_scale_mode, optimizer.muon_fp32_matmul_prec,
                   optimizer.muon_num_ns_steps, optimizer.muon_tp_mode,
                   optimizer.muon_extra_scale_factor)


def is_muon_matrix(name: str, param) -> bool:
    """Muon's parameters (module docstring): 2-D, not an embedding nor the output layer."""
    return (param.ndim == 2 and not name.rsplit(".", 1)[-1].startswith("bias")
            and not getattr(param, "is_embedding_or_output_parameter", False)
            and "position_embeddings" not in name)


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    return math.sqrt(max(1.0, rows / cols))                     # shape_scaling


@contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(matrix: torch.Tensor, coefficients, steps: int, bf16: bool) -> torch.Tensor:
    """NS_k(matrix) in fp32 (module docstring); bf16 GEMMs with ``bf16``."""
    x = matrix.bfloat16() if bf16 else matrix.float().clone()
    transpose = matrix.size(0) > matrix.size(1)
    if transpose:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for step in range(steps):
        a, b, c = coefficients[step % len(coefficients)]
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    if transpose:
        x = x.T
    return x.float()


@dataclass
class QkvLayout:
    """Rows per query group of a fused QKV weight: q (heads per group · d), k (d), v (d)."""
    heads_per_group: int
    head_dim: int

    def parts(self) -> list[int]:
        return [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim]


def qkv_layouts(model_chunks) -> dict:
    """{id(fused QKV weight): QkvLayout} of every attention with a ``linear_qkv``."""
    layouts = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            qkv = getattr(module, "linear_qkv", None)
            if qkv is not None and hasattr(module, "heads_per_group"):
                layouts[id(qkv.weight)] = QkvLayout(module.heads_per_group, module.head_dim)
    return layouts


class MuonUpdate:
    """Orthogonalised updates of the Muon matrices of one optimizer (module docstring).

    ``matrices``: [(model parameter, its piece on this rank or None, the data-parallel group its
    pieces are split over or None)] in ``model_params`` order, the same list on every rank of a
    group; ``state``: the ParallelState (TP group).
    """

    def __init__(self, config: MuonConfig, matrices, state, qkv: dict):
        self.config, self.matrices, self.state, self.qkv = config, matrices, state, qkv
        self.momentum = {id(piece.main): torch.zeros_like(piece.main)
                         for _, piece, _ in matrices if piece is not None}

    # ------------------------------------------------------------------ the whole matrix
    def _gather_data_parallel(self, directions: dict) -> dict:
        """{id(param): U of the whole TP-local matrix}, one all-reduce per data-parallel group."""
        whole, by_group = {}, {}
        for param, piece, group in self.matrices:
            if group is None:
                whole[id(param)] = directions[id(piece.main)].reshape(param.shape)
            else:
                by_group.setdefault(id(group), (group, []))[1].append((param, piece))
        for group, members in by_group.values():
            device = members[0][0].device
            flat = torch.zeros(sum(p.numel() for p, _ in members), dtype=torch.float32,
                               device=device)
            offset = 0
            for param, piece in members:
                if piece is not None:
                    flat[offset + piece.start:offset + piece.end] = \
                        directions[id(piece.main)].reshape(-1)
                offset += param.numel()
            dist.all_reduce(flat, group=group)
            offset = 0
            for param, _ in members:
                whole[id(param)] = flat[offset:offset + param.numel()].view(param.shape)
                offset += param.numel()
        return whole

    def _tp_sharded(self) -> list:
        if self.config.tp_mode != "duplicated" or self.state.tp_size == 1:
            return []
        return [param for param, _, _ in self.matrices
                if getattr(param, "tensor_model_parallel", False)]

    def _gather_tensor_parallel(self, whole: dict) -> None:
        """Replace each TP shard in ``whole`` by the full matrix (one all-gather)."""
        sharded = self._tp_sharded()
        if not sharded:
            return
        tp = self.state.tp_size
        flat = torch.cat([whole[id(p)].reshape(-1) for p in sharded])
        gathered = flat.new_empty(tp * flat.numel())
        dist.all_gather_into_tensor(gathered, flat, group=self.state.tp_group)
        per_rank = gathered.view(tp, flat.numel())
        offset = 0
        for param in sharded:
            numel = param.numel()
            shards = [per_rank[r, offset:offset + numel].view(param.shape) for r in range(tp)]
            whole[id(param)] = torch.cat(shards, dim=param.partition_dim)
            offset += numel

    # ------------------------------------------------------------------ orthogonalisation
    def _orthogonalised(self, matrix: torch.Tensor) -> torch.Tensor:
        config = self.config
        return newton_schulz(matrix, config.coefficients, config.num_ns_steps,
                             bf16=config.matmul_precision == "medium")

    def _scaled_orthogonal(self, param, matrix: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(O, s): the update is s · O (s kept apart for unsplit matrices: torch's rounding)."""
        mode, extra = self.config.scale_mode, self.config.extra_scale_factor
        layout = self.qkv.get(id(param)) if self.config.split_qkv else None
        if layout is None:
            rows, cols = matrix.shape
            return self._orthogonalised(matrix), scale_factor(rows, cols, mode) * extra
        parts = layout.parts()
        groups = matrix.shape[0] // sum(parts)
        pieces = torch.split(matrix.view(groups, sum(parts), -1), parts, dim=1)
        scaled = []
        for part in pieces:
            flat = part.reshape(-1, matrix.shape[1])
            ortho = self._orthogonalised(flat) * scale_factor(*flat.shape, mode)
            scaled.append(ortho.view(groups, -1, matrix.shape[1]))
        return torch.cat(scaled, dim=1).view(matrix.shape), extra

    def _own_shard(self, param, full: torch.Tensor) -> torch.Tensor:
        if full.shape == param.shape:
            return full
        return full.chunk(self.state.tp_size, dim=param.partition_dim)[self.state.tp_rank]

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, lr: float, weight_decay: float) -> None:
        """Momentum, orthogonalisation and update of every Muon piece (``piece.main.grad`` set)."""
        config, directions = self.config, {}
        for _, piece, _ in self.matrices:
            if piece is None:
                continue
            grad, buffer = piece.main.grad, self.momentum[id(piece.main)]
            buffer.lerp_(grad, 1 - config.momentum)
            directions[id(piece.main)] = grad.lerp(buffer, config.momentum) \
                if config.nesterov else buffer
        whole = self._gather_data_parallel(directions)
        self._gather_tensor_parallel(whole)
        precision = "high" if config.matmul_precision == "high" else \
            torch.get_float32_matmul_precision()
        with _fp32_matmul_precision(precision):
            for param, piece, _ in self.matrices:
                if piece is None:
                    continue
                ortho, scale = self._scaled_orthogonal(param, whole[id(param)])
                update = self._own_shard(param, ortho).reshape(-1)[piece.start:piece.end]
                piece.main.mul_(1 - lr * weight_decay)
                piece.main.add_(update.view(piece.main.shape), alpha=-lr * scale)
