"""When and how the training loop saves, and when it stops early.

- Start-up: ``--save`` must be writable (checked on every rank, before any work); what crashed
  saves left there is removed; ``--load`` of an empty or missing folder starts fresh with a warning
  (so a restarted command — ``torchrun --max-restarts``, a requeued job — resumes when it can), or
  fails with ``--exit-on-missing-checkpoint``.
- Each iteration: the pending ``--async-save`` is published once every rank's write is done; a
  save every ``--save-interval``; an early exit (``exit_conditions.py``) saves first.
- End: the final state is saved unless the last iteration was just saved, and an asynchronous
  save is waited for, so the job never exits with a checkpoint half published.
- ``--ckpt-format``: ``tpfuse`` (one file per rank, ``checkpoint/format.py``) or ``torch_dist``
  (Megatron's layout, ``checkpoint/torch_dist_format.py``), with the same guarantees (staging
  folder and rename, manifest of hashes, tracker last, ``--async-save``, the SIGTERM save);
  ``--load`` recognises either by what the folder holds.
- ``--keep-last-checkpoints N`` deletes all but the newest N published checkpoints (never the one
  just published, never one newer than it) after each publication.
- A checkpoint folder is recognised by its manifest (``format.latest_iteration``), so a folder
  whose tracker was lost resumes rather than looking empty. The trainer never replaces a folder it
  did not write in this run: saving an iteration whose folder already exists is refused (naming
  it) unless this run wrote it or resumed from it.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from tpfuse.checkpoint import file_io as checkpoint_io
from tpfuse.checkpoint import format as ckpt
from tpfuse.checkpoint import torch_dist_format
from tpfuse.checkpoint.async_save import AsyncCheckpointSaver
from tpfuse.checkpoint.reading import read_checkpoint_head
from tpfuse.training.exit_conditions import ExitConditions


def prepare_save_dir(root: str) -> None:
    """Collective: every rank can write ``root`` (else a ValueError on every rank); rank 0 then
    removes stale staging folders and temporary files of crashed saves."""
    error = None
    try:
        checkpoint_io.check_writable(root)
    except ValueError as caught:
        error = caught
    ckpt.agree(error, f"checking --save {root}")
    if dist.get_rank() == 0:
        for path in checkpoint_io.clean_stale(root):
            print(f"> removed {path}: left by a save that did not complete", flush=True)


def resume_point(root: str, exit_on_missing: bool) -> bool:
    """True when ``root`` holds a checkpoint to load (of either format, or a folder megatron-core
    wrote); False (with a warning) when it holds none."""
    if ckpt.latest_iteration(root) is not None or torch_dist_format.is_dist_folder(root):
        return True
    message = f"--load {root}: no checkpoint there ({ckpt.TRACKER} is missing)"
    if exit_on_missing:
        raise FileNotFoundError(message + " and --exit-on-missing-checkpoint is set")
    if dist.get_rank() == 0:
        print(f"WARNING: {message}; starting from scratch", flush=True)
    return False


def resume_position(root: str) -> dict:
    """``--no-load-optim``: {"iteration", "consumed_samples", "extra"} of the newest checkpoint in
    ``root`` of either format (tpfuse's, or Megatron-LM's ``args``); local, no collective."""
    folder = torch_dist_format.checkpoint_dir_of(root)
    if folder is None:
        head = read_checkpoint_head(root)
        return {"iteration": head["iteration"], "consumed_samples": head["consumed_samples"],
                "extra": head.get("extra", {})}
    common = torch_dist_format.verified_common(folder)
    if isinstance(common.get(torch_dist_format.COMMON), dict):
        saved = common[torch_dist_format.COMMON]
        return {"iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"],
                "extra": saved["extra"]}
    args = common.get("args")
    return {"iteration": int(common.get("iteration", 0) or 0),
            "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
            "extra": {}}


class Checkpointing:
    """The loop's saving policy. ``settings``: the CheckpointSettings (``save``, ``load``,
    ``save_interval``, ``async_save``, ``keep_last_checkpoints`` and the ``exit_*`` fields);
    ``run`` is the training run (model, optimizer, scheduler, state, iteration,
    consumed_samples, and ``prepare_save() -> extra`` called before each save)."""

    def __init__(self, settings, resumed_from: int | None = None):
        self.settings = settings
        # iterations whose folder in --save this run may replace: the ones it wrote, and the one
        # it resumed from when it loads from the same folder (the same state)
        self.own = set()
        if resumed_from is not None and settings.load and settings.save and \
                os.path.realpath(settings.load) == os.path.realpath(settings.save):
            self.own.add(resumed_from)
        torch_dist = settings.ckpt_format == torch_dist_format.FORMAT
        self.save_checkpoint = torch_dist_format.save_checkpoint if torch_dist \
            else ckpt.save_checkpoint
        saver = torch_dist_format.AsyncTorchDistSaver if torch_dist else AsyncCheckpointSaver
        self.saver = saver(settings.save, settings.keep_last_checkpoints) \
            if settings.save and settings.async_save else None
        self.exits = ExitConditions(settings)
        # resumed from --save itself: that iteration is saved already (a requeued finished job
        # rewrites nothing)
        self.last_saved = resumed_from if resumed_from in self.own else None

    def check_not_foreign(self, iteration: int) -> None:
        """Collective: refuse (on every rank) to save ``iteration`` over a folder another run
        wrote."""
        final = ckpt.iteration_dir(self.settings.save, iteration)
        error = None
        if iteration not in self.own and checkpoint_io.existing_iteration_dir(final):
            error = FileExistsError(
                f"--save {self.settings.save} already holds {os.path.basename(final)}, written by "
                "another run (this run did not resume from it): refusing to replace it. Resume "
                f"with --load {self.settings.save}, or save into another folder")
        ckpt.agree(error, f"saving checkpoint iteration {iteration}")

    def save(self, run) -> None:
        self.check_not_foreign(run.iteration)
        self.own.add(run.iteration)
        extra = run.prepare_save()
        items = (run.iteration, run.model, run.optimizer, run.scheduler, run.state,
                 run.consumed_samples, extra)
        if self.saver is not None:
            self.saver.save(*items)
        else:
            self.save_checkpoint(self.settings.save, *items,
                                 keep_last=self.settings.keep_last_checkpoints)
        self.last_saved = run.iteration

    def after_iteration(self, run) -> str | None:
        """Publish / save as due; returns why training must stop now (None: go on)."""
        if self.saver is not None:
            self.saver.poll()
        reason = self.exits.reason(run.iteration)
        interval = self.settings.save_interval
        if self.settings.save and (reason or (interval and run.iteration % interval == 0)):
            self.save(run)
        return reason

    def finish(self, run) -> None:
        """After the loop: the final save (unless this iteration was just saved, e.g. by an
        early exit), then wait for an asynchronous save to be published. Collective: only on
        the normal path."""
        if self.settings.save and self.last_saved != run.iteration:
            self.save(run)
        if self.saver is not None:
            self.saver.wait()
            self.saver.close()

    def close(self) -> None:
        """Always (also after an error): restore the signal handler. No collective here: after
        an error an in-flight save stays unpublished (its staging folder is removed at the next
        start-up) rather than risking a hang."""
        self.exits.close()


def describe_exit(reason: str, saved: bool, root: str | None) -> str:
    where = f"checkpoint saved in {os.path.abspath(root)}" if saved else "no --save: nothing saved"
    return f"> exiting early: {reason}; {where}"
