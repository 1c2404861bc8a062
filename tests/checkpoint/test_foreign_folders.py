"""A checkpoint folder is recognised by its manifests, not by the tracker alone, and the trainer
never replaces or prunes a folder it did not write in this run unless it is older and superseded;
trackers and manifests are read only when they are small regular files."""
import hashlib
import os
import threading
import time

import pytest
import torch

from support.pretrain_run import run_pretrain
from tpfuse.checkpoint import file_io as checkpoint_io
from tpfuse.checkpoint import format as ckpt

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table"]


def _train(argv):
    result = run_pretrain(argv)
    return result.iterations


def _error_of_training(argv):
    try:
        run_pretrain(argv)
    except Exception as error:  # noqa: BLE001 — the test reads the message
        return f"{type(error).__name__}: {error}"
    return None


def _tree_digest(root):
    """{relative path: sha256} of every file under ``root``."""
    digests = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            digests[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return digests


def test_lost_tracker_resumes_and_never_replaces_the_old_folders(run_distributed, tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(1, _train, TINY + ["--train-iters", "4", "--save-interval", "2",
                                       "--save", root])
    os.remove(os.path.join(root, ckpt.TRACKER))          # what a careless clean-up leaves
    before = _tree_digest(root)
    assert ckpt.latest_iteration(root) == 4               # recognised by its manifests
    (iterations,) = run_distributed(1, _train, TINY + [
        "--train-iters", "4", "--save-interval", "2", "--keep-last-checkpoints", "1",
        "--load", root, "--save", root])
    assert iterations == []                                # resumed at 4: nothing left to train
    after = _tree_digest(root)
    assert {k: v for k, v in after.items() if k != ckpt.TRACKER} == before   # byte for byte


def test_a_folder_another_run_wrote_is_never_replaced(run_distributed, tmp_path):
    """Saving into a folder with checkpoints, without resuming from it, refuses at the first
    collision and leaves the other run's folder byte for byte."""
    root, fresh = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    run_distributed(1, _train, TINY + ["--train-iters", "2", "--save", root])
    before = _tree_digest(root)
    (error,) = run_distributed(1, _error_of_training, TINY + [
        "--train-iters", "2", "--load", fresh, "--save", root])
    assert "iter_0000002" in error and "refusing to replace it" in error
    assert _tree_digest(root) == before


def _model_and_optim():
    from tpfuse.training.scheduler import LRScheduler

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optim, LRScheduler(optim, max_lr=0.1, warmup_steps=3)


def _save_two_then_prune_below(root):
    import types

    import torch.distributed as dist

    state = types.SimpleNamespace(tp_size=1, pp_size=1, dp_size=dist.get_world_size(),
                                  vpp_size=None, size=lambda name: 1)
    model, optim, sched = _model_and_optim()
    for iteration in (5, 9):                       # another run's, newer than what follows
        ckpt.save_checkpoint(root, iteration, [model], optim, sched, state, consumed_samples=0)
    ckpt.save_checkpoint(root, 3, [model], optim, sched, state, consumed_samples=0,
                         keep_last=1)
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_pruning_never_deletes_a_newer_folder(run_distributed, tmp_path):
    (listing,) = run_distributed(1, _save_two_then_prune_below, str(tmp_path))
    assert listing == ["iter_0000003", "iter_0000005", "iter_0000009"]


def _refusal_within(path_maker, tmp_path, seconds=10):
    root = tmp_path / "ckpt"
    root.mkdir()
    path_maker(str(root / ckpt.TRACKER))
    outcome = {}

    def read():
        try:
            outcome["value"] = ckpt.latest_iteration(str(root))
        except Exception as error:  # noqa: BLE001 — the test reads the message
            outcome["error"] = str(error)

    reader = threading.Thread(target=read, daemon=True)
    start = time.monotonic()
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "reading the tracker blocked"
    assert time.monotonic() - start < seconds
    return outcome.get("error")


def test_a_fifo_tracker_is_refused_within_seconds(tmp_path):
    error = _refusal_within(os.mkfifo, tmp_path)
    assert error and "not a regular file" in error and ckpt.TRACKER in error


def test_a_tracker_linked_to_a_device_is_refused(tmp_path):
    error = _refusal_within(lambda path: os.symlink("/dev/zero", path), tmp_path)
    assert error and "not a regular file" in error


def test_an_oversized_tracker_or_manifest_is_refused(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"1" * (checkpoint_io.TRACKER_CAP + 1))
    with pytest.raises(ValueError, match="more than the"):
        checkpoint_io.read_regular_file(str(big), checkpoint_io.TRACKER_CAP, "checkpoint tracker")
