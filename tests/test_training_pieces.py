"""Training-loop pieces against hand-computed values and plain-torch references."""
import math

import pytest
import torch
import torch.distributed as dist

from tpfuse.training.grad_sync import DataParallelGradSync
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


def _grad_sync_body(overlap):
    torch.manual_seed(0)  # same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
                                torch.nn.Tanh(), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    sync = DataParallelGradSync(params, dist.group.WORLD, bucket_numel=20, overlap=overlap)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    batches = [torch.randn(4, 5, generator=gen) for _ in range(3)]
    sync.begin_step(len(batches))
    for x in batches:
        model(x).square().sum().backward()
    launched_during_backward = sync._next_to_launch
    local = [p.grad.clone() for p in params]
    sync.finish()
    # reference: the mean over ranks of the locally accumulated gradients
    for mine, param in zip(local, params):
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        torch.testing.assert_close(param.grad, torch.stack(gathered).mean(0), rtol=1e-6,
                                   atol=1e-7)
    return launched_during_backward, len(sync.buckets)


@pytest.mark.parametrize("overlap", [True, False])
def test_dp_grad_sync_averages_and_overlaps(run_distributed, overlap):
    results = run_distributed(4, _grad_sync_body, overlap)
    launched, buckets = results[0]
    assert buckets > 1  # bucket_numel=20 splits the 80 parameters
    # with overlap every bucket is already in flight when backward ends; without, none is
    assert launched == (buckets if overlap else 0)
