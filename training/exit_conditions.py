"""When to stop before ``--train-iters``: Megatron's three early exits, each with a save first.

- ``--exit-signal-handler``: SIGTERM (a scheduler's preemption; ``tpfuse-train`` forwards it to
  every rank) sets a flag; at the next iteration boundary the job saves and exits 0.
- ``--exit-interval N``: exit once the iteration is a multiple of N.
- ``--exit-duration-in-mins M``: exit once training has run M minutes.

Ranks must agree (a save is a collective), but a signal or a clock reaches ranks at different
moments. So at every iteration boundary, when a signal handler or a duration is set, the ranks
all-reduce (MAX) the pair (signal received, time is up): if any rank says yes, all exit after the
same iteration. The exit interval is the same on every rank and needs no communication.
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from tpfuse.parallel.devices import collective_device


class ExitConditions:
    """``reason(iteration)`` → None, or why training stops after this iteration (collective).
    ``settings``: the CheckpointSettings (its ``exit_*`` fields)."""

    def __init__(self, settings, start_time: float | None = None):
        self.interval = settings.exit_interval
        self.duration_s = None if settings.exit_duration_in_mins is None \
            else 60.0 * settings.exit_duration_in_mins
        self.start_time = time.monotonic() if start_time is None else start_time
        self.signal_received = False
        self.handles_signal = bool(settings.exit_signal_handler)
        self._previous_handler = None
        if self.handles_signal:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = True

    @property
    def needs_agreement(self) -> bool:
        return self.handles_signal or self.duration_s is not None

    def reason(self, iteration: int) -> str | None:
        if self.needs_agreement:
            time_up = self.duration_s is not None and \
                time.monotonic() - self.start_time >= self.duration_s
            flags = torch.tensor([int(self.signal_received), int(time_up)],
                                 device=collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0]:
                return "SIGTERM received (--exit-signal-handler)"
            if flags[1]:
                return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        return None

    def close(self) -> None:
        """Restore the SIGTERM handler that was installed before."""
        if self.handles_signal:
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
            self.handles_signal = False
