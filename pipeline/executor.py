"""Runs this rank's share of a pipeline schedule (Megatron-core's forward_backward functions).

    forward_backward = get_forward_backward_func(state)
    losses = forward_backward(forward_step, data_iterator, model, num_microbatches,
                              seq_length, micro_batch_size, forward_only=False)

- ``model``: this rank's model chunks, one per virtual stage (or a single module). Chunk c of
  pp rank r is virtual stage ``c·pp + r``; virtual stage 0 reads data (pre_process), the last
  one computes the loss (post_process). Each chunk receives its input through
  ``set_input_tensor(t)`` (None on stage 0), found on the module or a wrapper's ``.module``.
- ``forward_step(data_iterator, chunk) -> (output_tensor, loss_func)``;
  ``loss_func(output_tensor) -> (loss_scalar, {name: tensor})``. ``data_iterator`` is one
  iterator (or None) for one chunk, else a list with one per chunk (Megatron's convention).
- On the last stage the loss is divided by ``num_microbatches`` before backward, so gradients
  accumulate to the gradient of the mean loss; the logging dicts are returned there (its last
  chunk), ``[]`` on every other rank. ``forward_only`` runs only the forwards.
- Activations/gradients exchanged between stages have ``tensor_shape`` or, by default,
  ``(seq_length / (tp if sequence_parallel) / cp, micro_batch_size, hidden_size)`` from
  ``model[0].config`` in ``config.params_dtype`` (fp32 when absent).
- After its activation is sent, a chunk output's storage is freed (``.data`` replaced by a
  1-element tensor; ``grad_fn`` survives). Its backward then calls the autograd engine directly
  with the received gradient, as Megatron's ``custom_backward`` does: ``torch.autograd.backward``
  would reject the now mismatched shape, the engine only checks the shape recorded in
  ``grad_fn``, which is the original one.
- ``state.vpp_rank`` is set to the running chunk (when the state has a virtual pipeline).

Every check (sizes, group size, iterator and chunk counts, schedule deadlock) runs before the
first message is exchanged, so bad settings raise ValueError instead of hanging a peer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.variable import Variable

from .p2p import PipelineP2P
from .schedules import (
    build_interleaved_schedule, build_no_pipelining_schedule, build_schedule,
    forward_only as forward_only_actions)
from .simulate import Message


def _default_state(state):
    if state is not None:
        return state
    from tpfuse.parallel.state import get_default_state

    return get_default_state()


def get_forward_backward_func(state=None):
    """The schedule for this layout: no pipelining (pp 1), 1F1B (vpp None or 1), interleaved.

    ``state`` is a ParallelState (default: the default state) or a config with
    ``pipeline_model_parallel_size`` / ``virtual_pipeline_model_parallel_size``. A state given
    here is passed on to the returned function unless the call names another.
    """
    if hasattr(state, "pipeline_model_parallel_size"):
        pp_size = state.pipeline_model_parallel_size
        vpp_size = state.virtual_pipeline_model_parallel_size
        bound_state = None
    else:
        bound_state = _default_state(state)
        pp_size, vpp_size = bound_state.pp_size, bound_state.vpp_size
    if pp_size == 1:
        if vpp_size not in (None, 1):
            raise ValueError(f"virtual pipeline size {vpp_size} needs pp > 1, got pp=1")
        chosen = forward_backward_no_pipelining
    elif vpp_size is not None and vpp_size > 1:
        chosen = forward_backward_pipelining_with_interleaving
    else:
        chosen = forward_backward_pipelining_without_interleaving
    if bound_state is None:
        return chosen

    def forward_backward(*args, **kwargs):
        kwargs.setdefault("state", bound_state)
        return chosen(*args, **kwargs)

    forward_backward.__name__ = chosen.__name__
    forward_backward.__doc__ = chosen.__doc__
    return forward_backward


# ------------------------------------------------------------------ argument normalisation

def _as_chunks(model) -> list:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model must be a module or a non-empty list of model chunks")
    return chunks


def _as_iterators(data_iterator, num_chunks: int) -> list:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"data_iterator is a list of {len(data_iterator)} iterators but "
                             f"there are {num_chunks} model chunks (one iterator per chunk)")
        return list(data_iterator)
    if num_chunks > 1 and data_iterator is not None:
        raise ValueError(f"with {num_chunks} model chunks data_iterator must be a list of one "
                         f"iterator per chunk (or None), got {type(data_iterator).__name__}")
    return [data_iterator] * num_chunks


def _unwrap_config(chunk):
    while not hasattr(chunk, "config") and hasattr(chunk, "module"):
        chunk = chunk.module
    return getattr(chunk, "config", None)


def _recv_tensor_spec(chunks, seq_length, micro_batch_size, state, tensor_shape):
    """(shape, dtype, device) of the activations and gradients sent between stages."""
    config = _unwrap_config(chunks[0])
    dtype = getattr(config, "params_dtype", None) or torch.float32
    parameter = next(iter(chunks[0].parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    if tensor_shape is not None:
        return tuple(tensor_shape), dtype, device
    if config is None or not hasattr(config, "hidden_size"):
        raise ValueError("pass tensor_shape=, or give model[0] a .config with hidden_size")
    seq = seq_length
    if getattr(config, "sequence_parallel", False):
        seq //= getattr(state, "tp_size", 1)
    seq //= getattr(state, "cp_size", 1) or 1
    return (seq, micro_batch_size, config.hidden_size), dtype, device


def _set_input_tensor(chunk, tensor) -> None:
    target = chunk
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if not hasattr(target, "set_input_tensor"):
        raise ValueError(f"model chunk {type(chunk).__name__} has no set_input_tensor")
    target.set_input_tensor(tensor)


def _check_counts(num_microbatches) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
            or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")


# ------------------------------------------------------------------ one rank's execution

@dataclass
class _Run:
    forward_step_func: object
    data_iterators: list
    chunks: list
    num_microbatches: int
    forward_only: bool
    state: object
    pp_rank: int
    pp_size: int
    comm: PipelineP2P | None
    saved: dict = field(default_factory=dict)   # (mb, chunk) -> (input, output)
    output_grads: dict = field(default_factory=dict)   # (mb, chunk) -> grad, from I until W
    losses: list = field(default_factory=list)

    @property
    def last_stage(self) -> int:
        return self.pp_size * len(self.chunks) - 1

    def stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def enter_chunk(self, chunk: int) -> None:
        if getattr(self.state, "vpp_size", None) is not None:
            self.state.vpp_rank = chunk


def _forward(run: _Run, mb: int, chunk: int) -> None:
    stage = run.stage(chunk)
    input_tensor = None
    if stage > 0:
        input_tensor = run.comm.recv(Message("act", mb, stage - 1, stage))
        input_tensor.requires_grad_(not run.forward_only)
    run.enter_chunk(chunk)
    _set_input_tensor(run.chunks[chunk], input_tensor)
    output, loss_func = run.forward_step_func(run.data_iterators[chunk], run.chunks[chunk])
    if stage == run.last_stage:
        output = _scaled_loss(run, output, loss_func)
    else:
        run.comm.send(Message("act", mb, stage, stage + 1), output)
    if run.forward_only:
        return
    run.saved[(mb, chunk)] = (input_tensor, output)
    if stage != run.last_stage:
        _deallocate(output)


def _scaled_loss(run: _Run, output, loss_func):
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


def _backward(run: _Run, mb: int, chunk: int) -> None:
    input_tensor, output = run.saved.pop((mb, chunk))
    stage = run.stage(chunk)
    run.enter_chunk(chunk)
    if stage == run.last_stage:
        if output.requires_grad:
            torch.autograd.backward(output)
    else:
        grad = run.comm.recv(Message("grad", mb, stage + 1, stage))
        if output.grad_fn is not None:
            # the engine checks grad against grad_fn's recorded (full) shape, not output.data
            _run_engine(output, grad, False, (), True)
    if stage > 0:
        grad_in = input_tensor.grad
        if grad_in is None:  # the chunk did not use its input: its gradient is zero
            grad_in = torch.zeros_like(input_tensor)
        run.comm.send(Message("grad", mb, stage, stage - 1), grad_in)


def _run_engine(output, grad, keep_graph, inputs, accumulate):
    """Backward from ``output`` with ``grad`` through the autograd engine (no shape check
    against the possibly deallocated ``output.data``, see the module docstring)."""
    return Variable._execution_engine.run_backward(
        (output,), (grad,), keep_graph, False, tuple(inputs), True, accumulate)


def _input_grad(run: _Run, mb: int, chunk: int) -> None:
    """ZB's I: the gradient w.r.t. the chunk's input only (sent upstream at once); the graph is
    kept for W."""
    input_tensor, output = run.saved[(mb, chunk)]
    stage = run.stage(chunk)
    run.enter_chunk(chunk)
    if stage == run.last_stage:
        grad = torch.ones_like(output)
    else:
        grad = run.comm.recv(Message("grad", mb, stage + 1, stage))
    run.output_grads[(mb, chunk)] = grad
    if stage == 0:
        return
    grad_in = None
    if output.grad_fn is not None:
        (grad_in,) = _run_engine(output, grad, True, (input_tensor,), False)
    if grad_in is None:   # the chunk did not use its input
        grad_in = torch.zeros_like(input_tensor)
    run.comm.send(Message("grad", mb, stage, stage - 1), grad_in)


def _weight_grad(run: _Run, mb: int, chunk: int) -> None:
    """ZB's W: accumulate the parameter gradients (the autograd engine walks the kept graph a
    second time — correct, but without Megatron-style stored wgrad GEMMs not faster)."""
    _, output = run.saved.pop((mb, chunk))
    grad = run.output_grads.pop((mb, chunk))
    run.enter_chunk(chunk)
    params = [p for p in run.chunks[chunk].parameters() if p.requires_grad]
    if output.grad_fn is not None and params:
        _run_engine(output, grad, False, params, True)


_HANDLERS = {"F": _forward, "B": _backward, "I": _input_grad, "W": _weight_grad}


def _execute(run: _Run, actions: list) -> list:
    for action in actions:
        _HANDLERS[action.kind](run, action.microbatch, action.chunk)
    if run.comm is not None:
        run.comm.finish()
    return run.losses if run.stage(len(run.chunks) - 1) == run.last_stage else []


def _pipelined(schedule, forward_step_func, data_iterator, chunks, num_microbatches,
               seq_length, micro_batch_size, forward_only, state, tensor_shape):
    """Shared body of the two pipelined schedules, given every rank's action list."""
    if forward_only:
        schedule = [forward_only_actions(actions) for actions in schedule]
    iterators = _as_iterators(data_iterator, len(chunks))
    shape, dtype, device = _recv_tensor_spec(chunks, seq_length, micro_batch_size, state,
                                             tensor_shape)
    comm = PipelineP2P(schedule, state.pp_rank, state.ranks("pp"), state.pp_group,
                       num_microbatches, len(chunks), shape, dtype, device)
    run = _Run(forward_step_func, iterators, chunks, num_microbatches, forward_only, state,
               state.pp_rank, state.pp_size, comm)
    return _execute(run, schedule[state.pp_rank])


