"""Training-loop pieces against hand-computed values and plain-torch references."""
import math

import pytest
import torch

from tpfuse.training.scheduler import LRScheduler


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


def test_lr_warmup_then_cosine_by_hand():
    sched = LRScheduler(_optimizer(), max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=12)
    lrs = [sched.lr_at(n) for n in range(14)]
    # warm-up: n / 4
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # cosine over 8 steps: 0.1 + 0.45 (1 + cos(pi k / 8))
    for k in range(1, 9):
        assert lrs[4 + k] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * k / 8)), abs=1e-12)
    assert lrs[12] == pytest.approx(0.1) and lrs[13] == 0.1


def test_lr_scheduler_sets_param_groups_and_resumes():
    opt = _optimizer()
    sched = LRScheduler(opt, max_lr=2.0, warmup_steps=2, decay_steps=6, decay_style="linear")
    for _ in range(3):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * (1 - 1 / 4))
    other = LRScheduler(_optimizer(), max_lr=2.0, warmup_steps=2, decay_steps=6,
                        decay_style="linear")
    other.load_state_dict(sched.state_dict())
    assert other.lr == sched.lr


@pytest.mark.parametrize("kwargs, name", [
    ({"max_lr": 1.0, "min_lr": 2.0}, "min_lr"),
    ({"max_lr": 1.0, "warmup_steps": -1}, "lr_warmup_iters"),
    ({"max_lr": 1.0, "warmup_steps": 5, "decay_steps": 3}, "lr_decay_iters"),
])
def test_lr_scheduler_rejects_bad_settings(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LRScheduler(_optimizer(), **kwargs)
