"""Python garbage collection at chosen iterations (Megatron's ``--manual-gc``).

CPython's collector starts a collection whenever its allocation counters cross a threshold, so a
collection of the older generations (tens of milliseconds on a trainer holding millions of
objects) lands in some iteration of some rank. In a data- or pipeline-parallel job the other ranks
then wait for that one at the next collective: the pause costs every rank, and it shows as jitter
in the step times. ``--manual-gc`` turns the automatic collector off and collects at points that
are the same on every rank:

==============================  ==============================================================
training starts                 ``gc.disable()``, then one full ``gc.collect()``
every ``--manual-gc-interval``  a full ``gc.collect()`` after iteration N·interval
iterations (0: never)
around each evaluation          a full ``gc.collect()`` before it and a young-generation one
                                (``gc.collect(0)``) after it, unless ``--no-manual-gc-eval``
training ends                   the collector's previous state is restored
==============================  ==============================================================

Reference cycles made during training are then freed only at those points (the reference counts
free everything else at once), so a long interval holds their memory longer.
"""
from __future__ import annotations

import contextlib
import gc


def add_gc_arguments(parser) -> None:
    """Megatron's garbage-collection flags."""
    group = parser.add_argument_group("garbage collection")
    group.add_argument("--manual-gc", action="store_true",
                       help="turn Python's automatic garbage collector off during training and "
                            "collect at the same iterations on every rank")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="with --manual-gc: collect every this many iterations (0: only when "
                            "training starts and around evaluations)")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="with --manual-gc: do not collect before and after each evaluation")


def check_gc_arguments(args) -> None:
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0 (0: no periodic collection), got "
                         f"{args.manual_gc_interval}")


class ManualGC:
    """The collection points of the table above; every method is a no-op without ``--manual-gc``.

        collector = ManualGC(args)
        try:
            collector.start()
            while training:
                step(); iteration += 1
                collector.after_iteration(iteration)
                with collector.around_evaluation():
                    evaluate()
        finally:
            collector.stop()
    """

    def __init__(self, args):
        self.enabled = bool(args.manual_gc)
        self.interval = args.manual_gc_interval
        self.at_evaluation = self.enabled and args.manual_gc_eval
        self._was_enabled = None

    def start(self) -> None:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def stop(self) -> None:
        """Restore the collector as ``start`` found it (safe to call without ``start``)."""
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self):
        if self.at_evaluation:
            gc.collect()
        try:
            yield
        finally:
            if self.at_evaluation:
                gc.collect(0)