# ------------------------------------------------------------------ the three schedules

def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length=None, micro_batch_size=None, forward_only=False,
                                   state=None, tensor_shape=None):
    """Gradient accumulation on one stage: F0 B0 F1 B1 … (no communication)."""
    _check_counts(num_microbatches)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"no pipelining runs one model chunk, got {len(chunks)}")
    actions = build_no_pipelining_schedule(num_microbatches)
    if forward_only:
        actions = forward_only_actions(actions)
    run = _Run(forward_step_func, _as_iterators(data_iterator, 1), chunks, num_microbatches,
               forward_only, state, pp_rank=0, pp_size=1, comm=None)
    return _execute(run, actions)


def forward_backward_pipelining_without_interleaving(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None):
    """Plain 1F1B over the pp group: warm-up min(pp − rank − 1, m) forwards."""
    _check_counts(num_microbatches)
    state = _default_state(state)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"1F1B without interleaving runs one model chunk per rank, got "
                         f"{len(chunks)} (use forward_backward_pipelining_with_interleaving)")
    schedule = build_schedule(state.pp_size, num_microbatches)
    return _pipelined(schedule, forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape)


def forward_backward_pipelining_with_interleaving(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None, microbatch_group_size=None):
    """Megatron's interleaved schedule; the model is a list of one chunk per virtual stage.

    The group size defaults to ``model[0].config.microbatch_group_size_per_vp_stage`` when
    present, else pp.
    """
    _check_counts(num_microbatches)
    state = _default_state(state)
    chunks = _as_chunks(model)
    state_vpp = getattr(state, "vpp_size", None)
    if state_vpp is not None and state_vpp != len(chunks):
        raise ValueError(f"model has {len(chunks)} chunks but the state's vpp_size is "
                         f"{state_vpp}")
    if microbatch_group_size is None:
        config = _unwrap_config(chunks[0])
        microbatch_group_size = getattr(config, "microbatch_group_size_per_vp_stage", None)
    schedule = build_interleaved_schedule(state.pp_size, num_microbatches, len(chunks),
                                          microbatch_group_size)
    return _pipelined(schedule, forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape)


def forward_backward_pipelining_zb_h1(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None):
    """Zero-bubble ZB-H1 (one chunk per rank): backward split into I (input gradient, sent at
    once) and W (weight gradient, deferred); see :mod:`tpfuse.pipeline.zero_bubble`. Same
    results as 1F1B; without split wgrad kernels W re-walks the graph, so this shows the
    schedule running correctly rather than making a step faster."""
    from .zero_bubble import build_zb_h1_schedule

    _check_counts(num_microbatches)
    state = _default_state(state)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"ZB-H1 runs one model chunk per rank, got {len(chunks)}")
    schedule = build_zb_h1_schedule(state.pp_size, num_microbatches)
    return _pipelined(schedule, forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape)
