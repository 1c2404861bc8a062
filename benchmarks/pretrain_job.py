"""The training job the trainer benchmarks run on every rank of a ``WorkerPool``: ``pretrain`` with
``tpfuse.pretrain_gpt``'s providers and a metrics file, read back on the logging rank."""
from __future__ import annotations

import json
import os
import tempfile


def pretrain_with_metrics(argv: list, metrics_file: str):
    """On every rank: ``pretrain(argv + --metrics-file metrics_file)``. The logging rank returns
    (its per-iteration training losses, every record of the metrics file); the others None."""
    from tpfuse.pretrain_gpt import (forward_step, model_provider,
                                     train_valid_test_datasets_provider)
    from tpfuse.training.pretrain import pretrain

    result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                      argv=argv + ["--metrics-file", metrics_file])
    if not result.is_logger:
        return None
    with open(metrics_file) as handle:
        return result.train_losses, [json.loads(line) for line in handle if line.strip()]


def memory_and_step_time(argv: list, metrics_file: str, skip: int):
    """On every rank: the job of ``argv``; the logging rank returns its start-up ``memory_bytes``
    record, the mean ``ms_per_iter`` of the iterations after the first ``skip`` (warm-up) and its
    losses; the others None."""
    logged = pretrain_with_metrics(argv, metrics_file)
    if logged is None:
        return None
    losses, records = logged
    memory = next(r["memory_bytes"] for r in records if "memory_bytes" in r)
    steps = [r["ms_per_iter"] for r in records if "ms_per_iter" in r]
    return {"memory": memory, "ms": sum(steps[skip:]) / len(steps[skip:]), "losses": losses}


def run_memory_and_step_time(pool, argv: list, skip: int) -> dict:
    """``memory_and_step_time`` on every rank of ``pool``: the logging rank's result."""
    with tempfile.TemporaryDirectory() as folder:
        per_rank = pool.run(memory_and_step_time, argv, os.path.join(folder, "m.jsonl"), skip,
                            timeout_s=1800.0)
    (logged,) = [r for r in per_rank if r is not None]
    return logged
