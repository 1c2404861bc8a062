"""``pretrain``: the training loop that owns scheduling, the optimizer step and checkpoints.

The user supplies three callbacks, as in Megatron:

- ``train_valid_test_datasets_provider([n_train, n_valid, n_test]) -> (train, valid, test)``
  (datasets of sample dicts);
- ``model_provider(pre_process, post_process, vp_stage=None, config=None) -> nn.Module``
  (``build_model`` passes ``config``, the TransformerConfig, to a provider that takes it);
- ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.

Settings reach a callback explicitly, never through a global (no ``get_args()``): a keyword-only
parameter named after a settings group (``data``, ``training``, ... of ``TrainerSettings``),
``config`` (the TransformerConfig) or ``tokenizer`` is bound to this run's value before the
callback is used (``bind_settings``), e.g. ``def forward_step(data_iterator, model, *, data,
config)``; the schedules still call ``forward_step(data_iterator, model)``.

One optimizer step::

    m = micro-batch calculator(consumed samples)                   (ramp-up aware)
    forward_backward_func(...)      # pipeline schedule over m micro-batches; loss · scale / m
    DP gradient reduction           # main_grad buffers, bucketed (training/data_parallel.py)
    tied-embedding gradient sync    # first ↔ last pipeline stage
    expert-bias update              # --moe-router-enable-expert-bias (moe/expert_bias.py)
    optimizer step                  # unscale, global norm, clip, AdamW on fp32 main params
    lr schedule step                # not on a skipped (non-finite) step

(training/train_step.py holds the optimizer side of the step.)
"""
from __future__ import annotations

import functools
import math
import inspect
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpfuse.checkpoint import format as ckpt
from tpfuse.checkpoint import torch_dist_format
from tpfuse.moe.expert_bias import update_expert_biases
from tpfuse.parallel import parallel_state
from tpfuse.parallel.devices import model_device
from tpfuse.parallel.microbatches import MicrobatchCalculator
from tpfuse.runtime.initialize import check_layout, initialize_distributed
from tpfuse.training.arguments import parse_args
from tpfuse.training.checkpointing import (Checkpointing, describe_exit, prepare_save_dir,
                                           resume_point, resume_position)
from tpfuse.training.logging_utils import TrainingLogger
from tpfuse.training.observability import RunMonitor
from tpfuse.training.memory import memory_plan_report, memory_record, memory_report
from tpfuse.training.moe_logging import router_metrics
from tpfuse.training.mtp_logging import mtp_metrics
from tpfuse.training.sample_args import describe_sampling, sampling_kwargs
from tpfuse.training.scheduler import LRScheduler
from tpfuse.training.garbage_collection import ManualGC
from tpfuse.training.host_memory import keep_freed_host_memory
from tpfuse.training.timers import Timers
from tpfuse.training.train_samples import iterations_for_samples, lr_schedule, wsd_decay_length
from tpfuse.training.train_step import (NonFinitePolicy, build_buffers_and_optimizer,
                                        loss_nonfinite, loss_scaled)


@dataclass
class TrainingResult:
    """What one rank saw; losses are filled on the logging rank (last stage, tp/dp rank 0)."""
    is_logger: bool
    iterations: list = field(default_factory=list)
    train_losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    valid_losses: list = field(default_factory=list)   # (iteration, loss)
    consumed_samples: int = 0
    exit_reason: str | None = None                     # why training stopped before train_iters
    sample: str | None = None     # --sample-prompt's continuation (data-parallel rank 0 replica)
    skipped: list = field(default_factory=list)        # every rank: step skipped (inf/nan)?
    loss_scales: list = field(default_factory=list)    # every rank: the scale after the step


@dataclass(frozen=True)
class RunLength:
    """What the settings leave to the layout: the global batch (default micro × dp) and the
    optimizer steps (a sample-based run's follow from its samples and the batch ramp-up)."""
    global_batch_size: int
    train_iters: int


