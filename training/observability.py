"""What a run reports besides its log line: TensorBoard, Weights & Biases, a torch.profiler Chrome
trace, and a loss-curve PNG beside the metrics file.

- ``--tensorboard-dir DIR``: scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the
  optional ``tensorboard`` package), written by the logging rank every
  ``--tensorboard-log-interval`` iterations, validation losses always.
- ``--wandb-project P`` (``--wandb-exp-name``, ``--wandb-save-dir``): the same scalars through
  ``wandb.log`` (optional ``wandb`` package), logging rank only.
- ``--profile``: the ranks of ``--profile-ranks`` record iterations ``[--profile-step-start,
  --profile-step-end)`` with ``torch.profiler`` (CPU, and CUDA when present) and write
  ``<profile dir>/trace_rank<R>_iters<A>-<B>.json`` (open in chrome://tracing or Perfetto).
- ``write_loss_curve(metrics_file)``: train and validation loss against iteration, as
  ``<metrics file without .jsonl>.png``, at the end of a run.

Optional packages are imported only when their flag is given; a missing one is a clear
ImportError naming the flag, the package and its pip extra (``tpfuse._optional``), raised at
start-up.
"""
from __future__ import annotations

import io
import os

import torch

from tpfuse._optional import import_optional
from tpfuse.checkpoint.file_io import atomic_write_bytes
from tpfuse.training.throughput import throughput

SCALARS = {"loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
           "global_batch_size": "batch-size", "tokens_per_s": "throughput/tokens-per-s",
           "tflops_per_rank": "throughput/tflops-per-rank", "mfu": "throughput/mfu",
           "loss_scale": "loss-scale", "valid_loss": "lm loss validation",
           "load_balancing_loss": "load_balancing_loss", "z_loss": "z_loss"}


class TensorBoardWriter:
    def __init__(self, log_dir: str, interval: int = 1):
        import_optional("tensorboard", extra="tensorboard", feature="--tensorboard-dir")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        self.interval = interval

    def log(self, iteration: int, record: dict) -> None:
        if "valid_loss" not in record and iteration % self.interval:
            return
        for key, name in SCALARS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(name, record[key], iteration)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbWriter:
    def __init__(self, project: str, name: str, save_dir: str, config: dict):
        self.wandb = import_optional("wandb", extra="wandb", feature="--wandb-project")
        self.run = self.wandb.init(project=project, name=name or None, dir=save_dir or None,
                                   config=config)

    def log(self, iteration: int, record: dict) -> None:
        values = {SCALARS[k]: v for k, v in record.items() if k in SCALARS and v is not None}
        self.run.log(values, step=iteration)

    def close(self) -> None:
        self.run.finish()


def build_writers(settings, is_logger: bool, run_values: dict | None = None) -> list:
    """The TensorBoard / wandb writers ``settings`` (ObservabilitySettings) ask for (none off the
    logging rank); wandb's run config is the scalars of ``run_values`` (every flag's value)."""
    if not is_logger:
        return []
    writers = []
    if settings.tensorboard_dir:
        writers.append(TensorBoardWriter(settings.tensorboard_dir,
                                         settings.tensorboard_log_interval))
    if settings.wandb_project:
        config = {k: v for k, v in (run_values or {}).items()
                  if isinstance(v, (int, float, str, bool))}
        writers.append(WandbWriter(settings.wandb_project, settings.wandb_exp_name,
                                   settings.wandb_save_dir, config))
    return writers


class StepProfiler:
    """torch.profiler over iterations [start, end) on the chosen ranks; ``step(n)`` before
    iteration n runs (n counts from 1), ``close()`` at the end writes what was recorded;
    ``settings``: the ObservabilitySettings."""

    def __init__(self, settings, rank: int):
        self.enabled = bool(settings.profile) and rank in settings.profile_ranks
        self.start, self.end = settings.profile_step_start, settings.profile_step_end
        self.rank = rank
        self.folder = settings.profile_dir or settings.tensorboard_dir or "profile"
        self.profiler = None
        self.path = None

    def step(self, iteration: int) -> None:
        if not self.enabled:
            return
        if iteration == self.start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        elif iteration == self.end:
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder,
                                 f"trace_rank{self.rank}_iters{self.start}-{self.end}.json")
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        print(f"> rank {self.rank}: profiler trace written to {self.path}", flush=True)


def loss_curve_path(metrics_file: str) -> str:
    stem = metrics_file[:-len(".jsonl")] if metrics_file.endswith(".jsonl") else metrics_file
    return stem + ".png"


def write_loss_curve(metrics_file: str) -> str | None:
    """Train and validation loss of ``metrics_file`` drawn into a PNG beside it (its path)."""
    if not os.path.exists(metrics_file):
        return None
    from tpfuse.training.logging_utils import read_metrics

    train, valid = [], []
    for record in read_metrics(metrics_file)[0]:
        if record.get("loss") is not None:
            train.append((record["iteration"], record["loss"]))
        if record.get("valid_loss") is not None:
            valid.append((record["iteration"], record["valid_loss"]))
    if not train and not valid:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    if train:
        axes.plot(*zip(*train), label="train", linewidth=1)
    if valid:
        axes.plot(*zip(*valid), "o-", label="validation")
    axes.set(xlabel="iteration", ylabel="lm loss", title=os.path.basename(metrics_file))
    axes.legend()
    axes.grid(alpha=0.3)
    path = loss_curve_path(metrics_file)
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    atomic_write_bytes(path, image.getvalue())    # exclusive temporary file, then rename
    return path


class RunMonitor:
    """Everything above for one rank: ``before_iteration(n)`` (profiler), ``measure(batch,
    seconds)`` (TFLOP/s per rank and MFU for the record), ``sinks`` (the writers, for the
    logger), ``close()`` (trace, writers, loss curve). ``settings``: the ObservabilitySettings;
    ``metrics_file``: ``--metrics-file`` (its loss curve is drawn at the end); ``run_values``:
    every flag's value, for wandb's run config."""

    def __init__(self, settings, config, is_logger: bool, rank: int, world_size: int, *,
                 metrics_file: str | None = None, run_values: dict | None = None):
        self.config, self.world_size = config, world_size
        self.peak_tflops, self.metrics_file = settings.peak_tflops, metrics_file
        self.is_logger = is_logger
        self.sinks = build_writers(settings, is_logger, run_values)
        self.profiler = StepProfiler(settings, rank)

    def before_iteration(self, iteration: int) -> None:
        self.profiler.step(iteration)

    def measure(self, global_batch_size: int, seconds: float) -> dict:
        return throughput(self.config, global_batch_size, seconds, self.world_size,
                          self.peak_tflops)

    def close(self) -> None:
        self.profiler.close()
        for sink in self.sinks:
            sink.close()
        if self.is_logger and self.metrics_file:
            path = write_loss_curve(self.metrics_file)
            if path:
                print(f"> loss curve written to {path}", flush=True)
