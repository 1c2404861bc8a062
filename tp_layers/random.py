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
    """Named generator streams (CPU, and CUDA once in use) that ``fork`` swaps in and out."""

    def __init__(self):
        self._states: dict[str, dict] = {}   # name -> {"seed", "cpu", "cuda" (None until used)}

    def reset(self) -> None:
        self._states = {}

    def is_initialized(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists; reset() the tracker first")
        self._states[name] = {"seed": seed, "cpu": torch.Generator().manual_seed(seed).get_state(),
                              "cuda": None}

    def get_states(self) -> dict:
        """A copy of every tracked stream (for checkpoints)."""
        return {name: _copy_state(st) for name, st in self._states.items()}

    def set_states(self, states: dict) -> None:
        self._states = {name: _copy_state(st) for name, st in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from the tracked stream ``name`` inside the block."""
        if name not in self._states:
            raise RuntimeError(
                f"RNG state {name!r} is not set: call tpfuse.tp_layers.random.model_parallel_seed"
                "(seed) before running dropout inside tensor- or sequence-parallel regions")
        stream = self._states[name]
        use_cuda = _cuda_in_use()
        if use_cuda and stream["cuda"] is None:  # CUDA initialised after seeding: start it now
            gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}")
            stream["cuda"] = gen.manual_seed(stream["seed"]).get_state()
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if use_cuda else None
        torch.set_rng_state(stream["cpu"])
        if use_cuda:
            torch.cuda.set_rng_state(stream["cuda"])
        try:
            yield
        finally:
            stream["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if use_cuda:
                stream["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


def _copy_state(stream: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in stream.items()}


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