class _Run:
    """Everything one training process holds; methods are the loop's steps."""

    def __init__(self, config, settings, length: RunLength, model_provider, forward_step,
                 datasets_provider):
        from tpfuse.models import build_model
        from tpfuse.pipeline import get_forward_backward_func

        self.config, self.settings, self.length = config, settings, length
        training, checkpoint = settings.training, settings.checkpoint
        self.forward_step = forward_step
        self.state = parallel_state.get_default_state()
        self.device = model_device(settings.distributed.device)
        self.model = [chunk.to(self.device) for chunk in build_model(model_provider, config)]
        resumes = checkpoint.load and resume_point(checkpoint.load,
                                                   checkpoint.exit_on_missing_checkpoint)
        if resumes and (checkpoint.finetune or checkpoint.no_load_optim):
            torch_dist_format.load_weights_only_any(checkpoint.load, self.model,
                                                    self.state)  # before the optimizer
        self.params = [p for chunk in self.model for p in chunk.parameters() if p.requires_grad]
        self.ddp, self.optimizer = build_buffers_and_optimizer(
            self.model, config, self.state, optimizer=settings.optimizer,
            precision=settings.precision, data_parallel=settings.data_parallel,
            lr=settings.scheduler.lr)
        self.nonfinite = NonFinitePolicy(self.optimizer.grad_scaler is not None,
                                         settings.precision.skip_nonfinite,
                                         settings.precision.max_consecutive_skipped_steps)
        self.scheduler = _build_scheduler(self.optimizer, training, settings.scheduler)
        self.forward_backward = get_forward_backward_func(self.state, config.pipeline_schedule)
        self.timers = Timers(settings.timing.timing_log_level, settings.timing.timing_log_option,
                             self.device)
        self.calculator = MicrobatchCalculator(
            length.global_batch_size, training.micro_batch_size, self.state.dp_size,
            rampup_batch_size=training.rampup_batch_size)
        self.iteration, self.consumed_samples, self.resumed_from = 0, 0, None
        self.is_logger = (self.state.is_pipeline_last_stage() and self.state.tp_rank == 0
                          and self.state.dp_rank == 0 and self.state.rank_in("cp") == 0)
        if resumes and checkpoint.no_load_optim:
            loaded = resume_position(checkpoint.load)
            self.iteration, self.consumed_samples = loaded["iteration"], loaded["consumed_samples"]
            self.resumed_from = self.iteration
        elif resumes and not checkpoint.finetune:
            loaded = torch_dist_format.load_any(
                checkpoint.load, self.model, self.optimizer, self.scheduler, self.state,
                settings.scheduler.use_checkpoint_opt_param_scheduler)
            self.iteration, self.consumed_samples = loaded["iteration"], loaded["consumed_samples"]
            self.resumed_from = self.iteration
        self.train_ds, self.valid_ds = self._build_datasets(datasets_provider)

    # ------------------------------------------------------------------ data
    def _build_datasets(self, datasets_provider):
        evaluation, length = self.settings.evaluation, self.length
        # every evaluation reads the same first eval_iters global batches of the validation set,
        # so successive validation losses are comparable
        evaluates = evaluation.eval_at_start or evaluation.eval_interval <= length.train_iters
        eval_samples = evaluation.eval_iters * length.global_batch_size if evaluates else 0
        train_samples = (self.settings.training.train_samples
                         or length.train_iters * length.global_batch_size)
        train, valid, _ = datasets_provider([train_samples, eval_samples, 0])
        for dataset in (train, valid):
            if getattr(dataset, "variable_seq_lengths", False) and \
                    not self.config.variable_seq_lengths:
                raise ValueError(f"{type(dataset).__name__} yields micro-batches of varying "
                                 f"sequence lengths: pass --variable-seq-lengths")
        return train, valid

    def _iterators(self, dataset, consumed_samples: int):
        """One iterator per model chunk, each over the same micro-batch sequence of this DP rank."""
        from tpfuse.data.sampler import build_pretraining_data_loader

        return [_length_checked(iter(build_pretraining_data_loader(
            dataset, consumed_samples, self.settings.training.micro_batch_size, self.state.dp_rank,
            self.state.dp_size)), self.config) for _ in self.model]

    # ------------------------------------------------------------------ one step
    def _mean_loss(self, loss_dicts) -> float | None:
        """Average of the micro-batch losses, then over DP (on the last stage; None elsewhere)."""
        if not self.state.is_pipeline_last_stage():
            return None
        values = torch.stack([d["lm loss"].detach().float().reshape(()) for d in loss_dicts])
        # the count joins the sum on the losses' own device (CUDA under NCCL) for the all-reduce
        total = torch.stack([values.sum(), values.new_tensor(float(len(values)))])
        if self.state.dp_size > 1:
            dist.all_reduce(total, group=self.state.dp_group)
        return (total[0] / total[1]).item()

    def train_step(self, iterators):
        """One optimizer step → (mean loss or None, the optimizer's StepResult)."""
        from tpfuse.models import allreduce_embedding_grads

        for chunk in self.model:
            chunk.train()
            _set_dropout_sample_offset(chunk, self.consumed_samples)
        num_microbatches = self.calculator.num_microbatches
        self.ddp.zero_grad_buffer()
        self.ddp.begin_step(num_microbatches)
        timers = self.timers
        timers("forward-backward", 1).start(barrier=self.settings.timing.barrier_with_L1_time)
        loss_dicts = self.forward_backward(
            forward_step_func=loss_scaled(self.forward_step, self.optimizer),
            data_iterator=iterators, model=self.model,
            num_microbatches=num_microbatches, seq_length=self.config.seq_length,
            micro_batch_size=self.settings.training.micro_batch_size, forward_only=False,
            state=self.state,
            timers=timers if timers.log_level >= 2 else None)
        timers("forward-backward", 1).stop()
        with timers("all-grads-sync", 1):
            self.ddp.finish_grad_sync()
        with timers("embedding-grads-all-reduce", 1):
            allreduce_embedding_grads(self.model, self.state)
        if self.config.moe_router_enable_expert_bias:   # Megatron's finalize_model_grads does it
            update_expert_biases(self.model, self.config.moe_router_bias_update_rate,
                                 self.state.group("tp-dp-cp"))
        with timers("optimizer", 1):
            result = self.optimizer.step(loss_nonfinite(loss_dicts, self.device))
        if result.success:       # samples: this step's global batch (Megatron's increment)
            self.scheduler.step(self.calculator.current_global_batch_size
                                if self.scheduler.unit == "samples" else 1)
        return self._mean_loss(loss_dicts), result

    @torch.no_grad()
    def evaluate(self) -> float | None:
        eval_iters = self.settings.evaluation.eval_iters
        micro_batch_size = self.settings.training.micro_batch_size
        if self.valid_ds is None or eval_iters == 0:
            return None
        for chunk in self.model:
            chunk.eval()
        iterators = self._iterators(self.valid_ds, 0)
        num_microbatches = self.length.global_batch_size // (micro_batch_size * self.state.dp_size)
        losses = []
        for _ in range(eval_iters):
            loss_dicts = self.forward_backward(
                forward_step_func=self.forward_step, data_iterator=iterators, model=self.model,
                num_microbatches=num_microbatches, seq_length=self.config.seq_length,
                micro_batch_size=micro_batch_size, forward_only=True, state=self.state)
            losses.append(self._mean_loss(loss_dicts))
        return None if losses[0] is None else sum(losses) / len(losses)

    def prepare_save(self) -> dict:
        """Before a checkpoint: parameters complete (distributed optimizer); returns what the
        checkpoint records besides the state (the tokenizer, for inference)."""
        self.ddp.finish_param_sync()
        return {"tokenizer": tokenizer_spec(self.settings.tokenizer)}

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainingResult:
        settings, train_iters = self.settings, self.length.train_iters
        evaluation, logging, checkpoint = settings.evaluation, settings.logging, settings.checkpoint
        result = TrainingResult(is_logger=self.is_logger)
        monitor = RunMonitor(settings.observability, self.config, self.is_logger, dist.get_rank(),
                             dist.get_world_size(), metrics_file=logging.metrics_file,
                             run_values=run_values(settings, self.config, self.length))
        logger = TrainingLogger(self.is_logger, train_iters, self.iteration,
                                logging.metrics_file, progress_bar=not logging.no_progress_bar,
                                sinks=monitor.sinks,
                                show_throughput=settings.observability.log_throughput,
                                evaluates_at_start=evaluation.eval_at_start)
        checkpointing = Checkpointing(checkpoint, resumed_from=self.resumed_from)
        collector = ManualGC(settings.gc)
        self.calculator.update(self.consumed_samples, consistency_check=True)
        iterators = self._iterators(self.train_ds, self.consumed_samples)
        tokens_per_sample = self.config.seq_length
        logger.write_metrics(memory_record(self.optimizer, self.iteration, dist.get_rank()))
        if logging.log_memory_plan:      # every rank: its own held bytes against the plan
            print(memory_plan_report(self.optimizer, self.config, settings,
                                     dist.get_world_size(), dist.get_rank()), flush=True)
        logger.print(memory_report(self.optimizer, self.config, self.state.dp_size,
                                   settings.training.micro_batch_size,
                                   self.calculator.num_microbatches))
        try:
            collector.start()
            if evaluation.eval_at_start:
                self._evaluate_and_log(logger, result, collector)
            while self.iteration < train_iters:
                monitor.before_iteration(self.iteration + 1)
                self.calculator.update(self.consumed_samples, consistency_check=True)
                batch = self.calculator.current_global_batch_size
                lr = self.scheduler.lr
                start = time.perf_counter()
                loss, step = self.train_step(iterators)
                elapsed = time.perf_counter() - start
                self.iteration += 1
                self.consumed_samples += batch
                record = {"loss": loss, "lr": lr,
                          "consumed_samples": self.consumed_samples, "global_batch_size": batch,
                          "ms_per_iter": 1000 * elapsed,
                          "tokens_per_s": batch * tokens_per_sample / elapsed,
                          **monitor.measure(batch, elapsed),
                          **self.nonfinite.after_step(self.iteration, step, self.optimizer,
                                                      self.device)}
                result.skipped.append(record["skipped"])
                result.loss_scales.append(self.optimizer.loss_scale)
                timing = self.timers.step_summary(self.device)   # every rank (a gather)
                if timing:
                    record["timers_ms"] = timing
                record.update(router_metrics(self.model, self.config, self.state,
                                             self.calculator.num_microbatches, self.device))
                record.update(mtp_metrics(self.model, self.config, self.state,
                                          self.calculator.num_microbatches, self.device))
                if self.is_logger:
                    result.iterations.append(self.iteration)
                    result.train_losses.append(loss)
                    result.grad_norms.append(record["grad_norm"])
                logger.iteration(self.iteration, record,
                                 log_now=self.iteration % logging.log_interval == 0)
                if timing and self.iteration % logging.log_interval == 0:
                    logger.print(self.timers.interval_text())
                collector.after_iteration(self.iteration)
                if evaluation.eval_interval and self.iteration % evaluation.eval_interval == 0:
                    self._evaluate_and_log(logger, result, collector)
                result.exit_reason = checkpointing.after_iteration(self)
                if result.exit_reason:
                    logger.print(describe_exit(result.exit_reason, bool(checkpoint.save),
                                               checkpoint.save))
                    break
            self._check_finite_end(result)
            checkpointing.finish(self)
        finally:
            collector.stop()
            checkpointing.close()
            logger.close()
            monitor.close()
        self.ddp.finish_param_sync()
        result.consumed_samples = self.consumed_samples
        return result

    def _check_finite_end(self, result) -> None:
        """Collective: a run whose final weights (any rank) or last loss are non-finite ends with
        a FloatingPointError on every rank, not a success."""
        bad = ckpt.first_non_finite(self.model)
        loss = result.train_losses[-1] if result.train_losses else None
        if bad is None and loss is not None and not math.isfinite(loss):
            bad = f"the last training loss ({loss})"
        error = FloatingPointError(f"training ended at iteration {self.iteration} with non-finite "
                                   f"values: {bad}") if bad else None
        ckpt.agree(error, f"training (iteration {self.iteration})")

    def _evaluate_and_log(self, logger, result, collector) -> None:
        with collector.around_evaluation():
            valid_loss = self.evaluate()
        if valid_loss is not None and self.is_logger:
            result.valid_losses.append((self.iteration, valid_loss))
            logger.print(f" validation loss at iteration {self.iteration} | lm loss: "
                         f"{valid_loss:.6E} |")
            logger.write_metrics({"iteration": self.iteration, "valid_loss": valid_loss})


