"""A finished 2-process context-parallel training job exits 0 on every rank, six times in a row.

The full trainer (``tpfuse-train``, its launcher, ``tpfuse.pretrain_gpt``) on a cp=2 job of six
iterations, each run checked for rc 0 and no ``terminate called`` (the SIGABRT a gloo world left
to interpreter exit produced in about one run of three on 2 loaded cores). About 15–40 s a run;
the fast stand-in of the same exit path is in the suite (tests/training/test_clean_exit.py)::

    python3 -m pytest benchmarks/test_bench_clean_exit.py -q
"""
import subprocess
import sys

RUNS = 6
JOB = ["--nproc-per-node", "2", "--context-parallel-size", "2", "--num-layers", "2",
       "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
       "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0"]


def test_six_finished_cp2_jobs_all_exit_zero(tmp_path):
    for run in range(RUNS):
        job = subprocess.run([sys.executable, "-m", "tpfuse.training.launcher", *JOB],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        output = job.stdout + job.stderr
        assert "terminate called" not in output, (run, output[-3000:])
        assert job.returncode == 0, (run, job.returncode, output[-3000:])
        assert "iteration        6/       6" in output, (run, output[-3000:])
