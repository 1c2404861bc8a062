"""megatron-core 0.16's ``pipeline_parallel.schedules`` on tpfuse's executor.

``get_forward_backward_func(pp_size=None, vp_size=None)`` returns one of the three schedule
functions itself; each takes Megatron's keywords (all keyword-only): ``forward_step_func,
data_iterator, model, num_microbatches, seq_length, micro_batch_size, decoder_seq_length=None,
forward_only=False, collect_non_loss_data=False, first_val_step=None,
adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
force_all_reduce=False`` and returns the list of what the loss function reduced (last stage;
``[]`` elsewhere). As in Megatron, ``model[0].config`` (a ModelParallelConfig) provides
``pipeline_dtype`` (tensors between stages), ``hidden_size``, ``sequence_parallel``,
``calculate_per_token_loss``, ``grad_scale_func``, ``enable_autocast`` / ``autocast_dtype``,
``timers``, ``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func`` and
``finalize_model_grads_func`` (called once after the backward passes).

A loss function may return ``(loss, reduced)`` (loss × cp / m before backward) or
``(loss, num_tokens, reduced)`` (loss / num_tokens / m, or untouched with
``calculate_per_token_loss``). Gradient synchronisation hooks run without overlap: the whole
schedule runs inside ``no_sync_func()`` (a list of them, one per model chunk, entered together),
then ``grad_sync_func`` per chunk (one, or a list), then ``finalize_model_grads_func`` — the
same gradients, reduced after the last backward.

As Megatron's, the interleaved schedule ignores ``decoder_seq_length`` (its tensors are
``seq_length`` long) and checks ``microbatch_group_size_per_vp_stage`` g at the call:
p ≤ g ≤ m else ValueError, m mod g = 0 or ≥ p else RuntimeError.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.variable import Variable

from tpfuse.models.gpt import resolve_state
from tpfuse.pipeline import executor as _executor

from .. import parallel_state as _mpu


def get_forward_backward_func(pp_size=None, vp_size=None):
    """The schedule for (pp, vpp), from ``parallel_state`` when both are None."""
    if pp_size is None and vp_size is None:
        pp_size = _mpu.get_pipeline_model_parallel_world_size()
        vp_size = _mpu.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def get_model_config(model):
    """``model.config`` of a module or of the module it wraps (``.module``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "config"):
        raise ValueError(f"{type(model).__name__} has no .config (a ModelParallelConfig); "
                         "Megatron's schedules read it from the model")
    return model.config


def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
    """Free ``out``'s storage after its send (its ``grad_fn`` survives), if asked."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if not isinstance(out, torch.Tensor) or out._base is not None:
        raise ValueError("deallocate_output_tensor needs a tensor that is not a view")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output, grad_output):
    """Backward through the autograd engine directly (no shape check against a deallocated
    ``output``)."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    Variable._execution_engine.run_backward((output,), (grad_output,), False, False, (), True,
                                            True)


def get_tensor_shapes(*, seq_length, micro_batch_size, decoder_seq_length, config, tp_group,
                      cp_group):
    """``[(s / cp [/ tp with sequence parallelism], b, h)]``."""
    seq = (decoder_seq_length if decoder_seq_length is not None else seq_length)
    seq //= cp_group.size()
    if config.sequence_parallel:
        seq //= tp_group.size()
    return [(seq, micro_batch_size, config.hidden_size)]


