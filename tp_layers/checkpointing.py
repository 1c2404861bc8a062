"""Activation recomputation mechanisms (Megatron's ``tensor_parallel.checkpoint`` and
``CheckpointWithoutOutput``), used by the layers' selective recompute and ``models/recompute.py``.

Two mechanisms (what a region keeps for backward is what ``saved_tensors_hooks`` sees):

- :func:`checkpoint` (``recompute_granularity="full"``, and the selective modules ``core_attn``
  and ``mlp``): the region runs without building a graph and keeps only its inputs; backward
  re-runs it with the forward's random-number state and back-propagates through the re-run
  (a reentrant autograd Function, as Megatron's ``tensor_parallel.checkpoint``). With
  ``distribute_saved_activations`` the first input is kept as this TP rank's 1/tp slice of its
  flattened elements and all-gathered in backward (Megatron: full recompute, tp > 1, no sequence
  parallelism — under SP the input is already a 1/tp shard).
- :class:`DiscardedOutput` (selective module ``layernorm``; Megatron's output-discarding
  ``CheckpointWithoutOutput``): the region's output is computed once, consumed by the next op
  (which saves it for its own backward), then its storage is freed; when the gradient of a later
  tensor arrives the region is re-run into the same storage, before the consumer's backward
  reads it.

Random state: the CPU (and CUDA) default generator and every stream of the model-parallel RNG
tracker are captured at the forward and put back for the re-run, then restored to their
post-backward values, so dropout masks are reproduced exactly and nothing else moves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .random import get_rng_tracker

# the selective-recompute modules the layers implement (``TransformerLayer(recompute_modules=)``,
# Megatron's ``--recompute-modules`` names); TransformerConfig validates against the same tuple
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


# ----------------------------------------------------------------------------- random state

def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker)


class _ReplayedRandomness:
    """``with`` block running under the captured states; the states before it come back after."""

    def __init__(self, states):
        self.states, self.before = states, None

    def __enter__(self):
        self.before = _rng_states()
        _set_rng_states(self.states)

    def __exit__(self, *exc):
        _set_rng_states(self.before)


# ----------------------------------------------------------------------------- full checkpoint

def _split_for_rank(tensor, group) -> torch.Tensor:
    """This rank's 1/tp slice of ``tensor``'s flattened elements (a copy: the full input may be
    freed)."""
    flat = tensor.reshape(-1)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    part = flat.numel() // size
    return flat[rank * part:(rank + 1) * part].clone()


def _gather_from_ranks(part, shape, group) -> torch.Tensor:
    full = torch.empty(part.numel() * dist.get_world_size(group), dtype=part.dtype,
                       device=part.device)
    dist.all_gather_into_tensor(full, part.contiguous(), group=group)
    return full.view(shape)


class _Checkpoint(torch.autograd.Function):
    """forward: ``function(*args)`` without a graph, keeping the tensor args (the first as a
    1/tp slice when distributed); backward: re-run with the forward's random state and
    back-propagate through the re-run."""

    @staticmethod
    def forward(ctx, function, distribute_group, *args):
        ctx.function, ctx.group = function, distribute_group
        ctx.rng = _rng_states()
        with torch.no_grad():
            outputs = function(*args)
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.constants = [None if i in ctx.tensor_at else a for i, a in enumerate(args)]
        tensors = [args[i] for i in ctx.tensor_at]
        ctx.needs_grad = [t.requires_grad for t in tensors]
        ctx.first_shape = None
        if distribute_group is not None and tensors:
            ctx.first_shape = tensors[0].shape
            tensors[0] = _split_for_rank(tensors[0], distribute_group)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        tensors = list(ctx.saved_tensors)
        if ctx.first_shape is not None:
            tensors[0] = _gather_from_ranks(tensors[0], ctx.first_shape, ctx.group)
        args = list(ctx.constants)
        for index, tensor, needs_grad in zip(ctx.tensor_at, tensors, ctx.needs_grad):
            args[index] = tensor.detach().requires_grad_(needs_grad)
        with _ReplayedRandomness(ctx.rng), torch.enable_grad():
            outputs = ctx.function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if isinstance(a, torch.Tensor) else None
                                    for a in args)


def checkpoint(function, *args, distribute_group=None):
    """``function(*args)`` keeping only ``args`` for backward (and re-running it there).

    ``distribute_group``: a TP group over which the first tensor argument is kept 1/tp per rank
    (its element count must divide). Without gradients to compute (eval, no_grad) the function
    just runs."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not needs_grad:
        return function(*args)
    return _Checkpoint.apply(function, distribute_group, *args)


# ----------------------------------------------------------------------------- output discarding

class _DiscardingRun(torch.autograd.Function):
    """forward: ``holder.function(*args)`` without a graph; backward: through the re-run the
    holder made when the output was re-materialised."""

    @staticmethod
    def forward(ctx, holder, *args):
        ctx.holder = holder
        holder.rng = _rng_states()
        with torch.no_grad():
            output = holder.function(*args)
        ctx.save_for_backward(*args)
        return output

    @staticmethod
    def backward(ctx, grad):
        holder = ctx.holder
        if holder.rerun is None:               # never discarded (or the hook did not fire)
            holder.recompute(ctx.saved_tensors)
        output, inputs = holder.rerun
        holder.rerun = None
        torch.autograd.backward(output, grad)
        return (None,) + tuple(i.grad for i in inputs)


class DiscardedOutput:
    """One use of an output-discarding checkpoint around ``function`` (Megatron's
    ``CheckpointWithoutOutput``)::

        norm = DiscardedOutput(layer.input_norm)
        y = norm(x)                       # y is saved by the op that consumes it
        out = consumer(y)
        norm.discard(out)                 # frees y now; refilled when out's gradient arrives
    """

    def __init__(self, function):
        self.function = function
        self.output, self.rng, self.rerun, self._inputs = None, None, None, None
        self._nbytes = 0

    def __call__(self, *args):
        if not (torch.is_grad_enabled() and any(a.requires_grad for a in args)):
            return self.function(*args)
        self._inputs = args
        self.output = _DiscardingRun.apply(self, *args)
        return self.output

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage; re-run when ``hook_tensor``'s gradient is computed."""
        if self.output is None or not hook_tensor.requires_grad:
            return
        self._nbytes = self.output.untyped_storage().nbytes()
        self.output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._refill)

    def recompute(self, saved_inputs) -> torch.Tensor:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved_inputs]
        with _ReplayedRandomness(self.rng), torch.enable_grad():
            output = self.function(*inputs)
        self.rerun = (output, inputs)
        return output

    def _refill(self, grad):
        output = self.recompute(self._inputs)
        storage = self.output.untyped_storage()
        storage.resize_(self._nbytes)
        storage.copy_(output.detach().untyped_storage())   # no version bump: saved views stay valid
        self._inputs = None
        return grad


# ----------------------------------------------------------------------------- measuring

class SavedActivationBytes:
    """Bytes autograd keeps for backward from the ops run inside the ``with`` block: each saved
    tensor's storage once (views share it), the storages of ``exclude`` (parameters) left out.
    ``nbytes`` reads the storages' sizes when asked, so an output freed by
    :class:`DiscardedOutput` counts 0 and one re-materialised in backward counts again."""

    def __init__(self, exclude=()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._storages: dict = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages.setdefault(storage.data_ptr(), storage)
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(storage.nbytes() for storage in self._storages.values())
