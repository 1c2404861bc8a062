"""Per-step timers (``--timing-log-level`` / ``--timing-log-option``).

Unit part (no processes): log-level filtering, accumulation over start/stop pairs, ``collect``
resetting, the gathered summary and Megatron's text block, checked against hand-made values.
Integration: ``pretrain`` at pp=2 with ZB-H1 and level 2 writes every timer of the level into
the metrics file each iteration, and the breakdown is consistent: inside ``forward-backward`` a
rank's compute (forward + backward + weight-gradient) plus its p2p time never exceeds the whole
(they are disjoint intervals of it), and the weight-gradient timer is non-zero (W ran).
No assertion is made on absolute times (the machine is shared).
"""
import json
import time

import pytest

from support.pretrain_run import run_pretrain
from tpfuse.training.timers import Timers, format_timers, summarize


def test_levels_accumulation_and_collect():
    timers = Timers(log_level=1)
    assert timers("forward-compute", 2).start() is timers("backward-compute", 2)  # no-op timer
    fb = timers("forward-backward", 1)
    for _ in range(2):
        fb.start()
        time.sleep(0.002)
        fb.stop()
    with timers("optimizer", 1):
        pass
    values = timers.collect()
    assert list(values) == ["forward-backward", "all-grads-sync", "embedding-grads-all-reduce",
                            "optimizer"]                       # the level-1 names, in order
    assert values["forward-backward"] >= 4.0                   # two sleeps of 2 ms, in ms
    assert values["all-grads-sync"] == 0.0                     # never ran
    assert timers.collect()["forward-backward"] == 0.0         # collect resets
    with pytest.raises(RuntimeError, match="started twice"):
        fb.start()
        fb.start()


def test_summary_and_text():
    gathered = {"forward-backward": [10.0, 30.0], "optimizer": [2.0, 1.0]}
    assert summarize(gathered, "max") == {"forward-backward": {"max": 30.0},
                                          "optimizer": {"max": 2.0}}
    minmax = summarize(gathered, "minmax")
    assert minmax["forward-backward"] == {"min": 10.0, "max": 30.0}
    text = format_timers(minmax, "minmax", normalizer=2)
    assert text.splitlines()[0] == "(min, max) time across ranks (ms):"
    assert "forward-backward" in text and "(5.00, 15.00)" in text
    assert "(1.00, 0.50)" not in text and "(0.50, 1.00)" in text
    assert "15.00" in format_timers(summarize(gathered, "max"), "max", normalizer=2)
    assert "10.00, 30.00" in format_timers(summarize(gathered, "all"), "all")


@pytest.mark.parametrize("kwargs, words", [
    (dict(log_level=3), ["--timing-log-level", "3"]),
    (dict(log_option="median"), ["--timing-log-option", "median"]),
])
def test_bad_settings(kwargs, words):
    with pytest.raises(ValueError) as info:
        Timers(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_pretrain_writes_the_breakdown(run_distributed, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
            "--seq-length", "8", "--vocab-size", "63", "--mock-data",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
            "--eval-iters", "0", "--log-interval", "2", "--no-progress-bar",
            "--no-layout-table", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "zb-h1", "--timing-log-level", "2",
            "--timing-log-option", "all", "--lr", "1e-3", "--metrics-file", str(metrics)]
    run_distributed(2, run_pretrain, argv)
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert len(records) == 3
    timers = Timers(log_level=2)
    for record in records:
        timing = record["timers_ms"]
        assert list(timing) == timers.names()
        parts = ("forward-compute", "backward-compute", "weight-grad-compute", "forward-recv",
                 "backward-recv", "forward-send", "backward-send")
        for rank in range(2):     # disjoint intervals inside the rank's forward-backward
            whole = timing["forward-backward"]["ranks"][rank]
            assert 0.0 < sum(timing[p]["ranks"][rank] for p in parts) <= whole
            assert timing["weight-grad-compute"]["ranks"][rank] > 0.0     # W ran
            assert timing["optimizer"]["ranks"][rank] > 0.0
