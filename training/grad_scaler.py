"""Loss scaling for fp16 (Megatron's grad_scaler): the loss is multiplied by ``scale`` before
backward so small gradients survive fp16's range, and the gradients are divided by it again before
the optimizer step.

``DynamicGradScaler`` (``--fp16`` without ``--loss-scale``), Megatron's rule. On a step whose
gradients hold an inf/nan (``found_inf``)::

    growth_tracker ← 0;  hysteresis_tracker ← hysteresis_tracker − 1
    if hysteresis_tracker ≤ 0:  scale ← max(scale · backoff, min_scale)

otherwise::

    growth_tracker ← growth_tracker + 1
    if growth_tracker == window:  growth_tracker ← 0;  hysteresis_tracker ← hysteresis;
                                  scale ← scale · growth

So with hysteresis h the scale halves at the h-th overflow since the last growth and at every
overflow after that, and it doubles after ``window`` consecutive clean steps (which also restores
the hysteresis budget). The step with found_inf is skipped by the optimizer either way.
``ConstantGradScaler`` (``--loss-scale S``) never changes. The scale is a Python float (no device
synchronisation to read it).
"""
from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """The step is skipped on an overflow, the scale stays."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Megatron's DynamicGradScaler (defaults: growth 2, backoff 0.5; see the module docstring)."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        checks = (("--initial-loss-scale", initial_scale > 0, initial_scale),
                  ("--min-loss-scale", 0 < min_scale <= initial_scale, min_scale),
                  ("--loss-scale-window", growth_interval > 0, growth_interval),
                  ("--hysteresis", hysteresis > 0, hysteresis),
                  ("growth_factor", growth_factor > 1, growth_factor),
                  ("backoff_factor", 0 < backoff_factor < 1, backoff_factor))
        for flag, ok, value in checks:
            if not ok:
                raise ValueError(f"{flag}={value} is invalid (needs initial > 0, 0 < min <= "
                                 "initial, window >= 1, hysteresis >= 1)")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor = float(min_scale), float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(fp16: bool, loss_scale: float | None, initial_loss_scale: float,
                      min_loss_scale: float, loss_scale_window: int, hysteresis: int):
    """Megatron's choice: ``--loss-scale`` → constant; fp16 without it → dynamic; else None."""
    if loss_scale is not None:
        return ConstantGradScaler(loss_scale)
    if fp16:
        return DynamicGradScaler(initial_loss_scale, min_loss_scale,
                                 growth_interval=loss_scale_window, hysteresis=hysteresis)
    return None
