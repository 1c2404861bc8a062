"""A finished job exits 0 on every rank: ``runtime.initialize.shutdown_distributed``.

Stand-in ranks (a gloo world with the context-parallel groups of a cp=2 job, a few hundred
collectives, rank 1 lingering after its last one) end the way ``tpfuse.pretrain_gpt`` ends a
finished run. Left to interpreter exit instead, the same ranks abort with ``terminate called
without an active exception`` (SIGABRT, rc 134) in one to five runs of six on this machine: the gloo groups are
torn down by static destructors while the peer is still connected. The full trainer's cp=2 job,
five times over, is benchmarks/test_bench_clean_exit.py.
"""
import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    from tpfuse.parallel import parallel_state
    from tpfuse.runtime.initialize import initialize_distributed, shutdown_distributed

    initialize_distributed("gloo", 1)
    state = parallel_state.initialize_model_parallel(context_parallel_size=2)
    groups = [state.cp_group] + [dist.new_group([0, 1]) for _ in range(4)]
    for step in range(20):
        for group in groups:
            dist.all_reduce(torch.ones(1000), group=group)
    shutdown_distributed(finished=True)
    if os.environ["RANK"] == "1":
        time.sleep(0.2)        # the peer outlives the first rank's exit
""")
LAUNCHER = ("import sys; from tpfuse.runtime.launcher import run_local; "
            "sys.exit(run_local(2, [], program=[sys.executable, '-c', {rank!r}]))")
RUNS = 3


def test_a_finished_two_rank_job_exits_zero_every_time():
    for run in range(RUNS):
        job = subprocess.run([sys.executable, "-c", LAUNCHER.format(rank=RANK)],
                             capture_output=True, text=True, timeout=120)
        assert "terminate called" not in job.stderr, (run, job.stderr[-2000:])
        assert job.returncode == 0, (run, job.returncode, job.stderr[-2000:])