def _length_checked(iterator, config):
    """``iterator``'s micro-batches, each ``tokens`` length checked against the flags before a
    chunk runs it (``data.variable_length.check_micro_batch_length``): without
    --variable-seq-lengths a length other than --seq-length is an error naming the flag, with it
    one that context or sequence parallelism cannot split."""
    from tpfuse.data.variable_length import check_micro_batch_length

    for batch in iterator:
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        if tokens is not None:
            check_micro_batch_length(tokens.shape[-1], config.seq_length,
                                     config.variable_seq_lengths,
                                     config.tensor_model_parallel_size,
                                     config.context_parallel_size, config.sequence_parallel)
        yield batch


def _set_dropout_sample_offset(chunk, consumed_samples: int) -> None:
    """Tell a model chunk (or the module a wrapper holds) where the step's samples start, so its
    dropout masks follow the global sample index (models without the hook are left alone)."""
    target = chunk
    while not hasattr(target, "set_dropout_sample_offset") and hasattr(target, "module"):
        target = target.module
    if hasattr(target, "set_dropout_sample_offset"):
        target.set_dropout_sample_offset(consumed_samples)


def tokenizer_spec(tokenizer) -> str:
    """What checkpoints record of the tokenizer, in ``data.tokenizer.build_tokenizer``'s terms:
    ``"byte"``, ``"null:N"``, the absolute path of a tokenizer.json, or the JSON object of
    Megatron's tokenizer flags (``data/tokenizer_options.py``)."""
    name = tokenizer.name
    return name[len("hf:"):] if name.startswith("hf:") else name


