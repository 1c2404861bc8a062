"""Loss scalers against Megatron's DynamicGradScaler rule, step by step by hand."""
import pytest

from tpfuse.training.grad_scaler import (ConstantGradScaler, DynamicGradScaler,
                                         build_grad_scaler)


def _trace(scaler, found_infs):
    scales = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    return scales


def test_hysteresis_two_halves_at_the_second_overflow_then_at_every_one():
    scaler = DynamicGradScaler(initial_scale=1024.0, hysteresis=2, growth_interval=1000)
    # overflow 1: tracker 2 → 1 (no change); overflow 2: → 0, halve; 3: → -1, halve again;
    # a clean step does not restore the hysteresis budget (only a growth does), so 4 halves too
    assert _trace(scaler, [True, True, True, False, True]) == [1024, 512, 256, 256, 128]


def test_window_of_clean_steps_doubles_and_restores_hysteresis():
    scaler = DynamicGradScaler(initial_scale=8.0, hysteresis=2, growth_interval=3)
    # overflow (tracker 1), then 3 clean steps: growth → 16 and tracker back to 2; an overflow
    # resets the growth count, so the next doubling needs 3 more clean steps
    assert _trace(scaler, [True, False, False, False, True, False, False, True]) == \
        [8, 8, 8, 16, 16, 16, 16, 8]


def test_scale_never_below_min_and_state_round_trips():
    scaler = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    assert _trace(scaler, [True, True, True]) == [2.0, 2.0, 2.0]
    other = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    other.load_state_dict(scaler.state_dict())
    assert (other.scale, other.growth_tracker, other.hysteresis_tracker) == \
        (scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker)


def test_megatron_choice_of_scaler():
    assert isinstance(build_grad_scaler(True, None, 2.0**32, 1.0, 1000, 2), DynamicGradScaler)
    dynamic = build_grad_scaler(True, None, 2.0**32, 1.0, 1000, 2)
    assert (dynamic.scale, dynamic.growth_interval, dynamic.hysteresis) == (2.0**32, 1000, 2)
    constant = build_grad_scaler(True, 128.0, 2.0**32, 1.0, 1000, 2)
    assert isinstance(constant, ConstantGradScaler)
    assert _trace(constant, [True, False, True]) == [128.0] * 3
    assert build_grad_scaler(False, None, 2.0**32, 1.0, 1000, 2) is None      # bf16 / fp32


@pytest.mark.parametrize("kwargs, flag", [({"initial_scale": 0.0}, "--initial-loss-scale"),
                                          ({"hysteresis": 0}, "--hysteresis"),
                                          ({"growth_interval": 0}, "--loss-scale-window"),
                                          ({"min_scale": 8.0, "initial_scale": 4.0},
                                           "--min-loss-scale")])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DynamicGradScaler(**kwargs)
