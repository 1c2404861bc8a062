"""The file-system side of checkpoints: exclusive temporary files, fsync'd atomic publication,
hashes, and the clean-up of what crashed saves leave behind.

Every temporary file or folder is created exclusively (``mkstemp`` / ``mkdtemp``: an unpredictable
name, ``O_EXCL``, mode 0600 / 0700) inside the folder it will be renamed into, so a shared
``--save`` cannot be used to redirect a write through a planted name or symlink, and a rename
never crosses file systems. Data is fsync'd before the rename that publishes it, and the folder
after it.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import stat
import tempfile

import torch

STAGING_INFIX = ".staging-"          # iter_0000020.staging-k2j3l/  a save being written
REPLACED_SUFFIX = ".replaced"        # iter_0000020.replaced/       the previous copy of an
#                                      iteration being saved again, kept until the new one is live
ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
HASH_CHUNK = 1 << 22


TRACKER_CAP = 64                     # bytes: an iteration number and a newline
MANIFEST_CAP = 64 << 20              # bytes: ~500k rank entries


def read_regular_file(path: str, cap: int, what: str) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``cap`` bytes; ValueError naming
    ``what`` otherwise (a FIFO, device or socket — also through a symlink — is refused without
    blocking: it is opened non-blocking and its kind checked on the open descriptor).
    FileNotFoundError when ``path`` does not exist."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {path} is not a regular file (a FIFO, device, socket or "
                             "folder); refusing to read it")
        if info.st_size > cap:
            raise ValueError(f"{what} {path} is {info.st_size} bytes, more than the {cap} "
                             f"bytes such a file can hold; refusing to read it")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ValueError(f"{what} {path} grew past {cap} bytes while being read")
    return data


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """A binary file object that hashes (sha256) and counts every byte written through it."""

    def __init__(self, handle):
        self.handle, self.sha256, self.bytes = handle, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _publish_temp(fd: int, tmp: str, path: str, write) -> object:
    """Run ``write(handle)`` on the exclusive temp file, fsync, rename to ``path``."""
    try:
        with os.fdopen(fd, "wb") as handle:
            result = write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return result


def atomic_write_bytes(path: str, data: bytes) -> None:
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.")
    _publish_temp(fd, tmp, path, lambda handle: handle.write(data))


def atomic_torch_save(obj, path: str) -> dict:
    """``torch.save`` to ``path`` atomically; returns ``{"sha256", "bytes"}`` of the file."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.")

    def write(handle):
        hashing = HashingWriter(handle)
        torch.save(obj, hashing)
        return {"sha256": hashing.sha256.hexdigest(), "bytes": hashing.bytes}

    return _publish_temp(fd, tmp, path, write)


def file_digest(path: str) -> dict:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(HASH_CHUNK), b""):
            sha.update(block)
            size += len(block)
    return {"sha256": sha.hexdigest(), "bytes": size}


def make_staging_dir(root: str, final_name: str) -> str:
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(dir=root, prefix=final_name + STAGING_INFIX)


def publish_dir(staging: str, final: str) -> None:
    """Move the complete ``staging`` folder to ``final``. An existing ``final`` (the same
    iteration saved again) is first renamed to ``final.replaced`` and deleted only after the new
    folder is in place, so the folder the tracker names always exists under one of the two."""
    replaced = final + REPLACED_SUFFIX
    if os.path.isdir(final):
        if os.path.isdir(replaced):
            shutil.rmtree(replaced)      # stale: ``final`` itself is complete
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_dir(os.path.dirname(final))


def finish_replacement(final: str) -> None:
    shutil.rmtree(final + REPLACED_SUFFIX, ignore_errors=True)


def existing_iteration_dir(final: str) -> str | None:
    """``final``, or its kept predecessor when a crash came between the two renames."""
    for path in (final, final + REPLACED_SUFFIX):
        if os.path.isdir(path):
            return path
    return None


def clean_stale(root: str) -> list[str]:
    """Remove what crashed saves left in ``root``: staging folders, temporary files, replaced
    folders whose successor is complete. Returns the removed paths (call before saving starts)."""
    removed = []
    for path in glob.glob(os.path.join(root, f"iter_*{STAGING_INFIX}*")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in glob.glob(os.path.join(root, f"iter_*{REPLACED_SUFFIX}")):
        if os.path.isdir(path[:-len(REPLACED_SUFFIX)]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in glob.glob(os.path.join(root, ".latest_checkpointed_iteration.txt.*")):
        os.unlink(path)
        removed.append(path)
    return removed


def complete_iterations(root: str) -> list[int]:
    """Iterations with a published folder in ``root``, ascending."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = ITERATION_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def prune(root: str, keep_last: int, protected: int) -> list[int]:
    """Delete all but the newest ``keep_last`` published iterations up to ``protected`` (the one
    just published, kept). Only folders provably older than ``protected`` (a lower iteration:
    superseded by it) are candidates; a newer folder — another run's — is never touched."""
    older = [it for it in complete_iterations(root) if it < protected]
    doomed = older[:max(0, len(older) - (keep_last - 1))] if keep_last else []
    for iteration in doomed:
        shutil.rmtree(os.path.join(root, f"iter_{iteration:07d}"), ignore_errors=True)
    return doomed


def check_writable(root: str) -> None:
    """OSError/ValueError now, at start-up, when ``root`` cannot take a checkpoint."""
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"--save {root} is not writable: {error}") from error
