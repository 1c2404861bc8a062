"""Local multi-process launching: a persistent pool of gloo (CPU) or nccl (GPU) workers.

``WorkerPool(world_size)`` starts ``world_size`` processes once, each with ``torch.distributed``
initialised over one rendezvous, and then runs any number of jobs in them::

    pool = WorkerPool(4)
    results = pool.run(my_module.body, arg1, arg2)   # body(*args) runs on every rank
    pool.close()

A job is a module-level function (picklable by reference); its return values come back as a
list indexed by global rank. Process start-up (import torch, rendezvous) is paid once per pool,
which is what keeps a multi-process test suite fast on a 2-core machine.

Nothing hangs silently: every job has a deadline, a failing rank's traceback is re-raised in the
caller (``WorkerError``), and a pool whose job failed or timed out is torn down, because its other
ranks may still be blocked inside a collective.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import traceback
from dataclasses import dataclass


DEFAULT_JOB_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A job raised on at least one rank; the message holds every failing rank's traceback."""


def free_port() -> int:
    """An unused TCP port on the loopback interface for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Job:
    fn: object
    args: tuple
    kwargs: dict


def _after_job_cleanup() -> None:
    """Leave no parallel state behind for the next job in the same worker: the default
    ``ParallelState`` and every process group the job left alive (a gloo group keeps a thread
    that wakes every 10 ms, so hundreds of forgotten groups in long-lived workers eat the CPU that
    later jobs and subprocesses need)."""
    import sys

    facade = sys.modules.get("tpfuse.parallel.parallel_state")
    if facade is not None and hasattr(facade, "destroy_model_parallel"):
        try:
            facade.destroy_model_parallel()
        except Exception:  # pragma: no cover - cleanup must never mask the job's own result
            pass
    try:
        _destroy_leftover_groups()
    except Exception:  # pragma: no cover - as above
        pass


def _destroy_leftover_groups() -> None:
    """Destroy every group but the world, after a barrier: every rank has left the job, so no
    peer is still inside a collective on a group this rank closes."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    leftovers = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not world]
    dist.barrier()
    for group in leftovers:
        dist.destroy_process_group(group)


def _worker_main(rank, world_size, port, backend, collective_timeout_s, threads, jobs, results):
    import torch
    import torch.distributed as dist

    from .host_staging import is_host_staged, register_host_staged_backends

    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if is_host_staged(backend):
        register_host_staged_backends()
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        results.put((rank, "ready", None))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = jobs.get()
        if job is None:
            break
        try:
            value = job.fn(*job.args, **job.kwargs)
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            _after_job_cleanup()
    dist.destroy_process_group()
    # every result is delivered (the pool collected them before it sent the stop): skip the
    # interpreter's teardown of torch, half a second of CPU per worker on a shared core
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    """``world_size`` long-lived processes joined in one torch.distributed world."""

    def __init__(self, world_size: int, backend: str = "gloo", threads_per_rank: int = 1,
                 start_timeout_s: float = 180.0,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"WorkerPool needs world_size >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        import torch.multiprocessing as mp   # here, so free_port() stays a torch-free import

        ctx = mp.get_context("spawn")
        self._job_queues = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main, daemon=True,
                args=(rank, world_size, port, backend, collective_timeout_s, threads_per_rank,
                      self._job_queues[rank], self._results),
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._closed = False
        self._collect(start_timeout_s, what="start-up")

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout_s: float = DEFAULT_JOB_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if not self.alive:
            raise WorkerError("this WorkerPool is closed (an earlier job failed or it was closed)")
        job = _Job(fn, args, kwargs)
        for q in self._job_queues:
            q.put(job)
        return self._collect(timeout_s, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout_s: float, what: str) -> list:
        import time

        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = self._results.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not errors:
                    self.close(force=True)
                    codes = ", ".join(f"rank {r}: {self._procs[r].exitcode}" for r in dead)
                    raise WorkerError(f"{what}: rank(s) {dead} died without reporting "
                                      f"(exit codes {codes})")
                if remaining <= 0:
                    missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                    self.close(force=True)
                    detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items())
                    raise WorkerError(
                        f"{what}: timed out after {timeout_s:.0f}s waiting for rank(s) {missing}"
                        + detail)
                if errors and dead:
                    break
                continue
            if status in ("ok", "ready"):
                values[rank] = payload
            else:
                errors[rank] = payload
                # the other ranks may be stuck in a collective with the failed one: give them a
                # short grace period to fail too, then tear the pool down.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            silent = self._silent_ranks(values, errors)
            self.close(force=True)
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorkerError(f"{what} failed on rank(s) {sorted(errors)}{silent}:{detail}")
        return [values[r] for r in range(self.world_size)]

    def _silent_ranks(self, values: dict, errors: dict) -> str:
        """The ranks that neither returned nor raised, as a clause: those that died (with their
        exit codes; a crash in one rank often shows up as a connection error in another) and
        those still running."""
        silent = [r for r in range(self.world_size) if r not in values and r not in errors]
        if not silent:
            return ""
        dead = {r: self._procs[r].exitcode for r in silent if not self._procs[r].is_alive()}
        running = [r for r in silent if r not in dead]
        parts = [f"rank {r} died (exit code {code})" for r, code in dead.items()]
        if running:
            parts.append(f"rank(s) {running} had not reported")
        return " (" + "; ".join(parts) + ")"

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._job_queues:
                q.put(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


def spawn(fn, world_size: int, *args, backend: str = "gloo", **kwargs) -> list:
    """One-shot: start a pool, run ``fn`` on every rank, close the pool."""
    with WorkerPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args, **kwargs)
