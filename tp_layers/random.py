"""The model-parallel RNG tracker: which random stream a dropout draws from.

Megatron-core's tracker, by name and state format (``CudaRNGStatesTracker``,
``get_cuda_rng_tracker``; ``get_states()`` → ``{stream name: generator state ByteTensor}``, so a
Megatron checkpoint's ``rng_tracker_states`` can be restored with ``set_states``). Three streams
are seeded by ``model_parallel_seed(seed)`` (Megatron's ``model_parallel_cuda_manual_seed``):

- ``"data-parallel-rng"``: ``seed`` — the same on every rank of a model replica;
- ``"model-parallel-rng"``: ``seed + 2718 + tp_rank`` — different on every TP rank. Dropout on
  *partitioned* activations (attention probabilities of this rank's heads, the sequence chunk
  under sequence parallelism) draws here inside ``get_rng_tracker().fork()``, so different heads
  / tokens get independent masks;
- ``"expert-parallel-rng"``: ``seed + 1024 + 100·ep_rank + etp_rank`` — per expert shard.

Torch's default generators are never re-seeded here: seed them yourself (``torch.manual_seed``;
the trainer does). Dropout on *replicated* activations (between layers without sequence
parallelism) draws from the default generator, so every TP rank that seeded it alike drops the
same elements.

``fork(name)`` swaps the stream into torch's default CPU generator (and the current CUDA device's
generator once CUDA is initialised), so anything that draws from the default generator inside the
block — ``torch.nn.functional.dropout``, or the seed ``kernels.bias_dropout_add`` takes from the
CPU generator — uses the tracked stream; on exit the stream's state is saved and the previous
state restored. A fork inside a fork first saves the outer stream's progress and, on leaving, puts
the outer stream back as saved (``CudaRNGStatesTracker``). A stream's state in ``get_states()``
is its CUDA generator state when it has one (Megatron's format) plus its CPU state under
``"<name>/cpu"``, else its CPU generator state.

GPT models do not draw their dropout masks from these streams: each mask is a function of the
seed, the layer and the element's global coordinates (``DropoutCoordinates`` below, Philox in
``kernels/philox.py``), so every layout draws the single process's masks. The tracker remains
for layers used on their own (no coordinates given) and for Megatron-style code.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


from tpfuse.parallel.state import resolve_state_or_none

from ._deps import RowCoordinates, dropout_key, hidden_keep_mask
from ._group import resolve_tp_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
TP_SEED_OFFSET = 2718
EXPERT_SEED_OFFSET = 1024
CPU_SUFFIX = "/cpu"
_CPU_STATE_NUMEL = torch.get_rng_state().numel()


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class CudaRNGStatesTracker:
    """Named generator streams (CPU, and CUDA once in use) that ``fork`` swaps in and out.

    ``fork`` nests: entering a stream while another is forked first saves the outer stream's
    progress (the default generators' state of that moment), and leaving puts the outer stream
    back from its saved — possibly since advanced — state, so ``fork(a)`` inside ``fork(b)``
    inside ``fork(a)`` draws a's numbers in sequence. Leaving the outermost fork restores the
    default generators as they were on entering it. The steps a subclass may change: how a
    stream is added (``_add_stream``), found (``_has_stream``), checked before forking
    (``_check_forkable``), saved from and loaded into the default generators
    (``_save_stream`` / ``_load_stream``), and the errors' texts."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.seeds_: dict[str, int] = {}
        self.cpu_states_: dict[str, torch.Tensor] = {}
        self.cuda_states_: dict[str, torch.Tensor] = {}
        self._current_fork: tuple[str, bool] | None = None   # (stream, its fork uses CUDA)

    @property
    def current_stream_(self) -> str | None:
        """The stream of the innermost fork in progress, None outside every fork."""
        return None if self._current_fork is None else self._current_fork[0]

    def is_initialized(self, name: str | None = None) -> bool:
        """Megatron's form (no name): were streams added or set; with a name: does it exist."""
        return self._is_initialized if name is None else name in self.cpu_states_

    def add(self, name: str, seed: int) -> None:
        if self._has_stream(name):
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first")
        if seed in self.seeds_.values():
            raise ValueError(f"seed {seed} already exists (each stream needs its own seed)")
        self._is_initialized = True
        self.seeds_[name] = seed
        self._add_stream(name, seed)

    def _add_stream(self, name: str, seed: int) -> None:
        """Stream ``name`` at the start of generator seeded with ``seed``."""
        self.cpu_states_[name] = torch.Generator().manual_seed(seed).get_state()
        if _cuda_in_use():
            self.cuda_states_[name] = self._fresh_cuda_state(seed)

    def _has_stream(self, name: str) -> bool:
        return name in self.cpu_states_

    @staticmethod
    def _fresh_cuda_state(seed: int) -> torch.Tensor:
        gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}")
        return gen.manual_seed(seed).get_state()

    @staticmethod
    def _is_generator_state(value) -> bool:
        """A generator's state: a uint8 tensor (what ``torch.Generator.get_state`` returns)."""
        return isinstance(value, torch.Tensor) and value.dtype == torch.uint8

    def get_states(self) -> dict:
        """A copy of every stream in Megatron's format (see the module docstring)."""
        states = {}
        for name, cpu in self.cpu_states_.items():
            if name in self.cuda_states_:
                states[name] = self.cuda_states_[name].clone()
                states[name + CPU_SUFFIX] = cpu.clone()
            else:
                states[name] = cpu.clone()
        return states

    def set_states(self, states: dict) -> None:
        """Restore streams from ``get_states()`` — tpfuse's or a Megatron checkpoint's."""
        cpu, cuda = {}, {}
        for name, value in states.items():
            if not self._is_generator_state(value):
                raise ValueError(f"RNG state {name!r} must be a uint8 generator state tensor, "
                                 f"got {type(value).__name__}")
            if name.endswith(CPU_SUFFIX):
                cpu[name[:-len(CPU_SUFFIX)]] = value.clone()
            elif value.numel() == _CPU_STATE_NUMEL:
                cpu[name] = value.clone()
            else:
                cuda[name] = value.clone()
        for name in cuda:
            if name not in cpu:   # a Megatron checkpoint: no CPU side, keep the current one
                if name not in self.cpu_states_:
                    raise ValueError(f"RNG state {name!r} holds only a CUDA generator state; "
                                     "seed the tracker (model_parallel_seed) before restoring it")
                cpu[name] = self.cpu_states_[name]
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"RNG states {sorted(cuda)} are CUDA generator states; this process "
                             "has no CUDA device to restore them on")
        self.cpu_states_, self.cuda_states_ = cpu, cuda
        self._is_initialized = True

    # ------------------------------------------------------------------ forking
    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from the tracked stream ``name`` inside the block (nesting: class docstring)."""
        self._check_forkable(name)
        use_cuda = _cuda_in_use()
        outer, entered = self._current_fork, _default_generator_states(use_cuda)
        if outer is not None:
            self._save_stream(*outer)
        self._load_stream(name, use_cuda)
        self._current_fork = (name, use_cuda)
        try:
            yield
        finally:
            self._save_stream(name, use_cuda)
            self._current_fork = outer
            _set_default_generator_states(*entered)
            if outer is not None and self._has_stream(outer[0]):
                self._load_stream(*outer)

    def _check_forkable(self, name) -> None:
        if not self._has_stream(name):
            raise self._missing_stream_error(name)

    def _missing_stream_error(self, name) -> Exception:
        return RuntimeError(
            f"RNG state {name!r} is not set: call tpfuse.tp_layers.random.model_parallel_seed"
            "(seed) before running dropout inside tensor- or sequence-parallel regions")

    def _unknown_seed_error(self, name) -> Exception:
        return RuntimeError(f"RNG state {name!r} was restored without a CUDA state and "
                            "its seed is unknown; call model_parallel_seed first")

    def _save_stream(self, name, use_cuda: bool) -> None:
        """The default generators' state of now is stream ``name``'s progress."""
        self.cpu_states_[name] = torch.get_rng_state()
        if use_cuda:
            self.cuda_states_[name] = torch.cuda.get_rng_state()

    def _load_stream(self, name, use_cuda: bool) -> None:
        """Put stream ``name`` into the default generators (its CUDA state seeded now when
        CUDA was initialised after the stream was added)."""
        if use_cuda and name not in self.cuda_states_:
            if name not in self.seeds_:
                raise self._unknown_seed_error(name)
            self.cuda_states_[name] = self._fresh_cuda_state(self.seeds_[name])
        torch.set_rng_state(self.cpu_states_[name])
        if use_cuda:
            torch.cuda.set_rng_state(self.cuda_states_[name])


def _default_generator_states(use_cuda: bool) -> tuple:
    """(CPU default generator state, current CUDA generator state or None)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if use_cuda else None


