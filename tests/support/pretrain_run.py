"""Runs the GPT trainer in the test's own process: ``tpfuse.training.pretrain.pretrain`` with
``tpfuse.pretrain_gpt``'s datasets provider, model provider and forward step.

In a rank body (a function ``run_distributed`` runs on every rank of its world):

- ``run_pretrain(argv)``: this rank's ``TrainingResult``; ``forward_step`` replaces the forward
  step, ``datasets_provider`` the datasets provider (a picklable callable: a module-level
  function or a ``functools.partial`` of one), ``model_provider_wrapper(provider) -> provider``
  wraps the model provider, and
  ``with_sampling`` passes ``pretrain_gpt.sample_func`` (what ``--sample-prompt`` needs).

As a rank body itself (module-level, so the worker pool can pickle it; keyword arguments as above):

- ``run_pretrain``: every rank's ``TrainingResult`` (a plain dataclass, it pickles back);
- ``logged_train_losses(argv)``: the training losses on the logging rank, None on the others;
- ``pretrain_error(argv, error_type=ValueError)``: the message of the ``error_type`` the run
  raised, None if it finished.

From the test itself: ``logged_by_one_rank(per_rank)`` is the one value that is not None, and
``train_losses(run_distributed, world_size, argv)`` the logging rank's losses of one run.
"""
from __future__ import annotations

from tpfuse import pretrain_gpt
from tpfuse.training.pretrain import pretrain


def run_pretrain(argv, *, forward_step=None, model_provider_wrapper=None, with_sampling=False,
                 datasets_provider=None):
    """``pretrain(pretrain_gpt's providers, forward step, argv=argv)`` on this rank: its result."""
    model_provider = pretrain_gpt.model_provider
    if model_provider_wrapper is not None:
        model_provider = model_provider_wrapper(model_provider)
    return pretrain(datasets_provider or pretrain_gpt.train_valid_test_datasets_provider,
                    model_provider,
                    forward_step or pretrain_gpt.forward_step, argv=list(argv),
                    sample_func=pretrain_gpt.sample_func if with_sampling else None)


def logged_train_losses(argv, **run_options) -> list | None:
    """The per-iteration training losses on the logging rank; None on every other rank."""
    result = run_pretrain(argv, **run_options)
    return result.train_losses if result.is_logger else None


def pretrain_error(argv, error_type=ValueError, **run_options) -> str | None:
    """``str`` of the ``error_type`` the run raised on this rank; None if it finished."""
    try:
        run_pretrain(argv, **run_options)
    except error_type as error:
        return str(error)
    return None


def logged_by_one_rank(per_rank: list):
    """The one per-rank value that is not None (the logging rank's)."""
    logged = [value for value in per_rank if value is not None]
    assert len(logged) == 1, "exactly one rank logs the loss"
    return logged[0]


def train_losses(run_distributed, world_size: int, argv, **run_options) -> list:
    """The logging rank's training losses of one run of ``argv`` on ``world_size`` ranks."""
    return logged_by_one_rank(run_distributed(world_size, logged_train_losses, list(argv),
                                              **run_options))
