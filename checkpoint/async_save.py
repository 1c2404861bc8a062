"""``--async-save``: checkpoint files written beside training, published atomically later.

    saver = AsyncCheckpointSaver(root, keep_last)
    saver.save(iteration, model_chunks, optimizer, scheduler, state, consumed)   # collective
    ... every iteration boundary:  saver.poll()      # collective while a save is in flight
    at exit:                       saver.wait()      # collective

``save`` does the collective part at once (finite-weights check, staging folder) and snapshots
this rank's state to CPU memory (copies, so training can go on changing the weights); a background
thread then serialises the snapshot into the staging folder (exclusive temporary file, fsync,
rename). ``poll`` asks every rank whether its thread is done (one all-reduce of a flag); when all
are, the checkpoint is published exactly as a synchronous save publishes it (manifest, folder
rename, tracker replace: ``format.publish``). So a kill at any moment leaves the tracker naming
the last complete checkpoint. At most one save is in flight: a new ``save`` first waits for the
previous one and publishes it. Every rank makes the same calls at the same iterations, so whether a
save is in flight is the same on every rank and the collectives match.
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from tpfuse.parallel.devices import collective_device

from . import format as ckpt


def cpu_snapshot(obj):
    """A deep copy of ``obj`` with every tensor copied to CPU memory."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: cpu_snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_snapshot(value) for value in obj)
    return obj


class _Write:
    """This rank's files being written by a background thread: ``job()`` writes them and
    returns what publication needs (a rank file's digest)."""

    def __init__(self, staging: str, job):
        self.staging, self.digest, self.error = staging, None, None
        self.thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                       name="tpfuse-async-checkpoint")
        self.thread.start()

    def _run(self, job) -> None:
        try:
            self.digest = job()
        except Exception as error:  # noqa: BLE001 — reported to every rank at publication
            self.error = error

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


class AsyncCheckpointSaver:
    def __init__(self, root: str, keep_last: int | None = None):
        self.root, self.keep_last = root, keep_last
        self.pending = None            # (iteration, _Write, manifest header)
        self.published: list[int] = []

    def save(self, iteration, model_chunks, optimizer, scheduler, state, consumed_samples,
             extra=None) -> None:
        self.wait()
        staging = ckpt.begin_save(self.root, iteration, model_chunks)
        payload = cpu_snapshot(ckpt.build_payload(iteration, model_chunks, optimizer, scheduler,
                                                  state, consumed_samples, extra))
        header = {"layout": payload["layout"], "model_signature": payload["model_signature"]}
        job = functools.partial(ckpt.write_rank_file, staging, payload)
        self.pending = (iteration, _Write(staging, job), header)

    def poll(self, block: bool = False) -> int | None:
        """Publish the pending save if every rank's write is done (or, with ``block``, once it
        is); returns the published iteration. Collective while a save is pending."""
        if self.pending is None:
            return None
        iteration, write, header = self.pending
        if block:
            write.thread.join()
        flag = torch.tensor([int(write.done)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            return None
        self.pending = None
        self.publish(iteration, write, header)
        self.published.append(iteration)
        return iteration

    def publish(self, iteration: int, write: _Write, header: dict) -> None:
        """Collective: publish a save whose every rank's write is done."""
        ckpt.publish(self.root, iteration, write.staging, write.digest, write.error, header,
                     self.keep_last)

    def wait(self) -> int | None:
        """Block until the pending save (if any) is published."""
        return self.poll(block=True)

    def close(self) -> None:
        """After the last ``wait``: release what the saver holds (here nothing)."""
