"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (Megatron's defaults).

Steps are optimizer iterations, or consumed samples for a sample-based run (``unit="samples"``,
``step(global batch)`` after each applied update, as Megatron counts). With ``warmup`` steps, peak
``max_lr``, floor ``min_lr`` and decay ending at ``decay_steps`` (defaults to the run's length)::

    lr(n) = max_lr · n / warmup                                   n ≤ warmup
    lr(n) = min_lr + ½(max_lr − min_lr)(1 + cos(π · (n − warmup) / (decay_steps − warmup)))
                                                                  warmup < n ≤ decay_steps
    lr(n) = min_lr                                                n > decay_steps

As in Megatron, the lr for the first update is lr(0) (= 0 when there is a warm-up).
"""
from __future__ import annotations

import math

SCHEDULE_UNITS = {"iterations": "iters", "samples": "samples"}   # unit -> Megatron's flag suffix


class LRScheduler:
    """Sets ``lr`` on every param group of ``optimizer``; ``step()`` after each optimizer step."""

    def __init__(self, optimizer, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0,
                 decay_steps: int | None = None, decay_style: str = "cosine",
                 unit: str = "iterations"):
        if unit not in SCHEDULE_UNITS:
            raise ValueError(f"unit must be one of {sorted(SCHEDULE_UNITS)}, got {unit!r}")
        suffix = SCHEDULE_UNITS[unit]
        if max_lr < 0 or min_lr < 0 or min_lr > max_lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got lr={max_lr}, min_lr={min_lr}")
        if warmup_steps < 0:
            raise ValueError(f"lr_warmup_{suffix} must be >= 0, got {warmup_steps}")
        if decay_steps is not None and decay_steps < warmup_steps:
            raise ValueError(f"lr_decay_{suffix} ({decay_steps}) must be >= "
                             f"lr_warmup_{suffix} ({warmup_steps})")
        if decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_decay_style must be cosine, linear or constant, got {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style, self.unit = decay_style, unit
        self.num_steps = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        decay_steps = self.decay_steps
        if decay_steps is None or step > decay_steps:
            return self.min_lr if decay_steps is not None else self.max_lr
        span = decay_steps - self.warmup_steps
        ratio = (step - self.warmup_steps) / span if span > 0 else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style, "unit": self.unit}

    def load_state_dict(self, state: dict) -> None:
        unit = state.get("unit", "iterations")
        if unit != self.unit:
            raise ValueError(f"the checkpoint's lr schedule counts {unit} and this run's counts "
                             f"{self.unit}: resume a --train-{SCHEDULE_UNITS[unit]} run with "
                             f"--train-{SCHEDULE_UNITS[unit]}")
        self.num_steps = int(state["num_steps"])
        self._apply()
