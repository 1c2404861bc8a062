"""Megatron's sample-based training: ``--train-samples`` in place of ``--train-iters``, with the
learning-rate schedule in samples (``--lr-warmup-samples``, ``--lr-decay-samples``).

A run is either iteration-based (``--train-iters``, ``--lr-warmup-iters``, ``--lr-decay-iters``) or
sample-based (``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``); mixing the two
forms, or giving neither length, is a ValueError naming the flags, raised while parsing (before
any process group exists).

Iterations. With a constant global batch B, ``train_iters = train_samples // B`` (a partial last
batch is dropped). With ``--rampup-batch-size start increment ramp_samples`` the steps follow the
ramp's batch sizes while the consumed samples are ≤ ramp_samples, then full batches of B
(Megatron's ``update_train_iters``)::

    consumed = iterations = 0
    while consumed ≤ ramp_samples:  consumed += batch(consumed);  iterations += 1
    train_iters = iterations + (train_samples − consumed) // B

Where ``train_samples`` ends inside the ramp (Megatron's formula would subtract), the count is the
ramp steps whose batches fit in ``train_samples`` — the same rule, applied to the ramp.

Schedule. The scheduler then counts consumed samples, as Megatron's does: warm-up over
``lr_warmup_samples``, decay until ``lr_decay_samples`` (default ``train_samples``), advanced by
each applied step's global batch (a skipped step advances nothing).
"""
from __future__ import annotations

ITERATION_FORM = ("train_iters", "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters")
SAMPLE_FORM = ("train_samples", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples")
_UNSET = {"lr_warmup_iters": 0, "lr_warmup_samples": 0}       # the others: None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(training, scheduler, name: str):
    """A run-length setting (``train_*``, TrainingSettings) or a schedule one
    (SchedulerSettings)."""
    return getattr(training if name.startswith("train_") else scheduler, name)


def is_sample_based(training) -> bool:
    return training.train_samples is not None


def check_iterations_or_samples(training, scheduler) -> None:
    """Exactly one of --train-iters / --train-samples (TrainingSettings), and schedule flags
    (SchedulerSettings) of the same form."""
    if training.train_iters is None and training.train_samples is None:
        raise ValueError("--train-iters is required (or --train-samples for sample-based "
                         "training; Megatron has no default for either)")
    if training.train_iters is not None and training.train_samples is not None:
        raise ValueError(f"--train-iters ({training.train_iters}) and --train-samples "
                         f"({training.train_samples}) are exclusive: give one")
    mine, other = (SAMPLE_FORM, ITERATION_FORM) if is_sample_based(training) else \
        (ITERATION_FORM, SAMPLE_FORM)
    for name in other[1:]:
        value = _value(training, scheduler, name)
        if value != _UNSET.get(name):
            counterpart = mine[other.index(name)]
            raise ValueError(f"{_flag(name)} ({value}) does not go with {_flag(mine[0])}: use "
                             f"{_flag(counterpart)}")
    train, warmup, decay = (_value(training, scheduler, name) for name in mine[:3])
    span = decay or train
    if warmup > span:
        raise ValueError(f"{_flag(mine[1])} ({warmup}) must not exceed the decay span "
                         f"{_flag(mine[2])} / {_flag(mine[0])} ({span})")


def iterations_for_samples(train_samples: int, calculator) -> int:
    """Optimizer steps of a ``train_samples`` run under ``calculator``'s batch schedule (see the
    module docstring); ``calculator`` (a MicrobatchCalculator) is left at consumed = 0."""
    ramp_end = calculator.rampup_batch_size[2] if calculator.rampup_batch_size else -1
    iterations = consumed = 0
    try:
        while consumed <= ramp_end:
            calculator.update(consumed, consistency_check=False)
            batch = calculator.current_global_batch_size
            if consumed + batch > train_samples:
                return iterations
            consumed, iterations = consumed + batch, iterations + 1
    finally:
        calculator.update(0, consistency_check=False)
    return iterations + (train_samples - consumed) // calculator.global_batch_size


def lr_schedule(training, scheduler) -> tuple[int, int, str]:
    """``(warm-up, decay end, unit)`` for the LRScheduler: iterations for an iteration-based run,
    samples for a sample-based one."""
    if is_sample_based(training):
        return (scheduler.lr_warmup_samples, scheduler.lr_decay_samples or training.train_samples,
                "samples")
    return scheduler.lr_warmup_iters, scheduler.lr_decay_iters or training.train_iters, "iterations"


def wsd_decay_length(training, scheduler) -> int | None:
    """The WSD anneal's length in the schedule's unit (None: not given)."""
    return scheduler.lr_wsd_decay_samples if is_sample_based(training) \
        else scheduler.lr_wsd_decay_iters


def check_wsd_arguments(training, scheduler) -> None:
    """--lr-decay-style WSD names its anneal's length (Megatron asserts the same)."""
    if scheduler.lr_decay_style != "WSD":
        return
    flag = "--lr-wsd-decay-samples" if is_sample_based(training) else "--lr-wsd-decay-iters"
    length = wsd_decay_length(training, scheduler)
    if length is None or length < 1:
        raise ValueError(f"--lr-decay-style WSD needs {flag} N >= 1 (the final anneal's length), "
                         f"got {length}")