def _build_scheduler(optimizer, training, scheduler) -> LRScheduler:
    """The LRScheduler of SchedulerSettings, in the run length's unit (TrainingSettings)."""
    warmup, decay, unit = lr_schedule(training, scheduler)
    return LRScheduler(optimizer, scheduler.lr, scheduler.min_lr, warmup, decay,
                       scheduler.lr_decay_style, unit,
                       wsd_decay_steps=wsd_decay_length(training, scheduler),
                       wsd_decay_style=scheduler.lr_wsd_decay_style)


def run_length(training, dp_size: int) -> RunLength:
    """The global batch (default micro × dp) and, for a sample-based run, its iterations."""
    global_batch = training.global_batch_size or training.micro_batch_size * dp_size
    if training.train_samples is None:
        return RunLength(global_batch, training.train_iters)
    calculator = MicrobatchCalculator(global_batch, training.micro_batch_size, dp_size,
                                      rampup_batch_size=training.rampup_batch_size)
    train_iters = iterations_for_samples(training.train_samples, calculator)
    if train_iters == 0:
        raise ValueError(f"--train-samples {training.train_samples} holds no complete global "
                         f"batch ({calculator.current_global_batch_size} samples)")
    return RunLength(global_batch, train_iters)


def run_values(settings, config, length: RunLength) -> dict:
    """Every flag's value (the model's and the trainer's) with the run length the layout gave,
    for a metrics sink's run config."""
    from tpfuse.models.cli import config_to_dict

    return {**config_to_dict(config), **settings.values(),
            "global_batch_size": length.global_batch_size, "train_iters": length.train_iters}


