"""``--manual-gc``: the automatic collector is off while training, and collections happen exactly at
the iterations Megatron's rule names (counted through ``gc.callbacks``), around evaluations, and
nowhere else; the collector's state is restored afterwards."""
import gc

import pytest

from support.pretrain_run import run_pretrain
from tpfuse.training import arguments
from tpfuse.training.garbage_collection import GarbageCollectionSettings, ManualGC


def _settings(manual_gc=True, interval=0, at_eval=True):
    return GarbageCollectionSettings(manual_gc=manual_gc, manual_gc_interval=interval,
                                     manual_gc_eval=at_eval)


@pytest.fixture
def collections():
    """Generations of the collections run while the test holds this list."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()             # allocation counters at 0: the few allocations of a test with the
    gc.callbacks.append(record)   # collector on cannot reach its threshold by chance
    yield seen
    gc.callbacks.remove(record)


def _train(collector, iterations, eval_interval, make_garbage=0):
    """The loop's calls, as pretrain makes them; returns whether gc was enabled inside."""
    enabled_inside = []
    collector.start()
    try:
        for iteration in range(1, iterations + 1):
            for _ in range(make_garbage):       # cycles: enough to cross gc's thresholds
                cycle = []
                cycle.append(cycle)
            enabled_inside.append(gc.isenabled())
            collector.after_iteration(iteration)
            if eval_interval and iteration % eval_interval == 0:
                with collector.around_evaluation():
                    enabled_inside.append(gc.isenabled())
    finally:
        collector.stop()
    return enabled_inside


def test_collections_at_the_named_points_only(collections):
    assert gc.isenabled()
    inside = _train(ManualGC(_settings(interval=4)), iterations=10, eval_interval=5,
                    make_garbage=2000)
    # start: full; iteration 4: full; evaluation after 5: full before, gen 0 after; iteration 8:
    # full; evaluation after 10: full, gen 0
    assert collections == [2, 2, 2, 0, 2, 2, 0]
    assert not any(inside) and gc.isenabled()


def test_no_eval_collections_and_no_interval(collections):
    _train(ManualGC(_settings(interval=0, at_eval=False)), iterations=6, eval_interval=2,
           make_garbage=2000)
    assert collections == [2]                    # only the one at the start


def test_off_by_default_leaves_the_collector_alone(collections):
    _train(ManualGC(_settings(manual_gc=False, interval=1)), iterations=3, eval_interval=1)
    assert collections == [] and gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        _train(ManualGC(_settings(interval=2)), iterations=2, eval_interval=0)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_flags_parse_with_megatron_names_and_defaults():
    parsed = arguments.build_parser().parse_args([])
    assert (parsed.manual_gc, parsed.manual_gc_interval, parsed.manual_gc_eval) == (False, 0, True)
    parsed = arguments.build_parser().parse_args(
        ["--manual-gc", "--manual-gc-interval", "100", "--no-manual-gc-eval"])
    assert (parsed.manual_gc, parsed.manual_gc_interval, parsed.manual_gc_eval) == (True, 100, False)


def test_negative_interval_is_refused_by_name():
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-5",
            "--mock-data", "--vocab-size", "128", "--manual-gc-interval", "-1"]
    with pytest.raises(ValueError, match="--manual-gc-interval must be >= 0"):
        arguments.parse_args(argv)


def _collections_in_training(argv):
    seen = []

    def record(phase, info):
        if phase == "start" and not gc.isenabled():   # the collector is off only while training
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        run_pretrain(argv)
    finally:
        gc.callbacks.remove(record)
    return seen, gc.isenabled()


def test_pretrain_collects_at_megatrons_points(run_distributed):
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
            "--vocab-size", "64", "--train-iters", "6", "--eval-iters", "1", "--eval-interval", "2",
            "--no-progress-bar", "--no-layout-table", "--manual-gc", "--manual-gc-interval", "3"]
    (seen, enabled_after), = run_distributed(1, _collections_in_training, argv)
    # start; evaluation at 2 (full, gen 0); iteration 3; evaluation at 4; iteration 6, then its
    # evaluation
    assert seen == [2, 2, 0, 2, 2, 0, 2, 2, 0]
    assert enabled_after
