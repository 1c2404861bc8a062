"""The training job the trainer benchmarks run on every rank of a ``WorkerPool``: ``pretrain`` with
``tpfuse.pretrain_gpt``'s providers and a metrics file, read back on the logging rank."""
from __future__ import annotations

import json


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