def _set_default_generator_states(cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


RNGStatesTracker = CudaRNGStatesTracker   # tpfuse's earlier name
_TRACKER = CudaRNGStatesTracker()


def get_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(seed: int, state=None, group=None, *, ep_rank: int | None = None,
                        etp_rank: int | None = None) -> None:
    """(Re)seed the tracker's three streams (module docstring); the default generators are left
    untouched. Ranks come from ``state`` (default: the default ParallelState) or ``group`` (the
    TP group; then ep_rank 0 and etp_rank = tp_rank unless given)."""
    tp = resolve_tp_group(group, state)
    if state is None and group is None:
        state = resolve_state_or_none()
    if ep_rank is None:
        ep_rank = state.ep_rank if state is not None else 0
    if etp_rank is None:
        etp_rank = state.etp_rank if state is not None else tp.rank
    _TRACKER.reset()
    _TRACKER.add(DATA_PARALLEL_RNG, seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp.rank)
    _TRACKER.add(EXPERT_PARALLEL_RNG, seed + EXPERT_SEED_OFFSET + 100 * ep_rank + etp_rank)


def partitioned_region_rng(partitioned: bool):
    """``fork()`` when the activations are partitioned across TP ranks, else the default stream."""
    return _TRACKER.fork() if partitioned else contextlib.nullcontext()


# ----------------------------------------------------------------------------- layout-invariant
# Dropout masks as pure functions of global coordinates (``kernels/philox.py``): the model
# builds one ``DropoutCoordinates`` per micro-batch forward and hands it to its embedding and
# layers; a layer derives each of its dropouts' coordinates from it. Nothing is drawn from a
# generator, so no tracker stream is involved and recompute (which re-runs the forward with the
# same coordinates) regenerates the same masks.

EMBEDDING_SITE = 0
ATTENTION_OUTPUT, MLP_OUTPUT, ATTENTION_PROBS = 1, 2, 3
SITES_PER_LAYER = 4


def dropout_site(layer_number: int, kind: int) -> int:
    """The Philox site of a dropout: 4 · (global layer number, from 1) + kind; the embedding's
    is 0."""
    return SITES_PER_LAYER * layer_number + kind


@dataclass(frozen=True)
class DropoutCoordinates:
    """Where a micro-batch sits in the global problem.

    ``seed``: the run's seed; ``first_sample``: the global index of the micro-batch's first
    sample (its position in the order the data sampler consumes samples, counted over every
    data-parallel rank); ``positions``: ``(s/cp,)`` global sequence positions of this rank's
    tokens (chunks r and 2·cp−1−r under context parallelism, else 0..s−1)."""
    seed: int
    first_sample: int
    positions: torch.Tensor

    def samples(self, batch: int, device=None) -> torch.Tensor:
        """``(b,)`` global sample indices of the micro-batch's rows."""
        return self.first_sample + torch.arange(batch, device=device)

    def rows(self, site: int, seq_local: int, batch: int, tp_rank: int = 0,
             sequence_parallel: bool = False) -> RowCoordinates:
        """Row coordinates of an ``(s_local, b, h)`` activation flattened to ``(s_local·b, h)``
        (row = token · b + sample): under sequence parallelism TP rank t holds tokens
        ``[t·s_local, (t+1)·s_local)`` of this rank's sequence."""
        start = tp_rank * seq_local if sequence_parallel else 0
        positions = self.positions[start:start + seq_local]
        if positions.shape[0] != seq_local:
            raise ValueError(f"DropoutCoordinates hold {self.positions.shape[0]} positions; an "
                             f"activation of {seq_local} tokens at offset {start} lies outside")
        samples = self.samples(batch, positions.device)
        return RowCoordinates(dropout_key(self.seed, site),
                              positions.repeat_interleave(batch), samples.repeat(seq_local))


def coordinate_dropout(x: torch.Tensor, p: float, coordinates: RowCoordinates) -> torch.Tensor:
    """``x ⊙ m / (1 − p)`` for x ``(..., H)`` with the layout-invariant mask of its rows."""
    keep = hidden_keep_mask(p, coordinates, x.shape[-1], x.device)
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p))).reshape(x.shape)