class _Step:
    """Megatron's forward_step / loss handling around the user's callbacks, for one call."""

    def __init__(self, forward_step_func, config, num_microbatches, forward_only,
                 collect_non_loss_data, cp_size, device):
        self.forward_step_func, self.config = forward_step_func, config
        self.num_microbatches, self.forward_only = num_microbatches, forward_only
        self.collect_non_loss_data, self.cp_size = collect_non_loss_data, cp_size
        # on the model's device, as Megatron keeps it: finalize_model_grads_func may all-reduce it
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)

    def __call__(self, data_iterator, chunk):
        autocast = contextlib.nullcontext()
        if getattr(self.config, "enable_autocast", False):
            device = next(chunk.parameters()).device.type
            autocast = torch.autocast(device, dtype=self.config.autocast_dtype)
        with autocast:
            output, loss_func = self.forward_step_func(data_iterator, chunk)
        return output, (lambda out: self.loss(loss_func, out))

    def loss(self, loss_func, output):
        """(loss that the executor divides by m, what goes into the returned list)."""
        if loss_func is None:
            return torch.zeros((), device=output.device), output
        if self.collect_non_loss_data:
            return torch.zeros((), device=output.device), loss_func(output, non_loss_data=True)
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            self.total_num_tokens += torch.as_tensor(
                num_tokens, device=self.total_num_tokens.device).to(torch.int)
            if self.config.calculate_per_token_loss:
                loss = loss * self.num_microbatches            # Megatron divides by nothing
            else:
                loss = loss / torch.clamp(torch.as_tensor(num_tokens, device=loss.device), min=1)
        elif len(outputs) == 2:
            loss, reduced = outputs
            loss = loss * self.cp_size
        else:
            raise ValueError(f"loss_func must return 2 or 3 values, got {len(outputs)}")
        scale = getattr(self.config, "grad_scale_func", None)
        if scale is not None and not self.forward_only:
            loss = scale(loss)
        return loss, reduced


def _device_of(chunk) -> torch.device:
    parameter = next(chunk.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _call_per_chunk(funcs, chunks):
    if funcs is None:
        return
    funcs = funcs if isinstance(funcs, (list, tuple)) else [funcs] * len(chunks)
    for func, chunk in zip(funcs, chunks):
        func(chunk.parameters())


def _no_sync_context(no_sync_func):
    """``no_sync_func()``; a list (one per model chunk, Megatron's virtual pipeline) entered
    together; nothing when None."""
    if no_sync_func is None:
        return contextlib.nullcontext()
    if not isinstance(no_sync_func, (list, tuple)):
        return no_sync_func()
    stack = contextlib.ExitStack()
    for chunk_no_sync in no_sync_func:
        stack.enter_context(chunk_no_sync())
    return stack


def _run(native, interleaved, *, forward_step_func, data_iterator, model, num_microbatches,
         seq_length, micro_batch_size, decoder_seq_length=None, forward_only=False,
         collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
         p2p_communicator=None, pg_collection=None, force_all_reduce=False):
    if p2p_communicator is not None or pg_collection is not None:
        raise ValueError("p2p_communicator / pg_collection are not supported: tpfuse's "
                         "schedules use the groups of parallel_state's default state")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not interleaved and len(chunks) != 1:
        raise ValueError(f"this schedule runs one model chunk, got {len(chunks)}")
    config = get_model_config(chunks[0])
    state = resolve_state()                     # None only in a plain single process
    step = _Step(forward_step_func, config, num_microbatches, forward_only,
                 collect_non_loss_data, state.cp_size if state is not None else 1,
                 _device_of(chunks[0]))
    shape = _tensor_shape(config, state, seq_length, micro_batch_size, decoder_seq_length,
                          adjust_tensor_shapes_fn)
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("forward-backward", log_level=1).start(
            barrier=getattr(config, "barrier_with_L1_time", False))
    if not forward_only:
        _call_per_chunk(getattr(config, "param_sync_func", None), chunks)
    with _no_sync_context(getattr(config, "no_sync_func", None)):
        store = native(step, data_iterator, chunks if interleaved else chunks[0],
                       num_microbatches, seq_length, micro_batch_size,
                       forward_only=forward_only, state=state, tensor_shape=shape)
    if not forward_only:
        _call_per_chunk(getattr(config, "grad_sync_func", None), chunks)
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is not None:
            tokens = step.total_num_tokens if config.calculate_per_token_loss else None
            finalize(chunks, tokens, pg_collection=None, force_all_reduce=force_all_reduce)
    if timers is not None:
        timers("forward-backward").stop()
    return store


def _tensor_shape(config, state, seq_length, micro_batch_size, decoder_seq_length, adjust):
    """The one shape sent between stages (``get_tensor_shapes`` over the state's groups), after
    ``adjust_tensor_shapes_fn``; None in a plain single process or without a sequence length."""
    seq = decoder_seq_length if decoder_seq_length is not None else seq_length
    if state is None or seq is None:
        return None
    shape, = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                               decoder_seq_length=decoder_seq_length, config=config,
                               tp_group=state.tp_group, cp_group=state.cp_group)
    if adjust is not None:
        recv, send = adjust([shape], [shape])
        if len(recv) != 1 or list(recv) != list(send):
            raise ValueError("adjust_tensor_shapes_fn must keep one shape, the same for "
                             f"receiving and sending; got {recv} and {send}")
        shape = tuple(recv[0])
    return shape


