"""megatron-core 0.16's ``OptimizerParamScheduler``: learning rate (tpfuse's schedule,
``tpfuse.training.scheduler.LRScheduler.lr_at``: linear warm-up, then constant / linear /
cosine / inverse-square-root / WSD decay to ``min_lr``) and weight-decay increments
(constant, linear, cosine from ``start_wd`` to ``end_wd`` over ``wd_incr_steps``), set on every
param group as Megatron does: ``lr = schedule(group's max_lr, min_lr) · lr_mult``,
``weight_decay = wd · wd_mult``. Megatron's ``init_lr`` (a warm-up from a non-zero lr) is not
implemented: it must be 0.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from tpfuse.training.scheduler import LRScheduler


class OptimizerParamScheduler:
    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, wsd_decay_steps=None,
                 lr_wsd_decay_style=None):
        if init_lr != 0.0:
            raise ValueError(f"OptimizerParamScheduler(init_lr={init_lr}) is not implemented by "
                             "tpfuse: its warm-up starts from 0")
        if lr_decay_steps is None or lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps must be > 0, got {lr_decay_steps}")
        if wd_incr_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"wd_incr_style must be constant, linear or cosine, got "
                             f"{wd_incr_style!r}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"wd_incr_style constant needs start_wd == end_wd, got {start_wd} "
                             f"and {end_wd}")
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def _schedule(self, max_lr, min_lr) -> LRScheduler:
        return LRScheduler(SimpleNamespace(param_groups=[]), max_lr, min_lr,
                           self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style,
                           wsd_decay_steps=self.wsd_decay_steps,
                           wsd_decay_style=self.lr_wsd_decay_style or "exponential")

    def get_wd(self) -> float:
        if self.wd_incr_steps is None or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else \
            0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group) -> float:
        max_lr = param_group.get("max_lr", self.max_lr) or self.max_lr
        min_lr = param_group.get("min_lr", self.min_lr)
        min_lr = self.min_lr if min_lr is None else min_lr
        return self._schedule(max_lr, min_lr).lr_at(self.num_steps)

    def step(self, increment: int) -> None:
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "num_steps": self.num_steps, "lr_decay_style": self.lr_decay_style,
                "lr_decay_steps": self.lr_decay_steps, "min_lr": self.min_lr,
                "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            for name in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                         "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps",
                         "wd_incr_style"):
                if name in state_dict:
                    setattr(self, name, state_dict[name])
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))