BINDABLE = ("config", "tokenizer")      # besides the settings groups' names


def bind_settings(callback, settings, config):
    """``callback`` with each keyword-only parameter named after a settings group (``data``,
    ``training``, ...), ``config`` or ``tokenizer`` bound to this run's value; the callback
    itself when it declares none. A keyword-only parameter without a default that is none of
    these is a ValueError naming it (raised before any process group is used)."""
    available = {**settings.groups(), "config": config, "tokenizer": settings.tokenizer}
    try:
        parameters = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):           # a builtin or C callable: nothing to bind
        return callback
    bound = {}
    for parameter in parameters:
        if parameter.kind is not parameter.KEYWORD_ONLY:
            continue
        if parameter.name in available:
            bound[parameter.name] = available[parameter.name]
        elif parameter.default is parameter.empty:
            raise ValueError(f"{getattr(callback, '__name__', callback)!s} takes the keyword "
                             f"{parameter.name!r}, which pretrain cannot give (it binds "
                             f"{', '.join(sorted(available))})")
    return functools.partial(callback, **bound) if bound else callback


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
             args_defaults: dict | None = None, argv=None, sample_func=None) -> TrainingResult:
    """Parse flags, set up every group, train; returns this rank's TrainingResult. The callbacks
    receive settings through ``bind_settings`` (see the module docstring).

    ``sample_func(model_chunks, tokenizer, prompt, max_new_tokens, state, **decoding) -> str |
    None`` continues ``--sample-prompt`` once training is done, on every rank (None where a rank
    takes no part); ``tpfuse.pretrain_gpt`` passes ``tpfuse.inference.sample.training_sample``.
    The trainer imports no inference: without ``sample_func`` a ``--sample-prompt`` is refused
    before any process group exists."""
    config, settings = parse_args(argv, args_defaults)
    prompt = settings.sample.sample_prompt
    if prompt and sample_func is None:
        raise ValueError(f"--sample-prompt {prompt!r} needs a sample function: "
                         "pretrain(..., sample_func=...) (python -m tpfuse.pretrain_gpt and "
                         "tpfuse-train pass tpfuse.inference.sample.training_sample)")
    callbacks = [bind_settings(callback, settings, config) for callback in
                 (train_valid_test_datasets_provider, model_provider, forward_step)]
    distributed = settings.distributed
    initialize_distributed(distributed.distributed_backend,
                           distributed.distributed_timeout_minutes, distributed.device)
    if model_device(distributed.device).type == "cpu":
        keep_freed_host_memory()         # activations reused step to step, not re-faulted
    check_layout(config)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=(
            settings.data_parallel.num_distributed_optimizer_instances))
    parallel_state.get_default_state().comm_options = settings.distributed.comm_options()
    if dist.get_rank() == 0 and not settings.logging.no_layout_table:
        from tpfuse.parallel.report import format_layout_table

        state = parallel_state.get_default_state()
        print(format_layout_table(state.layout, vpp=state.vpp_size), flush=True)
    length = run_length(settings.training, parallel_state.get_data_parallel_world_size())
    if settings.checkpoint.save:
        prepare_save_dir(settings.checkpoint.save)
    from tpfuse.tp_layers.random import model_parallel_seed

    torch.manual_seed(config.seed)          # the default generator: replicated-region dropout
    model_parallel_seed(config.seed)        # the tracker's streams (it leaves the default alone)
    datasets_provider, model_provider, forward_step = callbacks
    run = _Run(config, settings, length, model_provider, forward_step, datasets_provider)
    if run.is_logger:
        run_banner(run)
    try:
        result = run.train()
        if prompt:
            result.sample = print_sample(run, sample_func)
    finally:
        # the gradient hooks live on autograd's C++ nodes, where the garbage collector cannot see
        # the cycle they close (hook -> buffers -> parameters -> node): removed, the run's model,
        # buffers and process groups are freed once the caller drops them
        run.ddp.remove_hooks()
    return result


