"""megatron-core 0.16's ``num_microbatches_calculator``: the module-level micro-batch API and
Megatron's calculator classes, over ``tpfuse.parallel.microbatches.MicrobatchCalculator``.

    init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                     micro_batch_size, data_parallel_size,
                                     decrease_batch_size_if_needed=False)
    get_num_microbatches(), get_current_global_batch_size(), get_micro_batch_size(),
    get_current_running_global_batch_size(), update_num_microbatches(consumed_samples, ...),
    reconfigure_num_microbatches_calculator(...), destroy_num_microbatches_calculator()

The classes carry Megatron's attribute names (``num_micro_batches``,
``micro_batch_times_data_parallel_size``; for ramp-up ``start_global_batch_size``,
``batch_size_increment``, ``ramup_samples``, ``rampup_samples_per_increment``). Stricter than
Megatron (as the native calculator): a ramp-up step whose batch is not divisible by
micro × dp is refused at construction unless ``decrease_batch_size_if_needed``.
"""
from __future__ import annotations

import logging

from tpfuse.parallel.microbatches import MicrobatchCalculator

logger = logging.getLogger(__name__)


class NumMicroBatchesCalculator(MicrobatchCalculator):
    """Megatron's attribute names over the native calculator."""

    @property
    def num_micro_batches(self) -> int:
        return self.num_microbatches

    @property
    def micro_batch_times_data_parallel_size(self) -> int:
        return self.samples_per_microbatch_step

    def update(self, consumed_samples, consistency_check=True, verbose=False) -> None:
        before = getattr(self, "current_global_batch_size", None)
        super().update(consumed_samples, consistency_check)
        if verbose and self.rank == 0 and before != self.current_global_batch_size:
            logger.info("setting global batch size to %d (running %d, %d micro-batches)",
                        self.current_global_batch_size, self.current_running_global_batch_size,
                        self.num_microbatches)


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size,
                 decrease_batch_size_if_needed, rank):
        self.rank = rank
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size,
                         decrease_batch_size_if_needed=decrease_batch_size_if_needed)


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size,
                 decrease_batch_size_if_needed, rank, start_global_batch_size,
                 batch_size_increment, ramup_samples):
        self.rank = rank
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size,
                         rampup_batch_size=[start_global_batch_size, batch_size_increment,
                                            ramup_samples],
                         decrease_batch_size_if_needed=decrease_batch_size_if_needed)
        self.start_global_batch_size, self.batch_size_increment, self.ramup_samples = \
            self.rampup_batch_size
        increments = (global_batch_size - start_global_batch_size) // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / increments if increments else 0.0


class _Holder:
    calculator: NumMicroBatchesCalculator | None = None


_GLOBAL = _Holder()


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL.calculator is None:
        raise RuntimeError("num microbatches calculator is not initialized: call "
                           "init_num_microbatches_calculator(...) first")
    return _GLOBAL.calculator


def _build(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
           decrease_batch_size_if_needed):
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size,
            decrease_batch_size_if_needed, rank)
    else:
        if len(rampup_batch_size) != 3:
            raise ValueError("rampup_batch_size must be [start global batch size, batch size "
                             f"increment, ramp-up samples], got {rampup_batch_size!r}")
        start, increment, samples = (_as_int(v, "rampup_batch_size") for v in rampup_batch_size)
        calculator = RampupBatchsizeNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size,
            decrease_batch_size_if_needed, rank, start, increment, samples)
    if rank == 0:
        logger.info("number of micro-batches: %d", calculator.get())
    _GLOBAL.calculator = calculator


def _as_int(value, name):
    """Megatron's ``int(...)`` of a flag value (CLI strings included), refusing a fraction."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {value!r} is not an integer") from None
    if number != int(number):
        raise ValueError(f"{name}: {value!r} is not an integer")
    return int(number)


def init_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                     micro_batch_size, data_parallel_size,
                                     decrease_batch_size_if_needed=False) -> None:
    """Create the module's calculator (RuntimeError if one exists: destroy it first)."""
    if _GLOBAL.calculator is not None:
        raise RuntimeError("num microbatches calculator is already initialized")
    _build(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
           decrease_batch_size_if_needed)


def reconfigure_num_microbatches_calculator(rank, rampup_batch_size, global_batch_size,
                                            micro_batch_size, data_parallel_size,
                                            decrease_batch_size_if_needed=False) -> None:
    """Replace the module's calculator (e.g. for evaluation with another batch size)."""
    _build(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
           decrease_batch_size_if_needed)


def destroy_num_microbatches_calculator() -> None:
    _GLOBAL.calculator = None


def unset_num_microbatches_calculator() -> None:
    _GLOBAL.calculator = None


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
