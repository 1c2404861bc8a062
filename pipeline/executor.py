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
  ``model[0].config`` in ``config.pipeline_dtype`` (Megatron's field), else
  ``config.params_dtype`` (fp32 when absent). On gloo, receives are posted up to
  ``config.p2p_recv_ahead`` ahead of need (default 4; see ``p2p.py``), on NCCL in strict order.
- ``config.variable_seq_lengths`` (Megatron's field, ``--variable-seq-lengths``): micro-batches
  may differ in sequence length; each activation or gradient is preceded by its shape (three
  int64) and ``seq_length`` / ``tensor_shape`` are ignored, as in Megatron (receives then keep
  the strict order, see ``p2p.py`` 4.). Without it a tensor of another sequence length is
  refused, naming the flag, before it is sent.
- After its activation is sent, a chunk output's storage is freed (``.data`` replaced by a
  1-element tensor; ``grad_fn`` survives). Its backward then calls the autograd engine directly
  with the received gradient, as Megatron's ``custom_backward`` does: ``torch.autograd.backward``
  would reject the now mismatched shape, the engine only checks the shape recorded in
  ``grad_fn``, which is the original one.
- ``state.vpp_rank`` is set to the running chunk (when the state has a virtual pipeline).
- The schedule and this rank's p2p order come from :func:`tpfuse.pipeline.plan.rank_plan`,
  computed once per configuration and cached; a step adds O(1) work per action.
- ``timers`` (optional, ``tpfuse.training.timers.Timers``): level-2 timers of the compute and
  p2p time inside the schedule (see ``stage_actions.py``).
- Auxiliary losses injected inside a chunk's backward (the MoE router losses) are scaled like the
  main loss: a chunk (or its ``.module``) with ``set_aux_loss_scale`` gets ``1/num_microbatches``
  before the schedule runs (Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``).

Every check (sizes, group size, iterator and chunk counts, schedule deadlock) runs before the
first message is exchanged, so bad settings raise ValueError instead of hanging a peer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.parallel.checks import is_int
from tpfuse.parallel.state import resolve_state

from .p2p import PipelineP2P, recv_ahead_for
from .plan import SCHEDULE_KINDS, rank_plan
from .schedules import build_no_pipelining_schedule, forward_only as forward_only_actions
from .stage_actions import NO_TIMERS, StageRun, execute


def schedule_for(pp_size: int, vpp_size: int | None, pipeline_schedule: str | None = None):
    """The schedule function for ``pp_size`` stages of ``vpp_size`` chunks each: no pipelining
    at pp 1, else ``pipeline_schedule`` ("1f1b", "interleaved", "zb-h1"; default interleaved
    when vpp > 1, else 1F1B). Pure: a ValueError names the impossible combination."""
    if pp_size == 1:
        if vpp_size not in (None, 1):
            raise ValueError(f"virtual pipeline size {vpp_size} needs pp > 1, got pp=1")
        if pipeline_schedule is not None:
            raise ValueError(f"pipeline_schedule={pipeline_schedule!r} needs pp > 1, got pp=1")
        return forward_backward_no_pipelining
    chosen = _SCHEDULES.get(pipeline_schedule or ("interleaved" if (vpp_size or 1) > 1
                                                  else "1f1b"))
    if chosen is None:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULE_KINDS}, got "
                         f"{pipeline_schedule!r}")
    if chosen is not forward_backward_pipelining_with_interleaving and (vpp_size or 1) > 1:
        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} runs one model chunk "
                         f"per rank, but the virtual pipeline size is {vpp_size}")
    return chosen


def get_forward_backward_func(state=None, pipeline_schedule: str | None = None):
    """``schedule_for`` the layout of ``state`` (a ParallelState; default: the default state),
    bound to that state: the returned function passes ``state=`` on unless the call names
    another."""
    bound_state = resolve_state(state)
    chosen = schedule_for(bound_state.pp_size, bound_state.vpp_size, pipeline_schedule)

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


