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
from dataclasses import dataclass

from .settings_fields import SettingsGroup, setting


@dataclass(frozen=True, kw_only=True)
class GarbageCollectionSettings(SettingsGroup):
    """Megatron's garbage-collection flags."""
    TITLE = "garbage collection"

    manual_gc: bool = setting(
        False, "turn Python's automatic garbage collector off during training and collect at "
               "the same iterations on every rank")
    manual_gc_interval: int = setting(
        0, "with --manual-gc: collect every this many iterations (0: only when training starts "
           "and around evaluations)")
    manual_gc_eval: bool = setting(
        True, "with --manual-gc: do not collect before and after each evaluation",
        flag="--no-manual-gc-eval")

    def check(self) -> None:
        if self.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0 (0: no periodic collection), "
                             f"got {self.manual_gc_interval}")


class ManualGC:
    """The collection points of the table above; every method is a no-op without ``--manual-gc``.

        collector = ManualGC(settings)          # GarbageCollectionSettings
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

    def __init__(self, settings: GarbageCollectionSettings):
        self.enabled = bool(settings.manual_gc)
        self.interval = settings.manual_gc_interval
        self.at_evaluation = self.enabled and settings.manual_gc_eval
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
