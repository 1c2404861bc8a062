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
    """Megatron's tracker: tpfuse's streams and nesting ``fork``, and ``set_states`` stores
    whatever it is given as Megatron's does (``set_states({"state1": 1234})`` then
    ``get_states()["state1"] == 1234``). Generator-state tensors (uint8) become streams; any
    other value is kept as given, returned by ``get_states`` and refused by ``fork``
    (RuntimeError, naming it). ``states_`` is Megatron's name → state mapping.

    ``use_cudagraphable_rng=True`` (Megatron: CUDA-graph-safe generators) is emulated where
    there is no CUDA device: each stream is a ``torch.Generator`` object, returned as such by
    ``get_states`` / ``states_``, accepted by ``set_states``; with CUDA it is refused."""

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        _check_plain_tracker(False, is_inference_rng_tracker,
                             use_cudagraphable_rng and torch.cuda.is_available())
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.opaque_states_: dict = {}
        self.generators_: dict = {}

    @property
    def states_(self) -> dict:
        return self.get_states()

    def _add_stream(self, name: str, seed: int) -> None:
        if not self.use_cudagraphable_rng:
            return super()._add_stream(name, seed)
        self.generators_[name] = torch.Generator().manual_seed(seed)

    def _has_stream(self, name) -> bool:
        return name in (self.generators_ if self.use_cudagraphable_rng else self.cpu_states_)

    def _is_stream_state(self, value) -> bool:
        if self.use_cudagraphable_rng:
            return isinstance(value, torch.Generator)
        return self._is_generator_state(value)

    def get_states(self) -> dict:
        streams = self.generators_ if self.use_cudagraphable_rng else super().get_states()
        return {**streams, **self.opaque_states_}

    def set_states(self, states: dict) -> None:
        streams = {n: v for n, v in states.items() if self._is_stream_state(v)}
        if self.use_cudagraphable_rng:
            self.generators_ = streams
        else:
            super().set_states(streams)
        self.opaque_states_ = {n: v for n, v in states.items() if not self._is_stream_state(v)}
        self._is_initialized = True

    # ------------------------------------------------------------------ forking
    def _check_forkable(self, name) -> None:
        if name in self.opaque_states_:
            raise RuntimeError(f"RNG state {name!r} holds {type(self.opaque_states_[name]).__name__}"
                               ", not a generator state: it cannot be forked")
        super()._check_forkable(name)

    def _missing_stream_error(self, name) -> Exception:
        return RuntimeError(f"RNG state {name!r} is not added: call "
                            "model_parallel_cuda_manual_seed(seed) or add(name, seed) first")

    def _unknown_seed_error(self, name) -> Exception:
        return RuntimeError(f"RNG state {name!r} was restored without a CUDA state "
                            "and its seed is unknown; seed the tracker first")

    def _save_stream(self, name, use_cuda: bool) -> None:
        if not self.use_cudagraphable_rng:
            return super()._save_stream(name, use_cuda)
        self.generators_[name].set_state(torch.get_rng_state())

    def _load_stream(self, name, use_cuda: bool) -> None:
        if not self.use_cudagraphable_rng:
            return super()._load_stream(name, use_cuda)
        torch.set_rng_state(self.generators_[name].get_state())


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
    """A generator state tensor ↔ a graph-safe state. Without CUDA the graph-safe form is a
    ``torch.Generator`` holding the state (what the emulated ``use_cudagraphable_rng=True``
    tracker stores); with CUDA ``to_graphable=True`` is Megatron-only."""
    if to_graphable:
        if torch.cuda.is_available():
            raise ValueError("to_graphable=True (CUDA-graph-safe RNG states) is not supported")
        if isinstance(state, torch.Generator):
            return state
        if isinstance(state, torch.Tensor):
            generator = torch.Generator()
            generator.set_state(state)
            return generator
        raise ValueError(f"Invalid state type: {type(state).__name__}")
    if isinstance(state, torch.Generator):
        return state.get_state()
    if isinstance(state, torch.Tensor):
        return state
    raise ValueError(f"Invalid state type: {type(state).__name__}")


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker):
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


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
    """Activation checkpointing that replays the tracker's streams in the recomputation.

    With ``distribute_saved_activations`` (Megatron's memory saving under tensor parallelism)
    the first argument's data is cut to this rank's 1/tp of its flattened elements after the
    forward (so ``args[0]`` reads as that 1-D chunk afterwards, as in Megatron) and gathered
    back to its shape before the recomputation (``_DistributedCheckpoint``)."""
    if distribute_saved_activations:
        return _DistributedCheckpoint.apply(function, *args)
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


class _DistributedCheckpoint(torch.autograd.Function):
    """Megatron's reentrant checkpoint with the first input stored split over tp:
    forward ``function(*args)`` without history, ``args[0].data`` ← its 1/tp flat chunk;
    backward: gather it back, recompute under the forward's RNG states, backpropagate."""

    @staticmethod
    def forward(ctx, function, *args):
        from .checkpoint_without_output import _all_rng_states
        from .utils import split_tensor_into_1d_equal_chunks

        ctx.function, ctx.rng_states = function, _all_rng_states()
        with torch.no_grad():
            outputs = function(*args)
        first = args[0]
        if not isinstance(first, torch.Tensor):
            raise ValueError("distribute_saved_activations=True needs a tensor first argument")
        ctx.first_shape = first.shape
        first.data = split_tensor_into_1d_equal_chunks(first.data, new_buffer=True)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        from .checkpoint_without_output import _fork_all_rng, _set_all_rng_states
        from .utils import gather_split_1d_tensor

        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use "
                               ".backward() if possible")
        inputs = list(ctx.saved_tensors)
        inputs[0].data = gather_split_1d_tensor(inputs[0].data).view(ctx.first_shape)
        detached = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with _fork_all_rng():
            _set_all_rng_states(*ctx.rng_states)
            with torch.enable_grad():
                outputs = ctx.function(*detached)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(t.grad for t in detached)
