"""Learning-rate schedule: linear warm-up, then a decay to a floor (Megatron's
``--lr-decay-style`` and its formulas).

Steps are optimizer iterations, or consumed samples for a sample-based run (``unit="samples"``,
``step(global batch)`` after each applied update, as Megatron counts). With ``warmup`` steps W, peak
``max_lr``, floor ``min_lr`` and decay ending at ``decay_steps`` D (defaults to the run's length)::

    lr(n) = max_lr · n / W                                        n ≤ W
    lr(n) = min_lr + c(n) · (max_lr − min_lr)                     W < n ≤ D
    lr(n) = min_lr                                                n > D

with, for the decay styles (r = (n − W) / (D − W)):

    constant              lr = max_lr after the warm-up, whatever D
    linear                c = 1 − r
    cosine                c = ½ (1 + cos(π r))
    inverse-square-root   lr = max(min_lr, max_lr · √(max(W, 1) / n))
    WSD                   warm-up, stable, decay: c = 1 until the last A steps before D
                          (A = ``wsd_decay_steps``, Megatron's --lr-wsd-decay-iters/-samples),
                          then c = f(a) with a = (n − (D − A)) / A and f the anneal style:
                          exponential 2 · 0.5^a − 1, linear 1 − a, cosine ½ (1 + cos(π a)),
                          minus_sqrt 1 − √a

As in Megatron, the lr for the first update is lr(0) (= 0 when there is a warm-up).
"""
from __future__ import annotations

import math

SCHEDULE_UNITS = {"iterations": "iters", "samples": "samples"}   # unit -> Megatron's flag suffix
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_FALLING = {                                   # coefficient c of a decay fraction r in [0, 1]
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
    "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


class LRScheduler:
    """Sets ``lr`` on every param group of ``optimizer``; ``step()`` after each optimizer step."""

    def __init__(self, optimizer, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0,
                 decay_steps: int | None = None, decay_style: str = "cosine",
                 unit: str = "iterations", *, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential"):
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
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if decay_style == "WSD":
            _check_wsd(wsd_decay_steps, wsd_decay_style, suffix)
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style, self.unit = decay_style, unit
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
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
        if self.decay_style == "inverse-square-root":
            scale = math.sqrt(max(self.warmup_steps, 1) / max(step, 1))
            return max(self.min_lr, self.max_lr * scale)
        if self.decay_style == "WSD":
            anneal_start = decay_steps - self.wsd_decay_steps
            coeff = 1.0 if step <= anneal_start else _FALLING[self.wsd_decay_style](
                (step - anneal_start) / self.wsd_decay_steps)
        else:
            span = decay_steps - self.warmup_steps
            ratio = (step - self.warmup_steps) / span if span > 0 else 1.0
            coeff = _FALLING[self.decay_style](ratio)
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
                "decay_style": self.decay_style, "unit": self.unit,
                "wsd_decay_steps": self.wsd_decay_steps, "wsd_decay_style": self.wsd_decay_style}

    def load_state_dict(self, state: dict, with_schedule: bool = False) -> None:
        """The step count of ``state``; ``with_schedule`` (Megatron's
        ``--use-checkpoint-opt_param-scheduler``): its peak, floor, warm-up, decay length and
        style too."""
        unit = state.get("unit", "iterations")
        if unit != self.unit:
            raise ValueError(f"the checkpoint's lr schedule counts {unit} and this run's counts "
                             f"{self.unit}: resume a --train-{SCHEDULE_UNITS[unit]} run with "
                             f"--train-{SCHEDULE_UNITS[unit]}")
        if with_schedule:
            self.max_lr, self.min_lr = state["max_lr"], state["min_lr"]
            self.warmup_steps, self.decay_steps = state["warmup_steps"], state["decay_steps"]
            self.decay_style = state["decay_style"]
        self.num_steps = int(state["num_steps"])
        self._apply()


def _check_wsd(wsd_decay_steps, wsd_decay_style, suffix: str) -> None:
    """The anneal of a WSD schedule: a style Megatron has and a length of at least one step
    (longer than the decay span is allowed, as in Megatron: the anneal then starts early)."""
    if wsd_decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"lr_wsd_decay_style must be one of {WSD_DECAY_STYLES}, got "
                         f"{wsd_decay_style!r}")
    if wsd_decay_steps is None or wsd_decay_steps < 1:
        raise ValueError(f"lr_decay_style WSD needs lr_wsd_decay_{suffix} >= 1 (the length of "
                         f"the final anneal), got {wsd_decay_steps}")
