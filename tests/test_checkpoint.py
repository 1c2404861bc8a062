"""Checkpoints: round trip, atomic publication, clear errors on corrupt or foreign files."""
import os
import types

import torch
import torch.distributed as dist

from tpfuse.training import checkpoint as ckpt
from tpfuse.training.scheduler import LRScheduler


def _fake_state(tp=1, pp=1, dp=None, vpp=None):
    dp = dp or dist.get_world_size() // (tp * pp)
    return types.SimpleNamespace(tp_size=tp, pp_size=pp, dp_size=dp, vpp_size=vpp,
                                 size=lambda name: 1)


def _model_and_optim(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return model, optim, LRScheduler(optim, max_lr=0.1, warmup_steps=3)


def _round_trip(root):
    state = _fake_state()
    model, optim, sched = _model_and_optim(dist.get_rank())
    sched.step(2)
    ckpt.save_checkpoint(root, 7, [model], optim, sched, state, consumed_samples=56)
    expected_draw = torch.rand(3)  # the RNG stream right after the save point
    # a fresh model with other weights (and a reseeded RNG) loads the saved ones
    other, other_optim, other_sched = _model_and_optim(99)
    loaded = ckpt.load_checkpoint(root, [other], other_optim, other_sched, state)
    assert loaded["iteration"] == 7 and loaded["consumed_samples"] == 56
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert other_sched.num_steps == 2
    assert other_optim.state_dict()["state"][0]["step"] == optim.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG stream resumes at the save point
    return sorted(os.listdir(root)), sorted(os.listdir(ckpt.iteration_dir(root, 7)))


def test_round_trip_every_rank_own_file(run_distributed, tmp_path):
    results = run_distributed(2, _round_trip, str(tmp_path))
    top, files = results[0]
    assert top == ["iter_0000007", ckpt.TRACKER]
    assert files == ["rank_00000.pt", "rank_00001.pt"]


def _save_then_crash_midway(root):
    state = _fake_state()
    model, optim, sched = _model_and_optim(0)
    ckpt.save_checkpoint(root, 1, [model], optim, sched, state, consumed_samples=8)
    # a crash while saving iteration 2: the staging folder exists, half written
    os.makedirs(ckpt.iteration_dir(root, 2) + ".tmp")
    with open(os.path.join(ckpt.iteration_dir(root, 2) + ".tmp", "rank_00000.pt"), "wb") as f:
        f.write(b"partial")
    loaded = ckpt.load_checkpoint(root, [model], optim, sched, state)
    return loaded["iteration"]


def test_crash_mid_save_keeps_last_good_checkpoint(run_distributed, tmp_path):
    assert run_distributed(1, _save_then_crash_midway, str(tmp_path)) == [1]


def _load_errors(root):
    state = _fake_state()
    model, optim, sched = _model_and_optim(0)
    messages = []
    try:
        ckpt.load_checkpoint(root, [model], optim, sched, state)
    except FileNotFoundError as error:
        messages.append(str(error))
    ckpt.save_checkpoint(root, 3, [model], optim, sched, state, consumed_samples=0)
    try:  # written by another layout
        ckpt.load_checkpoint(root, [model], optim, sched, _fake_state(vpp=2))
    except ValueError as error:
        messages.append(str(error))
    path = os.path.join(ckpt.iteration_dir(root, 3), "rank_00000.pt")
    with open(path, "r+b") as handle:  # truncate the file
        handle.truncate(os.path.getsize(path) // 2)
    try:
        ckpt.load_checkpoint(root, [model], optim, sched, state)
    except ValueError as error:
        messages.append(str(error))
    with open(os.path.join(root, ckpt.TRACKER), "w") as handle:
        handle.write("garbage")
    try:
        ckpt.load_checkpoint(root, [model], optim, sched, state)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_load_errors_name_the_problem(run_distributed, tmp_path):
    (missing, layout, corrupt, tracker), = run_distributed(1, _load_errors, str(tmp_path))
    assert "no latest_checkpointed_iteration.txt" in missing
    assert "different layout" in layout and "'vpp': 2" in layout
    assert "rank_00000.pt is corrupt" in corrupt
    assert "tracker" in tracker and "garbage" in tracker
