"""The training log: one Megatron-style line per interval, a progress bar, and a JSONL metrics file.

Only one rank logs: the rank on the last pipeline stage with tp, dp and cp rank 0, which holds the
(DP-averaged) loss. Every record also goes to the logger's ``sinks`` (TensorBoard, wandb).

A resumed run continues the metrics file it finds: the records of iterations after the resume
point (written by the run that crashed after its last checkpoint) are dropped first, so the file
never holds an iteration twice.
"""
from __future__ import annotations

import json
import os
import sys


def format_log_line(iteration: int, train_iters: int, record: dict,
                    show_throughput: bool = False, skipped_in_interval: int = 0) -> str:
    """Megatron's iteration line; ``skipped_in_interval``: steps skipped (inf/nan) since the last
    line, Megatron's "number of skipped iterations" (the metrics file has the running total)."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {record['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f}",
        f"learning rate: {record['lr']:.6E}",
        f"global batch size: {record['global_batch_size']:5d}",
        f"lm loss: {record['loss']:.6E}",
    ]
    # multi-token prediction: "mtp_1 loss", ... beside the lm loss, as Megatron logs them
    parts += [f"{name}: {record[name]:.6E}" for name in record
              if name.startswith("mtp_") and name.endswith(" loss")]
    if "loss_scale" in record:
        parts.append(f"loss scale: {record['loss_scale']:.1f}")
    for name in ("load_balancing_loss", "z_loss"):       # MoE router losses (Megatron's names)
        if name in record:
            parts.append(f"{name}: {record[name]:.6E}")
    grad_norm = record["grad_norm"]
    parts.append(f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: nan")
    parts.append(f"number of skipped iterations: {skipped_in_interval:3d}")
    if "peak_memory_mib" in record:
        parts.append(f"peak allocated memory (MiB): {record['peak_memory_mib']:.1f}")
    parts.append(f"tokens/s: {record['tokens_per_s']:.0f}")
    if show_throughput:
        parts.append(f"throughput per rank (TFLOP/s): {record['tflops_per_rank']:.3f}")
        if "mfu" in record:
            parts.append(f"MFU: {100 * record['mfu']:.1f}%")
    return " | ".join(parts) + " |"


def read_metrics(path: str) -> tuple[list[dict], bool]:
    """(records of ``path``, whether a torn last line was dropped). A last line that is not a
    complete JSON record (what a full disk or a kill mid-write leaves) is dropped with a warning
    naming the file; an unreadable line before it is a ValueError naming the file and line."""
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")
    records, torn = [], False
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            if position == len(numbered) - 1:
                print(f"WARNING: --metrics-file {path}: its last line ({number}) is not a "
                      f"complete record (a write cut short); dropping it", file=sys.stderr,
                      flush=True)
                torn = True
                break
            raise ValueError(f"--metrics-file {path}:{number}: not a JSON record ({error}); "
                             "fix or move the file") from None
        records.append(record)
    return records, torn


def truncate_metrics(path: str, start_iteration: int, drop_valid_at_start: bool) -> int:
    """Rewrite ``path`` (atomically) without the records after ``start_iteration`` (and without
    the validation record at it when the run evaluates there again) and without a torn last
    line; returns how many records went. The new file is written through an exclusive temporary
    file renamed over ``path`` (``checkpoint.file_io.atomic_write_bytes``: no predictable name a
    planted symlink could redirect)."""
    from tpfuse.checkpoint.file_io import atomic_write_bytes

    if not os.path.exists(path):
        return 0
    records, torn = read_metrics(path)

    def keep(record):
        iteration = record.get("iteration", 0)
        return iteration < start_iteration or (iteration == start_iteration and not (
            drop_valid_at_start and "valid_loss" in record))

    kept = [r for r in records if keep(r)]
    if len(kept) < len(records) or torn:
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return len(records) - len(kept)


class TrainingLogger:
    def __init__(self, is_logger: bool, train_iters: int, start_iteration: int,
                 metrics_file: str | None, progress_bar: bool, sinks=(),
                 show_throughput: bool = False, evaluates_at_start: bool = False):
        self.is_logger = is_logger
        self.train_iters = train_iters
        self.metrics_file = metrics_file if is_logger else None
        self.sinks, self.show_throughput = list(sinks), show_throughput
        self.bar = None
        self.skipped_in_interval = 0          # skipped steps since the last log line
        if is_logger and progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=train_iters, initial=start_iteration, desc="train", unit="it",
                            file=sys.stderr, dynamic_ncols=True, leave=False,
                             disable=None)  # None: no bar when stderr is not a terminal
        if self.metrics_file:
            folder = os.path.dirname(os.path.abspath(self.metrics_file))
            os.makedirs(folder, exist_ok=True)
            truncate_metrics(self.metrics_file, start_iteration, evaluates_at_start)

    def print(self, text: str) -> None:
        if not self.is_logger:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def iteration(self, iteration: int, record: dict, log_now: bool) -> None:
        if not self.is_logger:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}")
        self.skipped_in_interval += bool(record.get("skipped"))
        if log_now:
            self.print(format_log_line(iteration, self.train_iters, record,
                                       self.show_throughput, self.skipped_in_interval))
            self.skipped_in_interval = 0
        self.write_metrics({"iteration": iteration, **record})

    def write_metrics(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record["iteration"], record)
        if self.metrics_file:
            with open(self.metrics_file, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
