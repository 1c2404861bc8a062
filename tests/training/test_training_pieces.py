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


def test_inverse_square_root_by_hand():
    sched = LRScheduler(_optimizer(), max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=100,
                        decay_style="inverse-square-root")
    # after the warm-up: sqrt(4 / n), floored at min_lr; past the decay end: min_lr
    assert [sched.lr_at(n) for n in (2, 4, 16, 64)] == pytest.approx([0.5, 1.0, 0.5, 0.25])
    assert sched.lr_at(99) == pytest.approx(0.2010, abs=1e-4) and sched.lr_at(101) == 0.1


@pytest.mark.parametrize("style, anneal", [
    ("exponential", lambda a: 2 * 0.5 ** a - 1), ("linear", lambda a: 1 - a),
    ("cosine", lambda a: 0.5 * (1 + math.cos(math.pi * a))), ("minus_sqrt", lambda a: 1 - a ** 0.5),
])
def test_wsd_warms_up_holds_then_anneals_by_hand(style, anneal):
    sched = LRScheduler(_optimizer(), max_lr=2.0, min_lr=0.5, warmup_steps=2, decay_steps=12,
                        decay_style="WSD", wsd_decay_steps=4, wsd_decay_style=style)
    lrs = [sched.lr_at(n) for n in range(14)]
    assert lrs[:3] == [0.0, 1.0, 2.0]                       # warm-up
    assert lrs[3:9] == [2.0] * 6                            # stable until 12 − 4 = 8
    for n in range(9, 13):                                  # anneal: a = (n − 8) / 4
        assert lrs[n] == pytest.approx(0.5 + 1.5 * anneal((n - 8) / 4), abs=1e-12)
    assert lrs[12] == pytest.approx(0.5, abs=1e-12) and lrs[13] == 0.5


@pytest.mark.parametrize("kwargs, message", [
    ({"decay_style": "WSD"}, "needs lr_wsd_decay_iters >= 1"),
    ({"decay_style": "WSD", "wsd_decay_steps": 0, "unit": "samples"}, "lr_wsd_decay_samples"),
    ({"decay_style": "WSD", "wsd_decay_steps": 2, "wsd_decay_style": "step"},
     "lr_wsd_decay_style must be one of"),
    ({"decay_style": "polynomial"}, "lr_decay_style must be one of"),
])
def test_wsd_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRScheduler(_optimizer(), max_lr=1.0, decay_steps=10, **kwargs)
