"""One rank's execution of its plan: what F, B, I and W do (see ``executor.py`` for the API).

Every action is O(1) bookkeeping around its compute: the plan (``plan.RankPlan.steps``) already
names the index of the message it receives and of the one it sends in this rank's p2p order.

- **F** receives the activation (stage > 0), runs ``forward_step`` on the chunk, sends the output
  (or, on the last stage, applies the loss function and scales by 1/m), and keeps
  ``(input, output)``; a sent output's storage is freed at once (Megatron's deallocation).
- **B** receives the output gradient (last stage: the loss itself), runs the autograd engine
  from the output and sends the input's gradient upstream.
- **I** (zero-bubble) is B with the weight gradients of deferring layers queued
  (:mod:`tpfuse.kernels.wgrad_deferral`); **W** runs that queue.

Timers (``training.timers.Timers``, level 2): ``forward-compute`` / ``backward-compute`` /
``weight-grad-compute`` cover the compute of F / B or I / W; ``forward-recv`` /
``backward-recv`` the wait for an activation / gradient, ``forward-send`` / ``backward-send``
posting one. The compute timers' sum is a rank's busy time inside ``forward-backward``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.variable import Variable

from .p2p import PipelineP2P
from tpfuse.kernels.wgrad_deferral import WeightGradQueue, deferring_weight_grads


class _NoTimers:
    """Stands in for ``Timers`` when the caller passes none."""

    class _Null:
        def start(self, barrier=False):
            return self

        def stop(self):
            pass

    _null = _Null()

    def __call__(self, name, log_level=2):
        return self._null


NO_TIMERS = _NoTimers()


@dataclass
class StageRun:
    forward_step_func: object
    data_iterators: list
    chunks: list
    num_microbatches: int
    forward_only: bool
    state: object
    pp_rank: int
    pp_size: int
    comm: PipelineP2P | None
    timers: object = NO_TIMERS
    saved: dict = field(default_factory=dict)     # (mb, chunk) -> (input, output)
    deferred: dict = field(default_factory=dict)  # (mb, chunk) -> WeightGradQueue, I until W
    losses: list = field(default_factory=list)

    @property
    def last_stage(self) -> int:
        return self.pp_size * len(self.chunks) - 1

    def stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def enter_chunk(self, chunk: int) -> None:
        if getattr(self.state, "vpp_size", None) is not None:
            self.state.vpp_rank = chunk

    def recv(self, index: int, name: str) -> torch.Tensor:
        timer = self.timers(name, 2)
        timer.start()
        tensor = self.comm.recv_at(index)
        timer.stop()
        return tensor

    def send(self, index: int, tensor: torch.Tensor, name: str) -> None:
        timer = self.timers(name, 2)
        timer.start()
        self.comm.send_at(index, tensor)
        timer.stop()


def _set_input_tensor(chunk, tensor) -> None:
    target = chunk
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if not hasattr(target, "set_input_tensor"):
        raise ValueError(f"model chunk {type(chunk).__name__} has no set_input_tensor")
    target.set_input_tensor(tensor)


def _set_aux_loss_scale(chunks, scale: float) -> None:
    """Losses injected in a chunk's backward (MoE router losses) take the main loss's 1/m."""
    for chunk in chunks:
        target = chunk
        while not hasattr(target, "set_aux_loss_scale") and hasattr(target, "module"):
            target = target.module
        if hasattr(target, "set_aux_loss_scale"):
            target.set_aux_loss_scale(scale)


def _forward(run: StageRun, mb: int, chunk: int, recv_index, send_index) -> None:
    stage = run.stage(chunk)
    input_tensor = None
    if recv_index is not None:
        input_tensor = run.recv(recv_index, "forward-recv")
        input_tensor.requires_grad_(not run.forward_only)
    timer = run.timers("forward-compute", 2)
    timer.start()
    run.enter_chunk(chunk)
    _set_input_tensor(run.chunks[chunk], input_tensor)
    output, loss_func = run.forward_step_func(run.data_iterators[chunk], run.chunks[chunk])
    if stage == run.last_stage:
        output = _scaled_loss(run, output, loss_func)
    timer.stop()
    if send_index is not None:
        run.send(send_index, output, "forward-send")
    if run.forward_only:
        return
    run.saved[(mb, chunk)] = (input_tensor, output)
    if stage != run.last_stage:
        _deallocate(output)


def _scaled_loss(run: StageRun, output, loss_func):
    result = loss_func(output)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError("loss_func must return a pair (loss_scalar, {name: tensor}), got "
                         f"{type(result).__name__}")
    loss, logs = result
    run.losses.append(logs)
    return loss / run.num_microbatches


def _deallocate(output: torch.Tensor) -> None:
    """Free an output's storage after its send; its grad_fn (and recorded shape) survive."""
    if isinstance(output, torch.Tensor) and output._base is None and output.grad_fn is not None:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _run_engine(output, grad) -> None:
    """Backward from ``output`` with ``grad`` through the autograd engine. Unlike
    ``torch.autograd.backward`` the engine checks ``grad`` against the shape recorded in
    ``grad_fn``, not against the possibly deallocated ``output.data`` (Megatron's
    ``custom_backward``)."""
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


def _backward(run: StageRun, mb: int, chunk: int, recv_index, send_index) -> None:
    input_tensor, output = run.saved.pop((mb, chunk))
    grad = None if recv_index is None else run.recv(recv_index, "backward-recv")
    timer = run.timers("backward-compute", 2)
    timer.start()
    run.enter_chunk(chunk)
    if grad is None:                                   # the last stage: output is the loss
        if output.requires_grad:
            torch.autograd.backward(output)
    elif output.grad_fn is not None:
        _run_engine(output, grad)
    grad_in = None
    if send_index is not None:
        grad_in = input_tensor.grad
        if grad_in is None:  # the chunk did not use its input: its gradient is zero
            grad_in = torch.zeros_like(input_tensor)
    timer.stop()
    if grad_in is not None:
        run.send(send_index, grad_in, "backward-send")


def _input_grad(run: StageRun, mb: int, chunk: int, recv_index, send_index) -> None:
    """ZB's I: B with the deferring layers' weight gradients queued for W."""
    queue = run.deferred[(mb, chunk)] = WeightGradQueue()
    with deferring_weight_grads(queue, run.chunks[chunk]):   # opened on this chunk's weights
        _backward(run, mb, chunk, recv_index, send_index)


def _weight_grad(run: StageRun, mb: int, chunk: int, recv_index, send_index) -> None:
    """ZB's W: the weight gradients the I pass of (mb, chunk) queued."""
    queue = run.deferred.pop((mb, chunk))
    timer = run.timers("weight-grad-compute", 2)
    timer.start()
    run.enter_chunk(chunk)
    queue.run()
    timer.stop()


HANDLERS = {"F": _forward, "B": _backward, "I": _input_grad, "W": _weight_grad}


def execute(run: StageRun, steps) -> list:
    """Run ``steps`` ((action, recv_index, send_index), ...); the loss dicts on the rank holding
    the last virtual stage, else []."""
    _set_aux_loss_scale(run.chunks, 1.0 / run.num_microbatches)
    for action, recv_index, send_index in steps:
        HANDLERS[action.kind](run, action.microbatch, action.chunk, recv_index, send_index)
    if run.comm is not None:
        run.comm.finish()
    if run.deferred:   # pragma: no cover - every valid zero-bubble plan runs W after its I
        raise RuntimeError(f"{len(run.deferred)} weight-gradient queue(s) never ran")
    return run.losses if run.stage(len(run.chunks) - 1) == run.last_stage else []
