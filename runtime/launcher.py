"""A local launcher: ``run_local(nproc, argv, program=[...])`` runs ``program + argv`` on N
processes (``tpfuse-train``'s ranks, ``python -m tpfuse.pretrain_gpt``; ``tpfuse-generate``'s).

It sets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for each
process and streams their output. Multi-node runs are torchrun's job:
``torchrun --nproc-per-node N -m tpfuse.pretrain_gpt <flags>``.

Failures and signals, so that no rank outlives the job or hangs:

- When one rank fails, the others are stopped (SIGTERM, then SIGKILL after 10 s) and the launcher
  exits with the first failure's code; a rank killed by signal N makes it exit 128 + N, naming
  the signal. Each rank writes its traceback to a file of the launcher's (``TPFUSE_ERROR_FILE``)
  and prints one line; the launcher prints the traceback of the first failure, once.
- Every signal a job scheduler or a terminal sends (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1,
  SIGUSR2) is forwarded to every rank; the launcher then waits for them (a rank with
  ``--exit-signal-handler`` saves and exits 0 on SIGTERM, and so does the job).
- The ranks die with their launcher: on Linux each rank asks the kernel for SIGKILL when its parent
  dies (``PR_SET_PDEATHSIG``), so even a SIGKILLed launcher leaves no orphan training on.
- The rendezvous listens on ``addr`` (``tpfuse-train --master-addr``; default 127.0.0.1, loopback
  only); gloo is bound to the loopback interface too unless ``GLOO_SOCKET_IFNAME`` says otherwise.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ERROR_FILE_ENV = "TPFUSE_ERROR_FILE"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
STOP_GRACE_S = 10.0
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)   # a collective's timeout error
FAILURE_GRACE_S = 3.0   # after a rank fails, the others may finish reporting their own errors
PR_SET_PDEATHSIG = 1


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _die_with_parent(parent_pid: int):
    """preexec_fn of every rank: SIGKILL when the launcher dies (Linux), at once if it already
    has."""
    def arm():
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: no parent-death signal
            return
        if os.getppid() != parent_pid:
            os._exit(1)
    return arm


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _rank_env(rank: int, nproc: int, addr: str, port: int, error_dir: str) -> dict:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=addr, MASTER_PORT=str(port),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               **{ERROR_FILE_ENV: os.path.join(error_dir, f"rank_{rank}.json")})
    interface = _loopback_interface()
    if addr.startswith("127.") and interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


class _Job:
    """The ranks of one local job, with signal forwarding installed while it runs."""

    def __init__(self, nproc: int, command: list[str], addr: str, port: int,
                 failure_grace_s: float = FAILURE_GRACE_S):
        self.failure_grace_s = failure_grace_s
        self.error_dir = tempfile.mkdtemp(prefix="tpfuse-train-errors-")
        self.signalled = None
        self.procs = [subprocess.Popen(
            command,
            env=_rank_env(rank, nproc, addr, port, self.error_dir),
            preexec_fn=_die_with_parent(os.getpid())) for rank in range(nproc)]
        self.previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED_SIGNALS}

    def _forward(self, signum, frame) -> None:
        self.signalled = signum
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        for name in os.listdir(self.error_dir):
            os.unlink(os.path.join(self.error_dir, name))
        os.rmdir(self.error_dir)

    def first_traceback(self) -> str | None:
        reports = []
        for name in os.listdir(self.error_dir):
            try:
                with open(os.path.join(self.error_dir, name)) as handle:
                    reports.append(json.load(handle))
            except (OSError, ValueError):
                continue
        if not reports:
            return None
        # the earliest own failure; errors that only point at another rank's come last
        first = min(reports, key=lambda r: (r.get("secondary", False), r["time"]))
        return f"first failure: rank {first['rank']}\n{first['traceback']}"

    def wait(self) -> int:
        while True:
            codes = [proc.poll() for proc in self.procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return self._fail(*failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)

    def _wait_for_exits(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)

    def _fail(self, rank: int, code: int) -> int:
        if code < 0:
            what = f"was killed by {signal_name(-code)}"
            if self.signalled is not None:
                what += f" (forwarded from the launcher's {signal_name(self.signalled)})"
            exit_code = 128 - code
        else:
            what, exit_code = f"exited with code {code}", code
        print(f"tpfuse-train: rank {rank} {what}; stopping the other ranks", file=sys.stderr,
              flush=True)
        self._wait_for_exits(self.failure_grace_s)   # ranks failing too report before SIGTERM
        running = [r for r, proc in enumerate(self.procs) if proc.poll() is None]
        self.stop()
        first = self.first_traceback()
        if first:
            print(f"tpfuse-train: {first}", file=sys.stderr, flush=True)
        if running and first and _TIMEOUT.search(first):
            print(f"tpfuse-train: rank {rank}'s collective timed out while rank(s) {running} "
                  f"were still running without an error: the stopped rank is most likely "
                  f"among {running} (it never reached the collective), not rank {rank}",
                  file=sys.stderr, flush=True)
        return exit_code


def report_failure(error: BaseException) -> None:
    """The rank's side: under ``tpfuse-train``, the traceback goes to the launcher's error file
    and stderr gets one line; otherwise (torchrun, python -m) the traceback is printed."""
    path = os.environ.get(ERROR_FILE_ENV)
    text = "".join(traceback.format_exception(error))
    if not path:
        print(text, file=sys.stderr, flush=True)
        return
    rank = os.environ.get("RANK", "?")
    with open(path, "w") as handle:
        json.dump({"rank": rank, "time": time.time(), "traceback": text,
                   "secondary": bool(getattr(error, "secondary", False))}, handle)
    print(f"rank {rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def run_local(nproc: int, argv: list[str], addr: str = "127.0.0.1", port: int | None = None, *,
              program: list[str], failure_grace_s: float = FAILURE_GRACE_S) -> int:
    """Start ``nproc`` processes of ``program + argv`` (e.g. ``[sys.executable, "-m",
    "tpfuse.pretrain_gpt"]`` and the trainer's flags) and wait; returns the job's exit code.
    ``failure_grace_s``: how long the other ranks may go on after one failed (to report their
    own errors) before they are sent SIGTERM."""
    from tpfuse.parallel.launch import free_port

    job = _Job(nproc, [*program, *argv], addr, port or free_port(), failure_grace_s)
    try:
        return job.wait()
    finally:
        job.stop()
        job.close()
