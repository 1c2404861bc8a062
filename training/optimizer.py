"""AdamW, SGD or Muon on fp32 main parameters (Megatron's MixedPrecisionOptimizer / FP32Optimizer
/ DistributedOptimizer, ``--optimizer``), with loss-scale handling, global-norm clipping and
non-finite detection.

What the optimizer steps on is a list of *pieces*: the elements ``[start, end)`` of one model
parameter (flattened) that this rank updates, each with

- ``main``: the fp32 main parameter of those elements: the model parameter itself (or a view of it)
  when that is fp32 already, else an fp32 copy that persists across steps (bf16/fp16 training);
- its gradient: the matching part of ``param.main_grad`` (fp32; upcast when gradients are reduced
  in 16 bits).

Without the distributed optimizer a piece is the whole parameter. With it (``--use-distributed-
optimizer``) the pieces are the parameters' intersections with this rank's shard of every bucket
(``training/grad_buffers.py``): main parameters and Adam moments exist for 1/dp of the elements.

One step (``step``)::

    grads  ← main_grad pieces (fp32)                     [the reduced gradients]
    grads  ← grads / loss_scale                          (fp16)
    ‖g‖    ← global norm (one all-reduce, one host sync; training/grad_norm.py)
    if ‖g‖ or the loss is inf/nan: skip (no update; the loss scale backs off)
    grads  ← grads · min(1, clip / (‖g‖ + 1e-6))
    AdamW on the main pieces (moments fp32), then model ← main (cast), and with the distributed
    optimizer the updated shards are all-gathered back into every rank's parameters.

AdamW is torch's fused implementation (``torch.optim.AdamW(fused=True)``: one vectorised kernel
over all pieces on CPU and GPU, as Megatron's fused Adam and torchtitan's default): the same update
as the per-tensor loop to fp32 rounding, without 8 ops per parameter per step.

Parameter groups follow Megatron: biases and 1-D parameters (norm weights) get no weight decay.

``--optimizer sgd``: torch.optim.SGD on every piece, as Megatron builds it (``momentum`` μ =
``--sgd-momentum``, no dampening, no Nesterov; weight decay λ the coupled L2 term of the decayed
group)::

    g ← g + λ θ;   B ← μ B + g;   θ ← θ − lr · B          (B: one fp32 buffer per element, μ > 0)

``--optimizer muon``: Muon on the 2-D hidden weights, AdamW (the settings above) on the rest;
``training/muon.py`` says which parameters go where and how the whole matrix is assembled from
TP / distributed-optimizer / FSDP shards. Both steps follow the same unscale, norm, clip.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .data_parallel import is_expert
from .grad_norm import counted_on_this_rank, global_norm_stats, norm_from_squares
from .muon import MuonConfig, MuonUpdate, is_muon_matrix, qkv_layouts

OPTIMIZER_FORMATS = {"adam": "tpfuse-mixed-precision-adamw", "sgd": "tpfuse-mixed-precision-sgd",
                     "muon": "tpfuse-mixed-precision-muon"}


@dataclass
class Piece:
    """Elements ``[start, end)`` of ``model_param.view(-1)`` updated on this rank."""
    model_param: torch.nn.Parameter
    position: int               # index of model_param in the optimizer's model_params
    start: int
    end: int
    main: torch.Tensor          # fp32 main parameter of these elements
    counted: bool               # in this rank's share of the global grad norm
    expert: bool
    separate_main: bool = field(init=False)   # main is an fp32 copy, not the parameter's memory

    def __post_init__(self):
        self.separate_main = self.main.untyped_storage().data_ptr() != \
            self.model_param.untyped_storage().data_ptr()

    def model_view(self) -> torch.Tensor:
        flat = self.model_param.data.view(-1)[self.start:self.end]
        return flat.view(self.main.shape)

    def grad_view(self) -> torch.Tensor:
        flat = self.model_param.main_grad.view(-1)[self.start:self.end]
        return flat.view(self.main.shape)


@dataclass
class StepResult:
    success: bool               # False: skipped (non-finite gradients or loss)
    grad_norm: float            # before clipping (inf / nan when skipped for that reason)
    loss_nonfinite: bool


def _main_for(view: torch.Tensor) -> torch.Tensor:
    return view if view.dtype == torch.float32 else view.detach().float().clone()


def _whole_pieces(params, state) -> list:
    pieces = []
    for position, param in enumerate(params):
        pieces.append(Piece(param, position, 0, param.numel(), _main_for(param.data),
                            counted_on_this_rank(param, state, sharded=False), is_expert(param)))
    return pieces


def _shard_pieces(params, buffers, state) -> list:
    """The parameters' intersections with this rank's shard of each bucket (flat pieces)."""
    pieces = []
    for position, param in enumerate(params):
        buffer = buffers.buffer_of(param)
        param_start, param_end = buffer.range_of[id(param)]
        shard_start, shard_end = buffers.bucket_of(param).shard_range(buffer.dp_rank)
        lo, hi = max(param_start, shard_start), min(param_end, shard_end)
        if lo >= hi:
            continue
        start, end = lo - param_start, hi - param_start
        main = _main_for(param.data.view(-1)[start:end])
        pieces.append(Piece(param, position, start, end, main,
                            counted_on_this_rank(param, state, sharded=True), is_expert(param)))
    return pieces


def decays(name: str, param) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norm weights)."""
    return not (param.ndim == 1 or name.endswith(".bias"))


