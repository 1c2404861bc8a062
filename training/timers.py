"""Per-step timers (Megatron's ``--timing-log-level`` / ``--timing-log-option``).

    timers = Timers(log_level=2)
    timers("forward-backward", log_level=1).start(barrier=True)
    ...
    timers("forward-backward", log_level=1).stop()
    with timers("forward-compute", log_level=2):
        ...
    times = timers.collect()          # this rank's milliseconds since the last collect, reset

A timer accumulates wall time over ``start()``/``stop()`` pairs (one step may run a timer many
times, e.g. ``forward-compute`` once per micro-batch); asking for a timer above the log level
returns a shared no-op timer, so instrumented code costs a dict lookup when timing is off. On CUDA
``start``/``stop`` synchronize the device first (the time is the device's, not the launch's), as
Megatron's timers do.

Log levels (Megatron's names and levels):

==========  ========================================================================
level 0     nothing beyond the iteration time of the log line
level 1     ``forward-backward`` (the whole pipeline schedule), ``all-grads-sync`` (data-parallel
            gradient reduction), ``embedding-grads-all-reduce`` (tied embedding, first ↔ last
            stage), ``optimizer`` (clipping + the optimizer step)
level 2     inside the schedule: ``forward-compute``, ``backward-compute`` (B, or ZB's input
            gradient I), ``weight-grad-compute`` (ZB's W), and the p2p time ``forward-recv`` /
            ``backward-recv`` (waiting for an activation / gradient) and ``forward-send`` /
            ``backward-send`` (posting one)
==========  ========================================================================

``step_summary`` (every rank, after each step) all-gathers every rank's values of the step (one
small collective over the world group) for the metrics file and adds them to the log interval;
``interval_text`` prints the interval's average as Megatron does: the max, the (min, max) or every
rank's value across ranks (``--timing-log-option max|minmax|all``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse.parallel.devices import collective_device

from .settings_fields import SettingsGroup, setting

TIMING_LOG_OPTIONS = ("max", "minmax", "all")
# (name, level) in the order they are printed; the p2p timers add up to the "p2p wait"
TIMER_LEVELS = (
    ("forward-backward", 1), ("forward-compute", 2), ("backward-compute", 2),
    ("weight-grad-compute", 2), ("forward-recv", 2), ("backward-recv", 2), ("forward-send", 2),
    ("backward-send", 2), ("all-grads-sync", 1), ("embedding-grads-all-reduce", 1),
    ("optimizer", 1),
)


class _Timer:
    """Accumulated wall time of one name (seconds), restarted by ``reset``."""

    def __init__(self, name: str, synchronize):
        self.name = name
        self._synchronize = synchronize
        self._elapsed = 0.0
        self._started_at = None

    def start(self, barrier: bool = False) -> "_Timer":
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} started twice")
        if barrier and dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._synchronize()
        self._started_at = time.perf_counter()
        return self

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} stopped without being started")
        self._synchronize()
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    def take(self) -> float:
        """Seconds accumulated since the last ``take`` (then reset)."""
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is still running")
        elapsed, self._elapsed = self._elapsed, 0.0
        return elapsed

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class _NullTimer:
    """What a timer above the log level is: every method does nothing."""

    def start(self, barrier: bool = False):
        return self

    def stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


_NULL_TIMER = _NullTimer()


def _no_sync() -> None:
    pass


class Timers:
    """Named timers up to ``log_level`` (0 disables all); ``device`` "cuda" synchronizes."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax", device=None):
        if log_level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level must be 0, 1 or 2, got {log_level!r}")
        if log_option not in TIMING_LOG_OPTIONS:
            raise ValueError(f"--timing-log-option must be one of {TIMING_LOG_OPTIONS}, got "
                             f"{log_option!r}")
        self.log_level, self.log_option = log_level, log_option
        cuda = device is not None and torch.device(device).type == "cuda"
        self._synchronize = torch.cuda.synchronize if cuda else _no_sync
        self._timers: dict = {}
        self._interval: dict = {}       # name -> per-rank sums since the last interval_text
        self._interval_steps = 0

    def __call__(self, name: str, log_level: int = 1):
        """The timer ``name``: ``.start(barrier=)`` / ``.stop()``, or a ``with`` block."""
        if log_level > self.log_level:
            return _NULL_TIMER
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(name, self._synchronize)
        return timer

    def names(self) -> list:
        """The timers of this log level, in print order."""
        return [name for name, level in TIMER_LEVELS if level <= self.log_level]

    def collect(self) -> dict:
        """This rank's milliseconds per timer of this level since the last collect (reset)."""
        taken = {name: 1000.0 * timer.take() for name, timer in self._timers.items()}
        return {name: taken.get(name, 0.0) for name in self.names()}

    def gather(self, values: dict, device=None) -> dict:
        """``{name: [ms on rank 0, rank 1, ...]}`` over the world group (every rank calls it);
        the row lives on ``device``, by default the one the world's backend takes (CUDA under
        NCCL)."""
        names = self.names()
        row = [values.get(n, 0.0) for n in names]
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {n: [float(v)] for n, v in zip(names, row)}
        local = torch.tensor(row, dtype=torch.float64,
                             device=collective_device() if device is None else device)
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        table = torch.stack(rows).cpu()       # (world, names)
        return {n: table[:, i].tolist() for i, n in enumerate(names)}

    def step_summary(self, device=None) -> dict | None:
        """After a step, on every rank: collect, gather, add to the interval; returns the step's
        :func:`summarize` (None at log level 0, where nothing is timed or gathered)."""
        if self.log_level == 0:
            return None
        gathered = self.gather(self.collect(), device)
        for name, values in gathered.items():
            previous = self._interval.get(name, [0.0] * len(values))
            self._interval[name] = [a + b for a, b in zip(previous, values)]
        self._interval_steps += 1
        return summarize(gathered, self.log_option)

    def interval_text(self) -> str:
        """The timer block averaged over the steps since the last call (then reset)."""
        if not self._interval_steps:
            return ""
        text = format_timers(summarize(self._interval, self.log_option), self.log_option,
                             normalizer=self._interval_steps)
        self._interval, self._interval_steps = {}, 0
        return text