def forward_backward_no_pipelining(**kwargs):
    """Gradient accumulation over the micro-batches on one stage."""
    if kwargs.get("adjust_tensor_shapes_fn") is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported without pipelining")
    if isinstance(kwargs.get("data_iterator"), list):
        if len(kwargs["data_iterator"]) != 1:
            raise ValueError("without pipelining data_iterator is one iterator (or a list of 1)")
        kwargs["data_iterator"] = kwargs["data_iterator"][0]
    return _run(_no_pipelining, False, **kwargs)


def _no_pipelining(step, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                   forward_only, state, tensor_shape):
    return _executor.forward_backward_no_pipelining(
        step, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
        forward_only=forward_only, state=state)


def forward_backward_pipelining_without_interleaving(**kwargs):
    """1F1B over the pipeline."""
    if isinstance(kwargs.get("data_iterator"), list):
        if len(kwargs["data_iterator"]) != 1:
            raise ValueError("non-interleaved pipelining takes one data iterator")
        kwargs["data_iterator"] = kwargs["data_iterator"][0]
    return _run(_executor.forward_backward_pipelining_without_interleaving, False, **kwargs)


def forward_backward_pipelining_with_interleaving(**kwargs):
    """Megatron's interleaved 1F1B over the model chunks (one per virtual stage)."""
    if kwargs.get("adjust_tensor_shapes_fn") is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported with interleaving "
                         "(as in Megatron)")
    kwargs.pop("decoder_seq_length", None)   # Megatron's interleaved schedule ignores it
    _check_interleaved_groups(kwargs.get("model"), kwargs.get("num_microbatches"))
    return _run(_executor.forward_backward_pipelining_with_interleaving, True, **kwargs)


def _check_interleaved_groups(model, num_microbatches) -> None:
    """Megatron's checks of ``microbatch_group_size_per_vp_stage`` g at the call, with its
    exception types: p ≤ g ≤ m (ValueError) and m mod g == 0 or ≥ p (RuntimeError)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    config = getattr(chunks[0], "config", None) if chunks and chunks[0] is not None else None
    group_size = getattr(config, "microbatch_group_size_per_vp_stage", None)
    if group_size is None or not isinstance(num_microbatches, int) \
            or not _mpu.model_parallel_is_initialized():
        return            # the native schedule checks (and names) what is missing
    pp = _mpu.get_pipeline_model_parallel_world_size()
    if not pp <= group_size <= num_microbatches:
        raise ValueError(f"microbatch_group_size_per_vp_stage={group_size} must lie in "
                         f"[pp={pp}, num_microbatches={num_microbatches}]")
    remainder = num_microbatches % group_size
    if 0 < remainder < pp:
        raise RuntimeError(f"num_microbatches={num_microbatches} mod "
                           f"microbatch_group_size_per_vp_stage={group_size} = {remainder}: "
                           f"must be 0 or >= pp={pp} (a shorter last group leaves bubbles)")
