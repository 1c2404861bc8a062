"""megatron-core 0.16's ``tensor_parallel.random.CheckpointWithoutOutput``: checkpoint a
function and free its outputs' memory until backward needs them again.

    ckpt = CheckpointWithoutOutput()
    h = ckpt.checkpoint(run_function, *args)      # run without autograd history; args kept
    y = next_op(h)                                # next_op saves h for its backward
    ckpt.discard_output_and_register_recompute(y) # h's storage freed (its metadata stays)
    ...backward reaches y: run_function(*args) again with the forward's RNG states, h's
    storage refilled in place (next_op's saved h sees the values), then the gradient of h
    flows through the recomputed graph into args and run_function's parameters.

Contract (Megatron's): the caller makes sure the discarded outputs are not read in the
forward after the discard, and that ``hook_tensor``'s gradient is computed before any saved
copy of an output is used in backward (typically: hook the output of the op that saved it).

RNG: ``checkpoint`` records the CPU default generator, the current CUDA generator (when CUDA
is in use) and every stream of the model-parallel tracker (``tpfuse.tp_layers.random``); the
recomputation runs with those restored, inside a fork that puts the states of the moment back
afterwards, so dropout inside ``run_function`` (plain or under ``tracker.fork()``) draws the
forward's masks and the caller's streams are untouched.

Differences from Megatron: ``fp8`` (Transformer Engine's FP8 recompute contexts) is accepted
as None / False only; when backward reaches the checkpoint before the hook ran (no discard
was called), the recomputation runs there instead of failing.
"""
from __future__ import annotations

import contextlib

import torch

from tpfuse.tp_layers.random import get_rng_tracker


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _all_rng_states():
    """(CPU default state, CUDA default state or None, the tracker's stream states)."""
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


def _set_all_rng_states(cpu, cuda, tracker_states) -> None:
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker_states)


@contextlib.contextmanager
def _fork_all_rng():
    """Whatever the block does to the generators, they leave it as they entered."""
    entered = _all_rng_states()
    try:
        yield
    finally:
        _set_all_rng_states(*entered)


def _as_tuple(outputs) -> tuple:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """forward: ``run_function(*args)`` without history, the tensor args saved (detached);
    backward: the gradient of the outputs through the recomputed graph (``owner._recompute``
    put it on ``ctx``), returned for the tensor args."""

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(args[i].detach() for i in tensor_slots))
        ctx.tensor_slots, ctx.args = tensor_slots, [
            None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.arg_requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.owner = owner
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.owner is not None and ctx.owner.ctx is ctx:
            ctx.owner._recompute(None)               # no hook ran: recompute here
        inputs, outputs = ctx.inputs, ctx.outputs
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.inputs = ctx.outputs = ctx.owner = None
        grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None, None) + grads


class CheckpointWithoutOutput:
    """Megatron's CheckpointWithoutOutput (see the module docstring)."""

    def __init__(self, fp8=False):
        if fp8 not in (None, False):
            raise ValueError(f"CheckpointWithoutOutput(fp8={fp8!r}): FP8 recomputation "
                             "(Transformer Engine) is not implemented by tpfuse; pass None")
        self.fp8 = False
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        """``run_function(*args)``, its inputs kept for a recomputation; returns its outputs."""
        self.run_function = run_function
        self.rng_states = _all_rng_states()
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = _as_tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor) -> None:
        """Free the outputs' storage (shapes and autograd metadata stay) and recompute them
        when the gradient of ``hook_tensor`` has been computed."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _):
        """The hook: rerun the function with the forward's RNG states, refill the outputs'
        storage in place, hand the recomputed graph to the autograd Function's backward."""
        ctx = self.ctx
        if ctx is None:
            return                                      # already recomputed
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use "
                               ".backward() if possible")
        saved = iter(ctx.saved_tensors)
        inputs = list(ctx.args)
        for slot in ctx.tensor_slots:
            inputs[slot] = next(saved).detach().requires_grad_(ctx.arg_requires_grad[slot])
        with _fork_all_rng():
            _set_all_rng_states(*self.rng_states)
            with torch.enable_grad():
                outputs = _as_tuple(self.run_function(*inputs))
        with torch.no_grad():
            for kept, recomputed in zip(self.outputs, outputs):
                storage = recomputed.untyped_storage()
                kept.untyped_storage().resize_(storage.size())
                kept.untyped_storage().copy_(storage)
        ctx.inputs, ctx.outputs = inputs, outputs
        self.run_function = self.rng_states = self.outputs = self.ctx = None
