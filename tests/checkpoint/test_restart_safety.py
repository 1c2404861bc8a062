"""Restart safety end to end, through ``tpfuse-train`` with the real trainer: a job killed at
random moments (while asynchronous saves are in flight) and relaunched with the same command
resumes and reproduces the uninterrupted run's losses, and its SIGKILLed launcher leaves no rank
behind; SIGTERM with --exit-signal-handler saves at the iteration boundary and returns normally.
(The launcher's signal handling with several ranks: tests/training/test_train_launcher.py.)"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from support.pretrain_run import logged_train_losses, run_pretrain
from tpfuse.checkpoint import format as ckpt

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table"]
ITERS = 24


def _launch(args, tmp_path):
    env = dict(os.environ, TPFUSE_CACHE=str(tmp_path / "cache"))
    return subprocess.Popen([sys.executable, "-m", "tpfuse.training.launcher", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)   # its own group: the test can clean up


def _kill_group(job):
    """Leave nothing behind whatever happened (a no-op when the group is already gone)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _iterations(metrics):
    if not os.path.exists(metrics):
        return []
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle if line.endswith("\n")]
    return [r["iteration"] for r in records if "memory_bytes" not in r]   # one per (re)start


def test_killed_job_relaunched_resumes_and_reproduces_losses(run_distributed, tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    command = ["--nproc-per-node", "1", *TINY, "--train-iters", str(ITERS), "--save", save,
               "--load", save, "--async-save", "--save-interval", "1",
               "--keep-last-checkpoints", "2", "--metrics-file", metrics]
    seed = random.randrange(10**6)
    moments = random.Random(seed)
    for attempt in range(2):          # kill -9 twice at random moments, then let it finish
        job = _launch(command, tmp_path)
        try:
            _wait_for(lambda: ckpt.latest_iteration(save) is not None or job.poll() is not None)
            time.sleep(moments.uniform(0.0, 1.0))
            # a job that ended by itself (an error) is reported as such, not as a failed kill
            assert job.poll() is None, (f"attempt {attempt}: the job ended before the kill "
                                        f"(rc {job.returncode}): {job.stderr.read()[-3000:]}")
            ranks = _children(job.pid)
            os.kill(job.pid, signal.SIGKILL)          # the launcher dies; its rank must too
            job.wait()
            _wait_for(lambda: not any(_alive(p) for p in ranks), timeout=10)
        finally:
            _kill_group(job)
        if attempt == 0:
            assert "no checkpoint there" in job.stdout.read()   # --load of a missing dir
        assert ckpt.verify_checkpoint(save) >= 1, f"kill {attempt} (seed {seed})"
    done = _launch(command, tmp_path)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    assert _iterations(metrics) == list(range(1, ITERS + 1)), "every iteration exactly once"
    with open(metrics) as handle:
        losses = [r["loss"] for r in map(json.loads, handle) if "memory_bytes" not in r]
    # same layout, seed, data and restored RNG: the resumed run computes the same numbers
    reference, = run_distributed(1, logged_train_losses, TINY + ["--train-iters", str(ITERS)])
    assert losses == pytest.approx(reference, rel=1e-6), f"seed {seed}"
    assert os.path.exists(str(tmp_path / "m.png"))                      # the loss curve
    kept = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
    assert kept == [f"iter_{ITERS - 1:07d}", f"iter_{ITERS:07d}"]   # --keep-last-checkpoints 2


def _train_until_sigterm(argv, metrics):
    """pretrain in this worker; a watcher thread sends this process SIGTERM (as tpfuse-train
    forwards a scheduler's) once two iterations are logged."""
    import threading

    def watch():
        while len(_iterations(metrics)) < 2:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    result = run_pretrain(argv)
    return result.exit_reason, result.iterations


def test_sigterm_saves_at_the_iteration_boundary_and_returns(run_distributed, tmp_path):
    """The rank side (the launcher's forwarding and exit 0: tests/training/test_train_launcher.py)."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    (reason, iterations), = run_distributed(
        1, _train_until_sigterm, TINY + ["--train-iters", "100000", "--save", save,
                                         "--exit-signal-handler", "--metrics-file", metrics],
        metrics)
    assert reason == "SIGTERM received (--exit-signal-handler)"
    assert ckpt.verify_checkpoint(save) == iterations[-1] == _iterations(metrics)[-1] < 100000
