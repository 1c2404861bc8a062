"""Checkpoints: every rank saves its own shards; a checkpoint appears only once it is complete.

Layout on disk::

    DIR/latest_checkpointed_iteration.txt     the iteration of the newest complete checkpoint
    DIR/iter_0000020/rank_00003.pt            rank 3's model chunks, optimizer, scheduler, RNG,
                                              consumed samples, its coordinates in the layout
                                              and the model's TransformerConfig ("model_config")

Saving writes into ``DIR/iter_0000020.tmp/`` (each file itself written to a temporary name and
renamed), then, after every rank is done (a barrier), rank 0 renames the folder and finally
replaces ``latest_checkpointed_iteration.txt`` atomically. A crash at any point leaves the last
complete checkpoint untouched and named by the tracker file.

Loading reads the tracker and loads files with ``torch.load(..., weights_only=True)``; a missing,
truncated or foreign file fails with a message naming it. Written by the same layout (tp, pp, dp,
cp, vpp sizes, distributed optimizer or not), each rank restores its own file exactly (model,
optimizer — with the distributed optimizer its own shard of the fp32 main parameters and Adam
moments —, loss scaler, scheduler, RNG). Written by another layout, the model and optimizer are
resharded (``training/reshard.py``, from the per-parameter metadata every file carries under
``"reshard"``): weights, fp32 main copies, Adam moments and step, loss scaler, scheduler,
iteration and consumed samples carry over; RNG states do not (the freshly seeded ones are kept). All ranks agree on success before returning, so a failure on one rank fails them all.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from tpfuse.training import reshard

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2             # 2: the mixed-precision optimizer's per-parameter pieces


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank:05d}.pt")


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def layout_signature(state, optimizer=None) -> dict:
    """What must match for a rank to restore its own file as is (else: resharding)."""
    return {"world_size": dist.get_world_size(), "tp": state.tp_size, "pp": state.pp_size,
            "dp": state.dp_size, "cp": state.size("cp"), "vpp": state.vpp_size or 1,
            "distributed_optimizer": bool(getattr(optimizer, "distributed", False))}


def _rng_state() -> dict:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    try:
        from tpfuse.tp_layers.random import get_rng_tracker

        rng["tracker"] = get_rng_tracker().get_states()
    except (ImportError, AttributeError):
        pass
    return rng


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if "tracker" in rng:
        from tpfuse.tp_layers.random import get_rng_tracker

        get_rng_tracker().set_states(rng["tracker"])


def model_config_dict(model_chunks) -> dict | None:
    """The chunks' TransformerConfig as plain values (``models.cli.config_to_dict``), or None.

    Stored in every rank file so a model can be rebuilt from the checkpoint alone
    (``tpfuse.inference.load_model``)."""
    from tpfuse.models.cli import config_to_dict
    from tpfuse.models.config import TransformerConfig

    config = getattr(model_chunks[0], "config", None) if model_chunks else None
    return config_to_dict(config) if isinstance(config, TransformerConfig) else None


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, state,
                    consumed_samples: int, extra: dict | None = None) -> str:
    """Collective over the whole world: every rank writes its file, rank 0 publishes."""
    rank = dist.get_rank()
    final = iteration_dir(root, iteration)
    staging = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    payload = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout_signature(state, optimizer),
        "rank": rank,
        "model": [chunk.state_dict() for chunk in model_chunks],
        "model_config": model_config_dict(model_chunks),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
        "reshard": reshard.save_metadata(model_chunks, optimizer, state),
    }
    _atomic_torch_save(payload, _rank_file(staging, rank))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    dist.barrier()
    return final


def latest_iteration(root: str) -> int | None:
    """The newest complete checkpoint's iteration, or None when ``root`` holds none."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker} is corrupt: expected an iteration number, "
                         f"found {text[:40]!r}")
    return int(text)


def _read_payload(path: str, mmap: bool = False) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # truncated / not a torch file / unsafe content
        raise ValueError(f"checkpoint file {path} is corrupt or unreadable: {error}") from error
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint file {path} is not a tpfuse checkpoint of format "
                         f"{FORMAT_VERSION}")
    return payload


read_payload = _read_payload   # for loaders outside the trainer (tpfuse.inference.load_model)


def _any_rank_failed(failed: bool) -> bool:
    """Collective over the world: True when ``failed`` on any rank (so all ranks raise)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _load_other_layout(folder: str, model_chunks, optimizer, state, layout: dict) -> dict:
    """Reshard on every rank; raise everywhere when any rank cannot."""
    head, error = None, None
    try:
        head = reshard.load_resharded(folder, model_chunks, optimizer, state, layout,
                                      _read_payload)
    except Exception as caught:  # noqa: BLE001 — re-raised below, after every rank has agreed
        error = caught
    if _any_rank_failed(error is not None):
        raise error or ValueError(f"resharding checkpoint {folder} failed on another rank "
                                  "(see its error)")
    return head


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, state) -> dict:
    """Restore this rank's shards and states; returns {"iteration", "consumed_samples", "extra"}.

    Collective when the checkpoint's layout differs from this run's (see the module docstring).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER} there (no complete checkpoint)")
    folder = iteration_dir(root, iteration)
    expected = layout_signature(state, optimizer)
    # Every rank takes the same branch: the checkpoint's layout is read from rank 0's file, which
    # every checkpoint has, never inferred from whether this rank's own file exists.
    first = _rank_file(folder, 0)
    if not os.path.exists(first):
        raise FileNotFoundError(f"checkpoint file {first} is missing")
    saved = _read_payload(first, mmap=True)
    if saved["layout"] != expected:
        if saved.get("reshard") is None:
            raise ValueError(f"checkpoint {first} was written with layout {saved['layout']}, "
                             f"this run has {expected}; loading into a different layout "
                             f"(resharding) needs the per-parameter metadata this file lacks")
        payload = _load_other_layout(folder, model_chunks, optimizer, state, expected)
        scheduler.load_state_dict(payload["scheduler"])
        return {"iteration": payload["iteration"], "consumed_samples": payload["consumed_samples"],
                "extra": payload["extra"]}
    path = _rank_file(folder, dist.get_rank())
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing (the checkpoint's layout "
                                f"matches this run, so every rank's file should be there)")
    payload = _read_payload(path)
    if len(payload["model"]) != len(model_chunks):
        raise ValueError(f"checkpoint {path} holds {len(payload['model'])} model chunks, this "
                         f"rank has {len(model_chunks)}")
    for chunk, chunk_state in zip(model_chunks, payload["model"]):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    _set_rng_state(payload["rng"])
    return {"iteration": payload["iteration"], "consumed_samples": payload["consumed_samples"],
            "extra": payload["extra"]}
