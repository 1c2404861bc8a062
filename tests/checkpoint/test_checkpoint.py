"""Checkpoints: round trip, atomic publication, and refusal of everything that is not exactly the
checkpoint the tracker names (corrupt, misplaced, non-finite, redirected through a planted name)."""
import json
import os
import types

import pytest
import torch
import torch.distributed as dist

from tpfuse.checkpoint import file_io as checkpoint_io
from tpfuse.checkpoint import format as ckpt
from tpfuse.training.checkpointing import prepare_save_dir
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


def _save(root, iteration, seed=0, **kwargs):
    model, optim, sched = _model_and_optim(seed)
    ckpt.save_checkpoint(root, iteration, [model], optim, sched, _fake_state(),
                         consumed_samples=8 * iteration, **kwargs)
    return model


def _load(root, seed=99):
    model, optim, sched = _model_and_optim(seed)
    loaded = ckpt.load_checkpoint(root, [model], optim, sched, _fake_state())
    return loaded, model


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 — the tests inspect the message
        return f"{type(error).__name__}: {error}"
    return None


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
    assert files == ["manifest.json", "rank_00000.pt", "rank_00001.pt"]


def _crashes_and_replacements(root):
    """Crash mid-save, and a crash between the two renames of re-saving the same iteration."""
    _save(root, 1)
    staging = checkpoint_io.make_staging_dir(root, "iter_0000002")   # a save that died half-way
    with open(os.path.join(staging, "rank_00000.pt"), "wb") as handle:
        handle.write(b"partial")
    assert _load(root)[0]["iteration"] == 1
    assert checkpoint_io.clean_stale(root) == [staging]
    # save iteration 1 again (a requeued finished job) and die after the old folder moved aside
    replace = os.replace

    def die_on_publish(src, dst):
        if ".staging-" in src and dst.endswith("iter_0000001"):
            raise KeyboardInterrupt("killed between the two renames")
        return replace(src, dst)

    os.replace = die_on_publish
    try:
        _save(root, 1, seed=5)
    except KeyboardInterrupt:
        pass
    finally:
        os.replace = replace
    loaded, model = _load(root)        # the last good copy is still there, under its kept name
    return loaded["iteration"], model.weight.detach().clone()


def test_crashes_never_lose_the_last_good_checkpoint(run_distributed, tmp_path):
    (iteration, weight), = run_distributed(1, _crashes_and_replacements, str(tmp_path))
    assert iteration == 1
    assert torch.equal(weight, _model_and_optim(0)[0].weight.detach())   # seed 0: the original


def _refusals(root):
    """Every rank: the message loading gave after each kind of damage to rank 1's file."""
    _save(root, 3)
    folder = ckpt.iteration_dir(root, 3)
    target = os.path.join(folder, "rank_00001.pt")
    pristine = open(target, "rb").read()
    messages = {}

    def damage(kind):
        if dist.get_rank() == 0:
            data = bytearray(pristine)
            if kind == "flipped":            # 64 flipped bytes in the middle, size unchanged
                middle = len(data) // 2
                data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
            elif kind == "other rank":       # rank 0's file (and its hash) copied into place
                data = bytearray(open(os.path.join(folder, "rank_00000.pt"), "rb").read())
                manifest = json.load(open(os.path.join(folder, "manifest.json")))
                manifest["files"]["rank_00001.pt"] = manifest["files"]["rank_00000.pt"]
                json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
            open(target, "wb").write(bytes(data))
        dist.barrier()
        messages[kind] = _error_of(_load, root)
        dist.barrier()

    damage("flipped")
    damage("other rank")
    return messages


def test_damaged_or_misplaced_rank_files_are_refused_on_every_rank(run_distributed, tmp_path):
    for rank, messages in enumerate(run_distributed(2, _refusals, str(tmp_path))):
        flipped, misplaced = messages["flipped"], messages["other rank"]
        if rank == 1:   # the rank whose file it is names the problem
            assert "rank_00001.pt is corrupt" in flipped and "sha256" in flipped
            assert "belongs elsewhere" in misplaced and "rank 0" in misplaced
        else:           # the others fail with it instead of training on
            assert "failed on another rank" in flipped and "failed on another rank" in misplaced


def _non_finite_is_never_published(root):
    _save(root, 1)
    model, optim, sched = _model_and_optim(0)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    error = _error_of(ckpt.save_checkpoint, root, 2, [model], optim, sched, _fake_state(), 16)
    return error, ckpt.latest_iteration(root), sorted(os.listdir(root))


def test_non_finite_weights_are_never_published(run_distributed, tmp_path):
    for rank, (error, latest, listing) in enumerate(
            run_distributed(2, _non_finite_is_never_published, str(tmp_path))):
        assert latest == 1 and listing == ["iter_0000001", ckpt.TRACKER]
        assert ("non-finite" in error) if rank == 1 else ("failed on another rank" in error)


def _planted_names_and_retention(root, victim):
    # another user plants the old predictable temporary name of the tracker as a symlink
    os.makedirs(root)
    os.symlink(victim, os.path.join(root, f"{ckpt.TRACKER}.tmp.{os.getpid()}"))
    for iteration in range(1, 5):
        _save(root, iteration, keep_last=2)
    return sorted(os.listdir(root)), _error_of(prepare_save_dir, os.path.join(victim, "ckpt"))


def test_exclusive_temp_files_retention_and_unwritable_save(run_distributed, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (listing, unwritable), = run_distributed(1, _planted_names_and_retention,
                                             str(tmp_path / "ckpt"), str(victim))
    assert victim.read_text() == "precious"          # nothing was written through the link
    assert [n for n in listing if n.startswith("iter_")] == ["iter_0000003", "iter_0000004"]
    assert "--save" in unwritable and "is not writable" in unwritable


def _load_errors(root):
    state = _fake_state()
    model, optim, sched = _model_and_optim(0)
    messages = [_error_of(ckpt.load_checkpoint, root, [model], optim, sched, state)]
    ckpt.save_checkpoint(root, 3, [model], optim, sched, state, consumed_samples=0)
    # written by another layout (and not reshardable: a plain nn.Linear has no global names)
    messages.append(_error_of(ckpt.load_checkpoint, root, [model], optim, sched,
                              _fake_state(vpp=2)))
    path = os.path.join(ckpt.iteration_dir(root, 3), "rank_00000.pt")
    with open(path, "r+b") as handle:  # truncate the file
        handle.truncate(os.path.getsize(path) // 2)
    messages.append(_error_of(ckpt.load_checkpoint, root, [model], optim, sched, state))
    with open(os.path.join(root, ckpt.TRACKER), "w") as handle:
        handle.write("garbage")
    messages.append(_error_of(ckpt.load_checkpoint, root, [model], optim, sched, state))
    return messages


def test_load_errors_name_the_problem(run_distributed, tmp_path):
    (missing, layout, corrupt, tracker), = run_distributed(1, _load_errors, str(tmp_path))
    assert "no latest_checkpointed_iteration.txt" in missing
    assert "carries no resharding metadata" in layout and "'vpp': 1" in layout
    assert "rank_00000.pt is corrupt" in corrupt
    assert "tracker" in tracker and "garbage" in tracker


@pytest.mark.parametrize("name", ["x.staging-abc", "x.replaced"])
def test_stale_names_of_unrelated_folders_are_kept(tmp_path, name):
    (tmp_path / name).mkdir()       # only iter_* leftovers are ours to remove
    assert checkpoint_io.clean_stale(str(tmp_path)) == []
