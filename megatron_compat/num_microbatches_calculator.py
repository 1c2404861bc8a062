"""megatron-core 0.16's ``num_microbatches_calculator``: the module-level micro-batch API and
Megatron's calculator classes.

    init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                     micro_batch_size, data_parallel_size,
                                     decrease_batch_size_if_needed=False)
    get_num_microbatches(), get_current_global_batch_size(), get_micro_batch_size(),
    get_current_running_global_batch_size(), update_num_microbatches(consumed_samples, ...),
    reconfigure_num_microbatches_calculator(...), destroy_num_microbatches_calculator()

The calculator lives where Megatron keeps it, in the module global
``_GLOBAL_NUM_MICROBATCHES_CALCULATOR`` (code and Megatron's tests reset it to None), and
``_build_num_microbatches_calculator`` returns a calculator without installing it. The ramp's
schedule is the same expression as ``tpfuse.parallel.microbatches``' (checked against it in the
tests); the checks are Megatron's, raised where Megatron raises them: a constant batch that micro × dp
does not divide at construction, a ramp-up step that it does not divide at the ``update`` that
reaches it (with ``consistency_check``), both as ``MicrobatchAssertionError`` — an
AssertionError as Megatron's ``assert`` raises, and a RuntimeError. tpfuse's native
``MicrobatchCalculator`` is stricter: it checks every step of the ramp at construction.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class MicrobatchAssertionError(AssertionError, RuntimeError):
    """A failed Megatron ``assert`` of the calculator (AssertionError, also a RuntimeError)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise MicrobatchAssertionError(message)


def _round_down(batch: int, unit: int) -> int:
    """The largest multiple of ``unit`` not above ``batch`` (Megatron's ``_round``)."""
    return batch // unit * unit


class NumMicroBatchesCalculator:
    """Megatron's base: ``num_micro_batches``, ``current_global_batch_size``,
    ``current_running_global_batch_size`` and ``micro_batch_size`` after each ``update``."""

    def __init__(self) -> None:
        self.num_micro_batches = None
        self.current_global_batch_size = None
        self.micro_batch_size = None
        self.current_running_global_batch_size = None

    @property
    def num_microbatches(self) -> int:          # tpfuse's name for the same number
        return self.num_micro_batches

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        raise NotImplementedError

    def _set_running(self, consistency_check: bool) -> None:
        """Running batch and micro-batch count from ``current_global_batch_size``."""
        unit = self.micro_batch_times_data_parallel_size
        batch = self.current_global_batch_size
        if consistency_check and not self.decrease_batch_size_if_needed:
            _check(batch % unit == 0,
                   f"current global batch size ({batch}) is not divisible by micro-batch-size "
                   f"({self.micro_batch_size}) times data parallel size "
                   f"({self.data_parallel_size})")
        if self.decrease_batch_size_if_needed and batch % unit:
            batch = _round_down(batch, unit)
        self.current_running_global_batch_size = batch
        self.num_micro_batches = batch // unit


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A constant global batch: ``global / (micro · dp)`` micro-batches, checked here."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size,
                 decrease_batch_size_if_needed, rank):
        super().__init__()
        self.global_batch_size = self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self._set_running(consistency_check=True)
        _check(self.num_micro_batches >= 1,
               f"number of micro-batches should be at least 1, got {self.num_micro_batches}")

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Megatron's ramp-up: the batch grows by ``batch_size_increment`` every
    ``rampup_samples_per_increment`` consumed samples from ``start_global_batch_size`` to
    ``global_batch_size`` (tpfuse's schedule); each ``update`` checks the step it reaches."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size,
                 decrease_batch_size_if_needed, rank, start_global_batch_size,
                 batch_size_increment, ramup_samples):
        super().__init__()
        _check(global_batch_size > 0, f"global batch size should be positive, got "
                                      f"{global_batch_size}.")
        _check(start_global_batch_size > 0, f"start batch size should be positive, got "
                                            f"{start_global_batch_size}.")
        _check(batch_size_increment > 0, f"batch size increment should be positive, got "
                                         f"{batch_size_increment}.")
        _check(ramup_samples >= 0, f"ramp-up samples should be non-negative, got "
                                   f"{ramup_samples}.")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        _check(self.micro_batch_times_data_parallel_size > 0,
               "micro batch size times data parallel size must be positive")
        diff = global_batch_size - start_global_batch_size
        _check(diff >= 0, f"expected global batch size to be greater than or equal to start "
                          f"batch size, got {global_batch_size} and {start_global_batch_size}")
        _check(diff % batch_size_increment == 0,
               f"expected global batch size interval ({diff}) to be divisible by global batch "
               f"size increment ({batch_size_increment})")
        increments = diff // batch_size_increment
        if increments == 0:
            raise ZeroDivisionError("division by zero: global batch size equals the start "
                                    "batch size, there is nothing to ramp up (as Megatron)")
        self.rampup_samples_per_increment = ramup_samples / increments
        self.update(0, consistency_check=False, verbose=True)

    def _scheduled_batch(self, consumed_samples) -> int:
        """``start + int(consumed / samples_per_increment) · increment`` during the ramp
        (the float expression of ``tpfuse.parallel.microbatches``), the global batch after."""
        if consumed_samples > self.ramup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start_global_batch_size + steps * self.batch_size_increment

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        before = self.current_global_batch_size
        self.current_global_batch_size = self._scheduled_batch(consumed_samples)
        _check(self.current_global_batch_size <= self.global_batch_size,
               "the ramp went past the global batch size")
        if verbose and self.rank == 0 and before != self.current_global_batch_size:
            logger.info("setting global batch size to %d", self.current_global_batch_size)
        self._set_running(consistency_check)


_GLOBAL_NUM_MICROBATCHES_CALCULATOR: NumMicroBatchesCalculator | None = None


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise MicrobatchAssertionError("num microbatches calculator is not initialized: call "
                                       "init_num_microbatches_calculator(...) first")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def _build_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                       micro_batch_size, data_parallel_size,
                                       decrease_batch_size_if_needed):
    """A new calculator (constant, or ramping up for a ``[start, increment, samples]``);
    the module's global is left alone."""
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size,
            decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    _check(len(rampup_batch_size) == 3,
           "expected the following format: --rampup-batch-size <start batch size> "
           "<batch size incerement> <ramp-up samples>")
    start, increment, samples = (_as_int(v, "rampup_batch_size") for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed, rank, start, increment, samples)


def _as_int(value, name):
    """Megatron's ``int(...)`` of a flag value (CLI strings included), refusing a fraction."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not an integer") from None
    if number != int(number):
        raise ValueError(f"{name}: {value!r} is not an integer")
    return int(number)


def _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size,
               data_parallel_size, decrease_batch_size_if_needed, init):
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if init:
        _check(_GLOBAL_NUM_MICROBATCHES_CALCULATOR is None,
               "num microbatches calculator is already initialized.")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                     micro_batch_size, data_parallel_size,
                                     decrease_batch_size_if_needed=False) -> None:
    """Create the module's calculator (an assertion error if one exists: destroy it first)."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size,
               data_parallel_size, decrease_batch_size_if_needed, init=True)


def reconfigure_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                            micro_batch_size, data_parallel_size,
                                            decrease_batch_size_if_needed=False) -> None:
    """Replace the module's calculator (e.g. for evaluation with another batch size)."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size,
               data_parallel_size, decrease_batch_size_if_needed, init=False)


def destroy_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def unset_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True,
                            verbose: bool = False) -> None:
    _calculator().update(consumed_samples, consistency_check, verbose)