def print_sample(run, training_sample) -> str | None:
    """The trained model's continuation of ``--sample-prompt`` (printed by rank 0);
    ``training_sample``: ``pretrain``'s ``sample_func``."""
    run.ddp.finish_param_sync()
    sample = run.settings.sample
    text = training_sample(run.model, run.settings.tokenizer, sample.sample_prompt,
                           sample.sample_max_new_tokens, run.state, **sampling_kwargs(sample))
    if dist.get_rank() == 0:
        print(f"> sample after {run.iteration} iterations ({describe_sampling(sample)}, "
              f"--sample-prompt {sample.sample_prompt!r}):\n{text}", flush=True)
    return text


def run_banner(run) -> None:
    config, state = run.config, run.state
    params = sum(p.numel() for p in run.params)
    preset = f"preset {run.settings.preset} | " if run.settings.preset else ""
    comm_type = f" ({config.cp_comm_type})" if state.cp_size > 1 else ""
    experts = (f"{config.num_moe_experts} experts (top-{config.moe_router_topk}) ep={state.ep_size} "
               f"etp={state.etp_size} edp={state.edp_size} | " if config.num_moe_experts else "")
    print(f"> tpfuse: {preset}tp={state.tp_size} pp={state.pp_size} vpp={state.vpp_size or 1} "
          f"dp={state.dp_size} cp={state.cp_size}{comm_type} "
          f"sequence_parallel={config.sequence_parallel} | {experts}"
          f"{config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads, seq {config.seq_length} | "
          f"parameters on this rank: {params:,}", flush=True)