def _recv_tensor_spec(chunks, seq_length, micro_batch_size, state, tensor_shape,
                      variable_seq_lengths=False):
    """(shape, dtype, device) of the activations and gradients sent between stages (shape None
    with variable sequence lengths: each message carries its own)."""
    config = _unwrap_config(chunks[0])
    dtype = (getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None)
             or torch.float32)
    parameter = next(iter(chunks[0].parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    if variable_seq_lengths:
        return None, dtype, device
    if tensor_shape is not None:
        return tuple(tensor_shape), dtype, device
    if config is None or not hasattr(config, "hidden_size"):
        raise ValueError("pass tensor_shape=, or give model[0] a .config with hidden_size")
    seq = seq_length
    if getattr(config, "sequence_parallel", False):
        seq //= getattr(state, "tp_size", 1)
    seq //= getattr(state, "cp_size", 1) or 1
    return (seq, micro_batch_size, config.hidden_size), dtype, device


def _check_counts(num_microbatches) -> None:
    if not is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")


# ------------------------------------------------------------------ one rank's execution

def _pipelined(kind, forward_step_func, data_iterator, chunks, num_microbatches, seq_length,
               micro_batch_size, forward_only, state, tensor_shape, timers,
               microbatch_group_size=None):
    """Shared body of the pipelined schedules: this rank's cached plan, run over the p2p."""
    plan = rank_plan(kind, state.pp_size, num_microbatches, len(chunks), microbatch_group_size,
                     forward_only, state.pp_rank)
    iterators = _as_iterators(data_iterator, len(chunks))
    config = _unwrap_config(chunks[0])
    variable = bool(getattr(config, "variable_seq_lengths", False))
    shape, dtype, device = _recv_tensor_spec(chunks, seq_length, micro_batch_size, state,
                                             tensor_shape, variable)
    recv_ahead = recv_ahead_for(getattr(config, "p2p_recv_ahead", None),
                                dist.get_backend(state.pp_group), variable)
    comm = PipelineP2P(plan.messages, plan.position, state.pp_rank, state.ranks("pp"),
                       state.pp_group, shape, dtype, device, recv_ahead, variable)
    run = StageRun(forward_step_func, iterators, chunks, num_microbatches, forward_only, state,
                   state.pp_rank, state.pp_size, comm, timers or NO_TIMERS)
    return execute(run, plan.steps)


# ------------------------------------------------------------------ the schedules

def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                   seq_length=None, micro_batch_size=None, forward_only=False,
                                   state=None, tensor_shape=None, timers=None):
    """Gradient accumulation on one stage: F0 B0 F1 B1 … (no communication)."""
    _check_counts(num_microbatches)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"no pipelining runs one model chunk, got {len(chunks)}")
    actions = build_no_pipelining_schedule(num_microbatches)
    if forward_only:
        actions = forward_only_actions(actions)
    run = StageRun(forward_step_func, _as_iterators(data_iterator, 1), chunks, num_microbatches,
                   forward_only, state, pp_rank=0, pp_size=1, comm=None,
                   timers=timers or NO_TIMERS)
    return execute(run, [(action, None, None) for action in actions])


def forward_backward_pipelining_without_interleaving(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None, timers=None):
    """Plain 1F1B over the pp group: warm-up min(pp − rank − 1, m) forwards."""
    _check_counts(num_microbatches)
    state = resolve_state(state)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"1F1B without interleaving runs one model chunk per rank, got "
                         f"{len(chunks)} (use forward_backward_pipelining_with_interleaving)")
    return _pipelined("1f1b", forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape, timers)


def forward_backward_pipelining_with_interleaving(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None, microbatch_group_size=None,
        timers=None):
    """Megatron's interleaved schedule; the model is a list of one chunk per virtual stage.

    The group size defaults to ``model[0].config.microbatch_group_size_per_vp_stage`` when
    present, else pp.
    """
    _check_counts(num_microbatches)
    state = resolve_state(state)
    chunks = _as_chunks(model)
    state_vpp = getattr(state, "vpp_size", None)
    if state_vpp is not None and state_vpp != len(chunks):
        raise ValueError(f"model has {len(chunks)} chunks but the state's vpp_size is "
                         f"{state_vpp}")
    if microbatch_group_size is None:
        config = _unwrap_config(chunks[0])
        microbatch_group_size = getattr(config, "microbatch_group_size_per_vp_stage", None)
    return _pipelined("interleaved", forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape, timers,
                      microbatch_group_size)


def forward_backward_pipelining_zb_h1(
        forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=False, state=None, tensor_shape=None, timers=None):
    """Zero-bubble ZB-H1 (one chunk per rank, :mod:`tpfuse.pipeline.zero_bubble`): backward split
    into I (input gradient, sent upstream at once) and W (the weight gradients the I pass
    deferred, run where 1F1B would idle). Same results as 1F1B."""
    _check_counts(num_microbatches)
    state = resolve_state(state)
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"ZB-H1 runs one model chunk per rank, got {len(chunks)}")
    return _pipelined("zb-h1", forward_step_func, data_iterator, chunks, num_microbatches,
                      seq_length, micro_batch_size, forward_only, state, tensor_shape, timers)


_SCHEDULES = {"1f1b": forward_backward_pipelining_without_interleaving,
              "interleaved": forward_backward_pipelining_with_interleaving,
              "zb-h1": forward_backward_pipelining_zb_h1}