class MixedPrecisionOptimizer:
    """AdamW (or SGD, or Muon with AdamW) over fp32 main pieces of ``buffers.params`` (see the
    module docstring).

    ``buffers``: the DataParallelBuffers of the model chunks (main_grad, shards, param gather);
    ``grad_scaler``: a training/grad_scaler.py scaler, or None; ``clip_grad``: 0 disables;
    ``optimizer``: adam, sgd or muon; ``sgd_momentum``; ``muon``: a MuonConfig (muon only).
    """

    def __init__(self, model_chunks, buffers, state, *, lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, clip_grad: float = 0.0,
                 grad_scaler=None, optimizer: str = "adam", sgd_momentum: float = 0.9,
                 muon: MuonConfig | None = None):
        if optimizer not in OPTIMIZER_FORMATS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZER_FORMATS)}, "
                             f"got {optimizer!r}")
        self.buffers, self.state, self.kind = buffers, state, optimizer
        self.model_params = buffers.params
        self.clip_grad, self.grad_scaler = clip_grad, grad_scaler
        self.distributed = buffers.config.use_distributed_optimizer
        self.pieces = self._build_pieces(buffers, state)
        names = {id(p): n for chunk in model_chunks for n, p in chunk.named_parameters()}
        muon_ids = {id(p) for p in self.model_params if optimizer == "muon"
                    and is_muon_matrix(names[id(p)], p)}
        elementwise = [p for p in self.pieces if id(p.model_param) not in muon_ids]
        decay = [p.main for p in elementwise if decays(names[id(p.model_param)], p.model_param)]
        no_decay = [p.main for p in elementwise
                    if not decays(names[id(p.model_param)], p.model_param)]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if optimizer == "sgd":
            self.adam = torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum,
                                        weight_decay=weight_decay)
        else:
            self.adam = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                                          weight_decay=weight_decay, fused=True)
        self._init_adam_state()
        self.muon, self.muon_group = None, None
        if optimizer == "muon":
            self._build_muon(model_chunks, muon or MuonConfig(), muon_ids, lr, weight_decay)
        self._piece_of_main = {id(p.main): p for p in self.pieces}
        self._grad_views = self._build_grad_views()

    def _build_muon(self, model_chunks, config, muon_ids, lr, weight_decay) -> None:
        """Muon over the 2-D hidden weights' pieces (``training/muon.py``)."""
        piece_of = {id(p.model_param): p for p in self.pieces}
        matrices = [(param, piece_of.get(id(param)), self._shard_group(param))
                    for param in self.model_params if id(param) in muon_ids]
        self.muon = MuonUpdate(config, matrices, self.state, qkv_layouts(model_chunks))
        self.muon_group = {"params": [p.main for _, p, _ in matrices if p is not None],
                           "lr": lr, "weight_decay": weight_decay}

    def _shard_group(self, param):
        """The data-parallel group ``param``'s pieces are split over (None: whole on each)."""
        return self.buffers.buffer_of(param).group if self.distributed else None

    def _state_of(self, piece: Piece) -> dict:
        """The optimizer state tensors of one piece (Adam moments and step, SGD's or Muon's
        momentum buffer)."""
        if self.muon is not None and id(piece.main) in self.muon.momentum:
            return {"momentum_buffer": self.muon.momentum[id(piece.main)]}
        return self.adam.state[piece.main]

    def _build_pieces(self, buffers, state) -> list:
        """What this rank steps on: whole parameters, or the distributed optimizer's shards."""
        return (_shard_pieces(self.model_params, buffers, state) if self.distributed
                else _whole_pieces(self.model_params, state))

    def _build_grad_views(self) -> list:
        return [p.grad_view() for p in self.pieces]   # main_grad is persistent

    def _init_adam_state(self) -> None:
        """Allocate the moments now (torch allocates them at the first step): memory is known
        before training, and a checkpoint of a fresh run has every entry."""
        for group in self.adam.param_groups:
            for main in group["params"]:
                self.adam.state[main] = self._fresh_state(main)

    def _fresh_state(self, main: torch.Tensor) -> dict:
        zeros = torch.zeros_like(main, memory_format=torch.preserve_format)
        if self.kind == "sgd":          # μ·0 + g = g: torch's first-step clone, exactly
            return {"momentum_buffer": zeros} if self.adam.defaults["momentum"] else {}
        return {
            # on the parameter's device, where the fused kernel reads it
            "step": torch.zeros((), dtype=torch.float32, device=main.device),
            "exp_avg": zeros,
            "exp_avg_sq": torch.zeros_like(main, memory_format=torch.preserve_format)}

    @property
    def param_groups(self) -> list:
        """AdamW's (SGD's) groups, then Muon's (the lr scheduler sets ``lr`` on them)."""
        return self.adam.param_groups + ([self.muon_group] if self.muon is not None else [])

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    # ------------------------------------------------------------------ one step
    def _main_grads(self) -> list:
        grads = []
        for piece, grad in zip(self.pieces, self._grad_views):
            piece.main.grad = grad if grad.dtype == torch.float32 else grad.float()
            grads.append(piece.main.grad)
        return grads

    def _clear_grads(self) -> None:
        for piece in self.pieces:
            piece.main.grad = None

    def step(self, loss_nonfinite: torch.Tensor | None = None) -> StepResult:
        """Unscale, measure, clip and apply this step's reduced gradients (or skip them)."""
        grads = self._main_grads()
        if self.grad_scaler is not None and grads:
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
        device = grads[0].device if grads else self.model_params[0].device
        dense_sq, expert_sq, bad_loss = global_norm_stats(
            [p.main.grad for p in self.pieces if p.counted and not p.expert],
            [p.main.grad for p in self.pieces if p.counted and p.expert], loss_nonfinite, device)
        norm = norm_from_squares(dense_sq, expert_sq)
        found_inf = bad_loss or not norm < float("inf")          # inf, or nan
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            self._clear_grads()
            return StepResult(False, norm, bad_loss)
        if self.clip_grad > 0 and grads:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        self.adam.step()
        if self.muon is not None:
            self.muon.step(self.muon_group["lr"], self.muon_group["weight_decay"])
        self._clear_grads()
        self._copy_main_to_model()
        self.buffers.start_param_sync()
        return StepResult(True, norm, False)

    @torch.no_grad()
    def _copy_main_to_model(self) -> None:
        for piece in self.pieces:
            if piece.separate_main:
                piece.model_view().copy_(piece.main)

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> dict:
        """Bytes this rank holds for parameters, fp32 main copies, gradients and Adam state."""
        def nbytes(t):
            return t.numel() * t.element_size()
        if self.distributed:
            parameters = sum(nbytes(b.param_data) for b in self.buffers.buffers)
        else:
            parameters = sum(nbytes(p) for p in self.model_params)
        return {"parameters": parameters,
                "main_parameters": sum(nbytes(p.main) for p in self.pieces if p.separate_main),
                "gradients": sum(nbytes(b.grad_data) for b in self.buffers.buffers),
                "optimizer_state": self.state_bytes()}

    def state_bytes(self) -> int:
        """Bytes of the optimizer state (Adam moments, SGD / Muon momentum; not the step)."""
        return sum(t.numel() * t.element_size() for piece in self.pieces
                   for k, t in self._state_of(piece).items() if k != "step")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Per model parameter position: this rank's piece ``[start, end)`` with its flat fp32
        main copy (when separate), Adam moments and step (SGD's / Muon's momentum buffer); plus
        hyper-parameters and the scaler."""
        entries = [None] * len(self.model_params)
        for piece in self.pieces:
            entry = {"start": piece.start, "end": piece.end}
            for key, value in self._state_of(piece).items():
                entry[key] = value if key == "step" else value.reshape(-1)
            if piece.separate_main:
                entry["main_param"] = piece.main.reshape(-1)
            entries[piece.position] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"format": OPTIMIZER_FORMATS[self.kind], "params": entries,
                "param_groups": groups,
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()`` of the same layout and sharding (pieces must match):
        the main copies, moments, step and loss scaler; the hyper-parameters stay this run's."""
        if self.kind == "adam" and state.get("format") != "tpfuse-mixed-precision-adamw":
            raise ValueError("optimizer state is not a tpfuse mixed-precision AdamW state "
                             f"(format {state.get('format')!r})")
        if state.get("format") != OPTIMIZER_FORMATS[self.kind]:
            raise ValueError(f"optimizer state is not a tpfuse mixed-precision {self.kind} state "
                             f"(format {state.get('format')!r}); this run has --optimizer "
                             f"{self.kind}")
        if len(state["params"]) != len(self.model_params):
            raise ValueError(f"optimizer state has {len(state['params'])} parameters, this model "
                             f"{len(self.model_params)}")
        # the group hyper-parameters (weight decay, betas, eps; lr: the scheduler) stay this
        # run's: settings given to this run win over the checkpoint's (docs/checkpointing.md)
        for piece in self.pieces:
            self.load_piece(piece, state["params"][piece.position])
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def load_piece(self, piece: Piece, entry: dict | None) -> None:
        """Fill one piece's main copy and moments from a saved entry of the same range; main
        falls back to the (already loaded) model parameter when the entry has no fp32 copy."""
        if entry is None or (entry["start"], entry["end"]) != (piece.start, piece.end):
            saved = None if entry is None else (entry["start"], entry["end"])
            raise ValueError(f"optimizer state of parameter {piece.position} covers {saved}, this "
                             f"rank optimizes [{piece.start}, {piece.end}): saved with another "
                             f"sharding (load through the resharding path)")
        own = self._state_of(piece)
        missing = [key for key in own if entry.get(key) is None]
        if missing:
            raise ValueError(f"optimizer state of parameter {piece.position} has no "
                             f"{', '.join(missing)}: saved by another --optimizer than this "
                             f"run's {self.kind}")
        for key, tensor in own.items():
            if key == "step":
                own[key] = entry[key].to(piece.main.device, torch.float32, copy=True)
            else:
                tensor.copy_(entry[key].view(piece.main.shape))
        if piece.separate_main:
            source = entry.get("main_param")
            piece.main.copy_(source.view(piece.main.shape) if source is not None
                             else piece.model_view().float())
