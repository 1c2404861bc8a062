"""tpfuse-train's process handling, with stand-in ranks (a few lines of Python each, no torch) so
every case takes well under a second: signal forwarding, 128 + signal for a rank killed by one,
one traceback per job, ranks dying with their launcher; and the loopback-only rendezvous."""
import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time

from tpfuse.runtime import launcher
from tpfuse.runtime.launcher import signal_name

# a rank: behaves as its mode says, after writing <dir>/ready<RANK>
RANK = textwrap.dedent("""
    import os, signal, sys, time
    mode, folder, rank = sys.argv[1], sys.argv[2], os.environ["RANK"]
    def on_term(signum, frame):
        open(os.path.join(folder, "term" + rank), "w").write("saved")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(folder, "ready" + rank), "w").close()
    if mode == "die" and rank == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise" and rank == "1":
        from tpfuse.runtime.launcher import report_failure
        try:
            raise ValueError("rank one cannot go on")
        except ValueError as error:
            report_failure(error)
            sys.exit(1)
    if mode == "echo":   # rank 0 stops at once on an agreement; rank 1 reports the cause later
        from tpfuse.checkpoint.format import OtherRankFailed
        from tpfuse.runtime.launcher import report_failure
        error = (OtherRankFailed("saving failed on another rank") if rank == "0"
                 else ValueError("rank one's disk is full"))
        time.sleep(0.0 if rank == "0" else 0.5)
        try:
            raise error
        except ValueError as raised:
            report_failure(raised)
            sys.exit(1)
    if mode == "timeout" and rank == "0":   # rank 1 hangs; rank 0's collective times out
        from tpfuse.runtime.launcher import report_failure
        try:
            raise RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete")
        except RuntimeError as error:
            report_failure(error)
            sys.exit(1)
    time.sleep(120)
""")
LAUNCHER = ("import sys; from tpfuse.runtime.launcher import run_local; "
            "sys.exit(run_local(2, sys.argv[1:], program=[sys.executable, '-c', {rank!r}], "
            "failure_grace_s={grace}))")
# the stand-in ranks report at once (0.5 s of grace is plenty) except "echo"'s rank 1, 0.5 s
# after rank 0 fails: the launcher's default grace
FAILURE_GRACE_S = {"echo": launcher.FAILURE_GRACE_S}


def _launch(mode, folder):
    command = LAUNCHER.format(rank=RANK, grace=FAILURE_GRACE_S.get(mode, 0.5))
    return subprocess.Popen([sys.executable, "-c", command, mode, str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _ready(folder, count=2, timeout=60):
    deadline = time.monotonic() + timeout
    while not all((folder / f"ready{r}").exists() for r in range(count)):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.02)


def _rank_pids(job):
    with open(f"/proc/{job.pid}/task/{job.pid}/children") as handle:
        return [int(p) for p in handle.read().split()]


def _gone(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")
                 and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_rank_killed_by_a_signal_exits_128_plus_it_and_names_it(tmp_path):
    job = _launch("die", tmp_path)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGKILL == 137
    assert "rank 1 was killed by SIGKILL; stopping the other ranks" in err


def test_one_traceback_per_job(tmp_path):
    job = _launch("raise", tmp_path)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 1
    assert err.count("Traceback (most recent call last)") == 1
    assert "first failure: rank 1" in err and "ValueError: rank one cannot go on" in err


def test_the_cause_is_reported_not_the_echo_of_another_rank(tmp_path):
    job = _launch("echo", tmp_path)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 1
    assert err.count("Traceback (most recent call last)") == 1
    assert "first failure: rank 1" in err and "ValueError: rank one's disk is full" in err


def test_a_collective_timeout_names_the_rank_that_stopped(tmp_path):
    job = _launch("timeout", tmp_path)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 1
    assert "first failure: rank 0" in err
    assert "the stopped rank is most likely among [1]" in err


def test_signals_are_forwarded_to_every_rank(tmp_path):
    job = _launch("sleep", tmp_path)
    _ready(tmp_path)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err          # both ranks handled it (saved) and exited 0
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()


def test_ranks_die_with_their_launcher(tmp_path):
    job = _launch("sleep", tmp_path)
    try:
        _ready(tmp_path)
        ranks = _rank_pids(job)
        assert len(ranks) == 2
        os.kill(job.pid, signal.SIGKILL)      # no chance to forward anything
        job.wait()
        assert _gone(ranks), "orphaned ranks kept running after the launcher died"
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_signal_names():
    assert signal_name(15) == "SIGTERM" and signal_name(9) == "SIGKILL"


def _listening_addresses(port):
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(f":{port:04X}"):
                    found.append(local.split(":")[0])
    return found


def test_rendezvous_listens_on_loopback_only(monkeypatch):
    from tpfuse.parallel.launch import free_port
    from tpfuse.runtime.initialize import rendezvous_store

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = rendezvous_store(datetime.timedelta(seconds=30))
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert _listening_addresses(port) == ["0100007F"]    # 127.0.0.1, not 0.0.0.0 / ::