def summarize(gathered: dict, log_option: str) -> dict:
    """Per timer: ``{"max": v}``, ``{"min": a, "max": b}`` or ``{"ranks": [...]}``."""
    if log_option == "max":
        return {n: {"max": max(v)} for n, v in gathered.items()}
    if log_option == "minmax":
        return {n: {"min": min(v), "max": max(v)} for n, v in gathered.items()}
    return {n: {"ranks": list(v)} for n, v in gathered.items()}


def format_timers(summary: dict, log_option: str, normalizer: int = 1) -> str:
    """Megatron's timer block: one line per timer, values divided by ``normalizer``."""
    header = {"max": "max time across ranks (ms):",
              "minmax": "(min, max) time across ranks (ms):",
              "all": "times across ranks (ms):"}[log_option]
    lines = [header]
    for name, stats in summary.items():
        values = [stats[k] / normalizer for k in ("min", "max") if k in stats]
        if "ranks" in stats:
            values = [v / normalizer for v in stats["ranks"]]
        text = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"    {name} {'.' * max(1, 48 - len(name))}: "
                     f"{'(' + text + ')' if len(values) > 1 else text}")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class TimingSettings(SettingsGroup):
    """Megatron's timing flags."""
    TITLE = "timing"

    timing_log_level: int = setting(
        0, "0: iteration time only; 1: forward-backward, DP grad sync, embedding all-reduce, "
           "optimizer; 2: also forward/backward compute and p2p wait inside the pipeline "
           "schedule", choices=(0, 1, 2))
    timing_log_option: str = setting(
        "minmax", "report the max, the (min, max) or every rank's time",
        choices=TIMING_LOG_OPTIONS)
    barrier_with_L1_time: bool = setting(
        True, "do not start the forward-backward timer with a barrier (the barrier makes it "
              "exclude the wait for slower ranks)", flag="--no-barrier-with-level-1-timing")
