"""Early exits agree across ranks: a SIGTERM that reached one rank, a duration that ran out, an
exit interval — every rank stops after the same iteration."""
import os
import signal
import time

import torch.distributed as dist

from tpfuse.training.exit_conditions import ExitConditions
from tpfuse.training.settings import CheckpointSettings


def _args(**kwargs):
    values = dict(exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False)
    return CheckpointSettings(**{**values, **kwargs})


def _reasons():
    rank = dist.get_rank()
    found = {}
    exits = ExitConditions(_args(exit_signal_handler=True))
    try:
        found["before"] = exits.reason(1)
        if rank == 1:                           # the scheduler's signal reaches rank 1 only
            os.kill(os.getpid(), signal.SIGTERM)
        found["signal"] = exits.reason(2)
    finally:
        exits.close()
    found["handler restored"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    late = ExitConditions(_args(exit_duration_in_mins=1.0),
                          start_time=time.monotonic() - (120 if rank == 0 else 0))
    found["duration"] = late.reason(5)          # only rank 0's clock ran out
    found["interval"] = [ExitConditions(_args(exit_interval=3)).reason(i) for i in (2, 3)]
    return found


def test_every_rank_exits_after_the_same_iteration(run_distributed):
    for found in run_distributed(2, _reasons, timeout_s=60):
        assert found["before"] is None
        assert found["signal"] == "SIGTERM received (--exit-signal-handler)"
        assert found["handler restored"]
        assert found["duration"] == "--exit-duration-in-mins 1 reached"
        assert found["interval"] == [None, "--exit-interval 3 reached"]
