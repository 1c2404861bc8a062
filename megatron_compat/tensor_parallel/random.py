"""megatron-core 0.16's ``tensor_parallel.random``: the RNG tracker under Megatron's names.

``model_parallel_cuda_manual_seed(seed)`` seeds the tracker's ``data-parallel-rng`` (seed),
``model-parallel-rng`` (seed + 2718 + tp_rank) and ``expert-parallel-rng``
(seed + 1024 + 100·ep_rank + etp_rank) streams, ranks from the ``parallel_state`` getters (so
Megatron's setters apply), and — as Megatron does — seeds the CUDA default generator with
``seed`` when CUDA is available; the CPU default generator is left alone. Transformer Engine's
tracker, the inference tracker and CUDA-graph-safe generators are Megatron-only options.
``CheckpointWithoutOutput`` (recompute a function's freed outputs in backward) lives in
``checkpoint_without_output.py``.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from tpfuse.tp_layers import random as _random

from .. import parallel_state as _mpu
from .checkpoint_without_output import CheckpointWithoutOutput  # noqa: F401  (Megatron's home)

_MODEL_PARALLEL_RNG_TRACKER_NAME = _random.MODEL_PARALLEL_RNG
_EXPERT_PARALLEL_RNG_TRACKER_NAME = _random.EXPERT_PARALLEL_RNG
_DATA_PARALLEL_RNG_TRACKER_NAME = _random.DATA_PARALLEL_RNG


class _TrackerType(type):
    """``isinstance(get_cuda_rng_tracker(), CudaRNGStatesTracker)`` holds: the process-wide
    tracker is tpfuse's, which this class extends."""

    def __instancecheck__(cls, instance):
        return isinstance(instance, _random.CudaRNGStatesTracker)


class CudaRNGStatesTracker(_random.CudaRNGStatesTracker, metaclass=_TrackerType):
    """Megatron's tracker: tpfuse's streams, and ``set_states`` stores whatever it is given as
    Megatron's does (``set_states({"state1": 1234})`` then ``get_states()["state1"] == 1234``).
    Generator-state tensors (uint8) become streams; any other value is kept as given, returned
    by ``get_states`` and refused by ``fork`` (RuntimeError, naming it)."""

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        _check_plain_tracker(False, is_inference_rng_tracker, use_cudagraphable_rng)
        super().__init__()
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def reset(self) -> None:
        super().reset()
        self.opaque_states_: dict = {}

    def get_states(self) -> dict:
        return {**super().get_states(), **getattr(self, "opaque_states_", {})}

    def set_states(self, states: dict) -> None:
        generator_states = {name: value for name, value in states.items()
                            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8}
        super().set_states(generator_states)
        self.opaque_states_ = {name: value for name, value in states.items()
                               if name not in generator_states}
        self._is_initialized = True

    def fork(self, name: str = _random.MODEL_PARALLEL_RNG):
        if name in getattr(self, "opaque_states_", {}):
            raise RuntimeError(f"RNG state {name!r} holds {type(self.opaque_states_[name]).__name__}"
                               ", not a generator state: it cannot be forked")
        return super().fork(name)


def _check_plain_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng):
    for name, value in (("use_te_rng_tracker", use_te_rng_tracker),
                        ("inference_rng_tracker", inference_rng_tracker),
                        ("use_cudagraphable_rng", use_cudagraphable_rng)):
        if value:
            raise ValueError(f"{name}=True is not supported by tpfuse (Megatron-only tracker)")


def get_expert_parallel_rng_tracker_name():
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name():
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def initialize_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                           use_cudagraphable_rng=False, force_reset=False):
    """The process-wide tracker always exists; ``force_reset`` empties it."""
    _check_plain_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    if force_reset:
        _random.get_rng_tracker().reset()


def get_cuda_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                         use_cudagraphable_rng=False):
    _check_plain_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _random.get_rng_tracker()


def get_all_rng_states():
    """Every stream's generator state (Megatron's format, see ``CudaRNGStatesTracker``)."""
    return _random.get_rng_tracker().get_states()


def convert_cuda_rng_state(state, to_graphable=False):
    """A generator state tensor (a Generator gives its state); graph-safe states are
    Megatron-only."""
    if to_graphable:
        raise ValueError("to_graphable=True (CUDA-graph-safe RNG states) is not supported")
    if isinstance(state, torch.Generator):
        return state.get_state()
    if isinstance(state, torch.Tensor):
        return state
    raise ValueError(f"Invalid state type: {type(state).__name__}")


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker):
    return False


def model_parallel_cuda_manual_seed(seed, te_rng_tracker=False, inference_rng_tracker=False,
                                    use_cudagraphable_rng=False, tp_rank=None, ep_rank=None,
                                    etp_rank=None, force_reset_rng=False):
    _check_plain_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    tp_rank = _mpu.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = _mpu.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = _mpu.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tracker = _random.get_rng_tracker()
    tracker.reset()
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _random.TP_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + _random.EXPERT_SEED_OFFSET + 100 * ep_rank + etp_rank)


def checkpoint(function, distribute_saved_activations, *args):
    """Activation checkpointing that replays the tracker's streams in the recomputation."""
    if distribute_saved_activations:
        raise ValueError("distribute_saved_activations=True is not supported by tpfuse")
    tracker = _random.get_rng_tracker()
    at_forward = tracker.get_states()
    calls = []

    def body(*inputs):
        if not calls:
            calls.append(1)
            return function(*inputs)
        after = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            return function(*inputs)
        finally:
            tracker.set_states(after)

    return _torch_checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True)

