"""Same-process A/B timing of training steps: every side steps on the same batch, in a rotating
order, so that each side runs in each position equally often (which step runs right after which
moves a step's time by about 1 % through the allocator's and caches' state).

``time_rotating_steps({name: step(batch) -> loss}, batches, warmup)`` returns
``{"times": {name: [s]}, "cpu_times": {name: [s]}, "losses": {name: [loss]}}``: wall clock and the
calling thread's CPU time (less sensitive to other jobs on a shared machine) of each step after
the first ``warmup`` batches, and every step's loss (warm-up included).
"""
from __future__ import annotations

import statistics
import time


def time_rotating_steps(steps: dict, batches, warmup: int) -> dict:
    names = list(steps)
    times = {name: [] for name in names}
    cpu_times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for index, batch in enumerate(batches):
        turn = index % len(names)
        for name in names[turn:] + names[:turn]:
            start, cpu_start = time.perf_counter(), time.thread_time()
            losses[name].append(steps[name](batch))
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.thread_time() - cpu_start)
    return {"times": times, "cpu_times": cpu_times, "losses": losses}


def median_step_times(result: dict, benchmark) -> dict:
    """``{"wall": {name: median s}, "thread CPU": {...}}``; also recorded in the benchmark's
    extra_info as ``<name>_<times|cpu_times>_median_s``."""
    medians = {}
    for key, what in (("times", "wall"), ("cpu_times", "thread CPU")):
        medians[what] = {name: statistics.median(t) for name, t in result[key].items()}
        benchmark.extra_info.update({f"{name}_{key}_median_s": v
                                     for name, v in medians[what].items()})
    return medians
