"""The model-parallel RNG tracker: which random stream a dropout draws from.

Two streams exist on every rank:

- torch's *default* generator, seeded with ``seed`` — the same on every TP rank of a
  data-parallel replica. Dropout on *replicated* activations (the hidden states between layers
  without sequence parallelism) draws here, so every TP rank drops the same elements and the
  replicas stay identical.
- the tracker's ``"model-parallel-rng"`` stream, seeded with ``seed + 2718 + tp_rank`` — different
  on every TP rank. Dropout on *partitioned* activations (attention probabilities of this rank's
  heads, or the sequence chunk under sequence parallelism) draws here inside
  ``get_rng_tracker().fork()``, so different heads / tokens get independent masks.

``fork()`` swaps the stream into torch's default CPU generator (and the current CUDA device's
generator when CUDA is initialised), so anything that draws from the default generator inside the
block — ``torch.nn.functional.dropout``, or the seed ``kernels.bias_dropout_add`` takes from the CPU
generator — uses the tracked stream; on exit the tracked state is saved and the default restored.
Everything is reproducible from ``seed``.
"""
from __future__ import annotations

import contextlib

import torch

from ._group import resolve_tp_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named generator states (CPU, and CUDA when in use) that ``fork`` swaps in and out."""

    def __init__(self):
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def reset(self) -> None:
        self._states = {}

    def is_initialized(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first")
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if _cuda_in_use():
            gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}")
            cuda = gen.manual_seed(seed).get_state()
        self._states[name] = (cpu, cuda)

    def get_states(self) -> dict:
        """A copy of every tracked state (for checkpoints)."""
        return {k: (c.clone(), None if g is None else g.clone()) for k, (c, g) in self._states.items()}

    def set_states(self, states: dict) -> None:
        self._states = {k: (c.clone(), None if g is None else g.clone()) for k, (c, g) in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from the tracked stream ``name`` inside the block."""
        if name not in self._states:
            raise RuntimeError(
                f"RNG state {name!r} is not set: call tpfuse.tp_layers.random.model_parallel_seed"
                "(seed) before running dropout inside tensor- or sequence-parallel regions")
        cpu_state, cuda_state = self._states[name]
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if cuda_state is not None else None
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
        try:
            yield
        finally:
            new_cuda = torch.cuda.get_rng_state() if cuda_state is not None else None
            self._states[name] = (torch.get_rng_state(), new_cuda)
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_seed(seed: int, state=None, group=None) -> None:
    """Seed the default generator with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``."""
    tp = resolve_tp_group(group, state)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp.rank)


def partitioned_region_rng(partitioned: bool):
    """``fork()`` when the activations are partitioned across TP ranks, else the default stream."""
    return _TRACKER.fork() if partitioned else contextlib.nullcontext()
