"""Batch arithmetic: micro-batches per step (with Megatron's batch-size ramp-up) and the bubble.

Global batch B = micro-batch size b × micro-batches per step m × data-parallel size d, so
m = B / (b·d). Example: B 1536, b 1, d 12 → m 128.

Ramp-up ``[start, increment, samples]`` (Megatron-core's ``--rampup-batch-size``): the global batch
grows from ``start`` to B in ``n = (B − start) / increment`` steps of ``increment``, spread evenly
over the first ``samples`` consumed samples::

    batch(consumed) = start + int(consumed / (samples / n)) · increment    while consumed ≤ samples
                    = B                                                   after

(the float expression is Megatron-core's, kept so that step boundaries agree exactly).
``decrease_batch_size_if_needed`` rounds the running batch down to a multiple of b·d.

Stricter than Megatron: every batch size the ramp can reach is checked at construction, so an
indivisible start (which Megatron silently floors on its first update) or a batch that rounds
down to zero micro-batches is a ValueError before training starts.
"""
from __future__ import annotations

from tpfuse.parallel.checks import check_int_at_least


def _integral(value):
    """Megatron's ``int(...)`` of a ramp-up entry (a CLI string, a numpy int), refusing a
    fraction; anything else is returned unchanged for the checks to name."""
    if isinstance(value, (str, float)) or (hasattr(value, "__index__")
                                           and not isinstance(value, bool)):
        number = float(value)
        if number != int(number):
            raise ValueError(f"{value!r} is not an integer")
        return int(number)
    return value


def _positive_int(name: str, value) -> int:
    return check_int_at_least(name, value, 1)


class MicrobatchCalculator:
    """Number of micro-batches per optimizer step, constant or ramping up with consumed samples.

    Attributes after each ``update``: ``num_microbatches``, ``current_global_batch_size`` (the
    ramp's value), ``current_running_global_batch_size`` (what is actually run:
    ``num_microbatches · micro_batch_size · data_parallel_size``).
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size=None, decrease_batch_size_if_needed: bool = False):
        self.global_batch_size = _positive_int("global_batch_size", global_batch_size)
        self.micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        self.data_parallel_size = _positive_int("data_parallel_size", data_parallel_size)
        self.decrease_batch_size_if_needed = bool(decrease_batch_size_if_needed)
        self.samples_per_microbatch_step = micro_batch_size * data_parallel_size  # b·d
        self.rampup_batch_size = None
        self._num_increments = 0
        if rampup_batch_size is not None:
            self._set_rampup(rampup_batch_size)
        for batch in self.reachable_global_batch_sizes():
            try:
                self._running(batch)
            except ValueError as error:
                if self.rampup_batch_size is None:
                    raise
                raise ValueError(f"{error}; it is a step of rampup_batch_size="
                                 f"{self.rampup_batch_size}") from None
        self.update(0, consistency_check=True)

    def _set_rampup(self, rampup) -> None:
        try:
            start, increment, samples = (_integral(v) for v in rampup)
        except (TypeError, ValueError):
            raise ValueError(f"rampup_batch_size must be [start, increment, samples] (integers, "
                             f"or their strings as Megatron's CLI passes them), got "
                             f"{rampup!r}") from None
        _positive_int("rampup_batch_size start", start)
        _positive_int("rampup_batch_size increment", increment)
        check_int_at_least("rampup_batch_size samples", samples, 0)
        diff = self.global_batch_size - start
        if diff < 0:
            raise ValueError(f"rampup_batch_size start={start} exceeds "
                             f"global_batch_size={self.global_batch_size}")
        if diff % increment:
            raise ValueError(f"global_batch_size - start = {self.global_batch_size} - {start} = "
                             f"{diff} is not divisible by the rampup increment {increment}")
        if diff and samples == 0:
            raise ValueError(f"rampup_batch_size samples=0 cannot ramp from {start} to "
                             f"{self.global_batch_size}; give samples >= 1")
        self.rampup_batch_size = [start, increment, samples]
        self._num_increments = diff // increment

    def reachable_global_batch_sizes(self) -> list[int]:
        """Every global batch size the schedule can produce, smallest first."""
        if self.rampup_batch_size is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup_batch_size
        return [start + k * increment for k in range(self._num_increments + 1)]

    def _running(self, batch: int) -> int:
        """The batch actually run for a schedule value ``batch`` (ValueError if impossible)."""
        unit = self.samples_per_microbatch_step
        if batch % unit == 0:
            return batch
        if not self.decrease_batch_size_if_needed:
            raise ValueError(
                f"global batch size {batch} is not divisible by micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={self.data_parallel_size} = {unit}"
                f" (set decrease_batch_size_if_needed=True to round it down)")
        if batch < unit:
            raise ValueError(
                f"global batch size {batch} is smaller than micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={self.data_parallel_size} = {unit}"
                f": rounding down would leave zero micro-batches")
        return batch // unit * unit

    def _scheduled_batch(self, consumed_samples: int) -> int:
        if self.rampup_batch_size is None or self._num_increments == 0:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        if consumed_samples > samples:
            return self.global_batch_size
        steps = int(consumed_samples / (samples / self._num_increments))
        return start + steps * increment

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Set the batch sizes for the step that starts after ``consumed_samples`` samples.

        ``consistency_check`` is kept for Megatron compatibility: every reachable batch was
        validated at construction, so the check cannot fail here.
        """
        check_int_at_least("consumed_samples", consumed_samples, 0)
        self.current_global_batch_size = self._scheduled_batch(consumed_samples)
        self.current_running_global_batch_size = self._running(self.current_global_batch_size)
        self.num_microbatches = (self.current_running_global_batch_size
                                 // self.samples_per_microbatch_step)

    # Megatron-style accessors
    def get(self) -> int:
        return self.num_microbatches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def __repr__(self) -> str:
        return (f"MicrobatchCalculator(global_batch_size={self.global_batch_size}, "
                f"micro_batch_size={self.micro_batch_size}, "
                f"data_parallel_size={self.data_parallel_size}, "
                f"rampup_batch_size={self.rampup_batch_size}, "
                f"decrease_batch_size_if_needed={self.decrease_batch_size_if_needed})")


def bubble_fraction(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Fraction of a step's time a pipeline stage sits idle, for 1F1B (vpp=1) or interleaved.

    Let t be one micro-batch's forward+backward time on one stage. 1F1B runs m micro-batches in
    (m + p − 1)·t: m·t of useful work plus a (p − 1)·t fill/drain bubble, so

        bubble_fraction = (p − 1) / (m + p − 1).

    Interleaving v model chunks per rank makes the unit of pipelining one chunk (time t/v): the
    useful work is m·v chunk-units and the bubble (p − 1) chunk-units, so

        bubble_fraction = (p − 1) / (v·m + p − 1),

    i.e. the bubble shrinks by v. (Narayanan et al. quote bubble/ideal = (p − 1)/(v·m) instead.)
    p = 1 has no bubble.
    """
    _positive_int("pp", pp)
    _positive_int("num_microbatches", num_microbatches)
    _positive_int("vpp", vpp)
    return (pp - 1) / (vpp * num_microbatches + pp - 1)
