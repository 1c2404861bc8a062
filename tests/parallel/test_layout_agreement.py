"""Ranks that initialise model parallelism with different sizes fail at once, on every rank, with
a message naming the difference (not at the collective timeout); the rank tables stay linear in
the world size."""
import re

import torch.distributed as dist

from tpfuse.parallel.cli import main as layout_main
from tpfuse.parallel.layout import RankLayout
from tpfuse.parallel.state import ParallelState


def _mismatched_sizes():
    tp = 2 if dist.get_rank() == 0 else 1      # rank 0 thinks tp=2 (dp 1), rank 1 tp=1 (dp 2)
    try:
        ParallelState.initialize(tp=tp)
    except ValueError as error:
        return str(error)
    return None


def test_different_layouts_fail_on_every_rank(run_distributed):
    for message in run_distributed(2, _mismatched_sizes, timeout_s=60):
        assert message is not None and "different layouts" in message
        assert "tp: rank 0 has 2, rank 1 has 1" in message


def test_group_lookup_is_shared_not_searched(capsys):
    layout = RankLayout(16384, tp=2, pp=2)
    dp = layout.group_view("dp", 0)
    assert all(layout.group_view("dp", r) is dp for r in dp)   # one list per group, no search
    assert layout.group_of("dp", 2) == dp and layout.group_of("dp", 2) is not dp   # a copy
    assert layout_main(["--world-size", "16384", "--tp", "2", "--pp", "2"]) == 0
    table = capsys.readouterr().out
    rows = re.findall(r"^ +R(\d+) ", table, flags=re.MULTILINE)
    assert rows == [str(r) for r in range(16384)]
