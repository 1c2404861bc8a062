"""The checkpoint format: every rank saves its own shards; a checkpoint appears only once it is
complete and verified, and the last good one is never deleted before its replacement is published.

Layout on disk::

    DIR/latest_checkpointed_iteration.txt     the iteration of the newest complete checkpoint
    DIR/iter_0000020/rank_00003.pt            rank 3's model chunks, optimizer, scheduler, RNG,
                                              consumed samples, its coordinates and iteration,
                                              the model's TransformerConfig ("model_config")
    DIR/iter_0000020/manifest.json            iteration, layout, model configuration, and the
                                              sha256 and size of every rank file

Saving (a collective over the world): every rank checks its weights are finite (all ranks agree:
no checkpoint of non-finite weights is ever published), rank 0 creates an exclusive staging folder
``iter_0000020.staging-XXXX`` (``file_io.py``), every rank writes its file there (exclusive
temporary name, fsync, rename) and reports the file's hash; rank 0 writes the manifest, renames the
folder into place and finally replaces the tracker file atomically. A crash at any point leaves the
last complete checkpoint named by the tracker. With an ``AsyncCheckpointSaver`` the rank files are
written beside training and published later (``async_save.py``).

Loading reads the tracker and the manifest, and refuses — with a ValueError naming the file and
the difference, on every rank — a rank file whose hash or size differs from the manifest, a file
of another iteration, rank or layout than the manifest says, or a checkpoint of another model
(``model_signature``: the configuration fields that define the model). Files are read with
``torch.load(..., weights_only=True)``. Written by the same layout (tp, pp, dp, cp, vpp sizes,
distributed optimizer or not), each rank restores its own file exactly (model, optimizer — with
the distributed optimizer its own shard of the fp32 main parameters and Adam moments —, loss
scaler, scheduler, RNG). Written by another layout — or by the same one with the distributed
optimizer's shards over other element ranges (another gradient-bucket size) — the model and
optimizer are resharded
(``reshard.py``): weights, fp32 main copies, Adam moments and step, loss scaler, scheduler,
iteration and consumed samples carry over; RNG states are not restored then. All ranks agree on
success before returning, so a failure on one fails them all.

Every function takes what it works on explicitly (the folder, the model chunks, the optimizer,
the scheduler, the ParallelState); when to save, where, and which flags asked for it is the
trainer's policy (``training/checkpointing.py``).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from tpfuse.parallel.devices import collective_device

from . import file_io, reshard
from .sharded_state import full_state_dict, load_full_state_dict

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT_VERSION = 3             # 3: manifest.json with the rank files' hashes
# TransformerConfig categories that do not change what the weights mean (layout, dtype, memory)
_LAYOUT_CATEGORIES = ("parallelism", "precision", "recompute")
# model fields that only affect training or initialisation, not the weights or the function they
# compute: dropout, initialisation, the padding multiple (refitted), the training sequence length
# (the position table is max_position_embeddings), and the MoE training knobs (load-balancing
# losses, capacity and dropping, how tokens travel and how expert GEMMs run)
_TRAINING_FIELDS = ("hidden_dropout", "attention_dropout", "init_method_std",
                    "embedding_init_method_std", "seed",
                    "make_vocab_size_divisible_by", "seq_length",
                    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                    "moe_token_drop_policy", "moe_token_dispatcher_type", "moe_grouped_gemm",
                    "moe_router_bias_update_rate", "moe_shared_expert_overlap")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank:05d}.pt")


def layout_signature(state, optimizer=None) -> dict:
    """What must match for a rank to restore its own file as is (else: resharding)."""
    return {"world_size": dist.get_world_size(), "tp": state.tp_size, "pp": state.pp_size,
            "dp": state.dp_size, "cp": state.size("cp"), "vpp": state.vpp_size or 1,
            "ep": state.size("ep"), "etp": state.size("etp"),
            "distributed_optimizer": bool(getattr(optimizer, "distributed", False)),
            **_fsdp_signature(optimizer)}


def _fsdp_signature(optimizer) -> dict:
    """FSDP's pieces differ from the other layouts' (row blocks): {"fsdp": True} then, nothing
    otherwise (signatures of checkpoints written without FSDP stay as they were)."""
    return {"fsdp": True} if getattr(optimizer, "sharding_strategy", None) else {}


def model_config_dict(model_chunks) -> dict | None:
    """The chunks' TransformerConfig as plain values (``models.cli.config_to_dict``), or None.

    Stored in every rank file so a model can be rebuilt from the checkpoint alone
    (``tpfuse.inference.load_model``)."""
    from tpfuse.models.cli import config_to_dict
    from tpfuse.models.config import TransformerConfig

    config = getattr(model_chunks[0], "config", None) if model_chunks else None
    return config_to_dict(config) if isinstance(config, TransformerConfig) else None


def model_signature(model_chunks) -> dict | None:
    """The configuration fields that define the model (shape, norms, activation, vocabulary...),
    None for chunks without a ``config``."""
    config = getattr(model_chunks[0], "config", None) if model_chunks else None
    if config is None:
        return None
    from tpfuse.models.config import config_fields

    return {f.name: getattr(config, f.name) for f in config_fields()
            if f.metadata.get("category") not in _LAYOUT_CATEGORIES
            and f.name not in _TRAINING_FIELDS}


def check_same_model(saved: dict | None, current: dict | None, where: str) -> None:
    if saved is None or current is None:
        return
    differences = [f"{name}: checkpoint {saved.get(name)!r}, this run {current.get(name)!r}"
                   for name in sorted(set(saved) | set(current))
                   if saved.get(name) != current.get(name)]
    if differences:
        raise ValueError(f"{where} holds another model than this run builds; "
                         + "; ".join(differences))


# ---------------------------------------------------------------------------- RNG
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


# ---------------------------------------------------------------------------- agreement
def any_rank_failed(failed: bool) -> bool:
    """Collective over the world: True when ``failed`` on any rank (so all ranks raise)."""
    flag = torch.tensor([int(failed)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class OtherRankFailed(ValueError):
    """Raised on the ranks that did not fail themselves: a pointer to another rank's error (the
    launcher reports the pointing ranks' tracebacks only when no rank reported its own)."""
    secondary = True


def agree(error: BaseException | None, what: str) -> None:
    """Collective: raise ``error`` here, or a pointer to it on the ranks that did not fail."""
    if any_rank_failed(error is not None):
        raise error or OtherRankFailed(f"{what} failed on another rank (see its error)")


def _broadcast_from_zero(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------- saving
def first_non_finite(model_chunks) -> str | None:
    for index, chunk in enumerate(model_chunks):
        for name, tensor in full_state_dict(chunk).items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"chunk {index} {name}"
    return None


def build_payload(iteration, model_chunks, optimizer, scheduler, state, consumed_samples,
                  extra=None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout_signature(state, optimizer),
        "model_signature": model_signature(model_chunks),
        "rank": dist.get_rank(),
        "model": [full_state_dict(chunk) for chunk in model_chunks],
        "model_config": model_config_dict(model_chunks),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
        "reshard": reshard.save_metadata(model_chunks, optimizer, state),
    }


def begin_save(root: str, iteration: int, model_chunks) -> str:
    """Collective: refuse non-finite weights (on every rank), create the staging folder (rank 0)
    and return its path on every rank."""
    bad = first_non_finite(model_chunks)
    error = FloatingPointError(f"refusing to save checkpoint iteration {iteration}: {bad} holds "
                               "non-finite values (NaN/inf)") if bad else None
    agree(error, f"saving checkpoint iteration {iteration}")
    staging = None
    if dist.get_rank() == 0:
        staging = file_io.make_staging_dir(root, os.path.basename(iteration_dir(root, iteration)))
    return _broadcast_from_zero(staging)


def write_rank_file(staging: str, payload: dict) -> dict:
    """This rank's file in the staging folder; returns its ``{"sha256", "bytes"}``."""
    return file_io.atomic_torch_save(payload, _rank_file(staging, payload["rank"]))


def publish(root: str, iteration: int, staging: str, digest: dict | None,
            error: BaseException | None, header: dict, keep_last: int | None = None) -> str:
    """Collective: every rank reports its write (``digest`` or ``error``); rank 0 writes the
    manifest, moves the folder into place, updates the tracker and prunes old checkpoints."""
    agree(error, f"writing checkpoint iteration {iteration}")
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    final = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        files = {os.path.basename(_rank_file(staging, r)): d for r, d in enumerate(digests)}
        manifest = dict(header, format_version=FORMAT_VERSION, iteration=iteration, files=files)
        file_io.atomic_write_bytes(os.path.join(staging, MANIFEST),
                                   json.dumps(manifest, indent=1).encode())
        file_io.publish_dir(staging, final)
        file_io.atomic_write_bytes(os.path.join(root, TRACKER), f"{iteration}\n".encode())
        file_io.finish_replacement(final)
        if keep_last:
            file_io.prune(root, keep_last, protected=iteration)
    dist.barrier()
    return final


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, state,
                    consumed_samples: int, extra: dict | None = None,
                    keep_last: int | None = None) -> str:
    """Collective over the whole world: every rank writes its file, rank 0 publishes."""
    staging = begin_save(root, iteration, model_chunks)
    payload = build_payload(iteration, model_chunks, optimizer, scheduler, state,
                            consumed_samples, extra)
    digest, error = None, None
    try:
        digest = write_rank_file(staging, payload)
    except Exception as caught:  # noqa: BLE001 — re-raised by publish once every rank agreed
        error = caught
    header = {"layout": payload["layout"], "model_signature": payload["model_signature"]}
    return publish(root, iteration, staging, digest, error, header, keep_last)


# ---------------------------------------------------------------------------- loading
def _tracker_iteration(root: str) -> int | None:
    """The iteration the tracker names, None without a tracker; ValueError when it is not a
    small regular file holding an iteration number."""
    tracker = os.path.join(root, TRACKER)
    try:
        data = file_io.read_regular_file(tracker, file_io.TRACKER_CAP, "checkpoint tracker")
    except FileNotFoundError:
        return None
    text = data.decode("utf-8", errors="replace").strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {tracker} is corrupt: expected an iteration number, "
                         f"found {text[:40]!r}")
    return int(text)


def _load_manifest(path: str) -> dict:
    """The manifest at ``path`` (a small regular JSON file); ValueError naming it otherwise."""
    try:
        data = file_io.read_regular_file(path, file_io.MANIFEST_CAP, "checkpoint manifest")
    except OSError as error:
        raise ValueError(f"checkpoint manifest {path} is missing or unreadable ({error}); the "
                         f"folder is not a complete tpfuse checkpoint of format "
                         f"{FORMAT_VERSION}") from error
    try:
        manifest = json.loads(data)
    except ValueError as error:
        raise ValueError(f"checkpoint manifest {path} is missing or unreadable ({error}); the "
                         f"folder is not a complete tpfuse checkpoint of format "
                         f"{FORMAT_VERSION}") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"checkpoint manifest {path} is not a tpfuse manifest (no file list)")
    return manifest


def _is_complete(folder: str, iteration: int) -> bool:
    """``folder`` holds a manifest of this format and iteration whose every listed rank file is
    there, a regular file of the recorded size (the hashes are checked when it is loaded)."""
    try:
        manifest = _load_manifest(os.path.join(folder, MANIFEST))
    except ValueError:
        return False
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("iteration") != iteration:
        return False
    for name, digest in manifest["files"].items():
        path = os.path.join(folder, os.path.basename(str(name)))
        if not (os.path.isfile(path) and not os.path.islink(path) and isinstance(digest, dict)
                and os.path.getsize(path) == digest.get("bytes")):
            return False
    return True


def newest_complete_iteration(root: str) -> int | None:
    """The newest iteration of ``root`` whose folder (or its kept ``.replaced`` copy) holds a
    complete checkpoint by its manifest; None when none does. Independent of the tracker: a
    folder whose tracker was lost (or not yet replaced when a save was killed) is still found."""
    names = os.listdir(root) if os.path.isdir(root) else []
    found = set()
    for name in names:
        base = name[:-len(file_io.REPLACED_SUFFIX)] if name.endswith(file_io.REPLACED_SUFFIX) \
            else name
        match = file_io.ITERATION_DIR.match(base)
        if match:
            found.add(int(match.group(1)))
    for iteration in sorted(found, reverse=True):
        folder = file_io.existing_iteration_dir(iteration_dir(root, iteration))
        if folder is not None and _is_complete(folder, iteration):
            return iteration
    return None


def latest_iteration(root: str) -> int | None:
    """The newest complete checkpoint's iteration, or None when ``root`` holds none.

    A checkpoint is recognised by its manifest, not by the tracker alone: the result is the
    newer of the tracker's iteration and the newest folder with a complete manifest, so a lost
    or stale tracker never makes a folder of checkpoints look empty (and a relaunch never trains
    from scratch over them)."""
    named = _tracker_iteration(root)
    complete = newest_complete_iteration(root)
    candidates = [it for it in (named, complete) if it is not None]
    return max(candidates) if candidates else None


def read_manifest(root: str, iteration: int) -> tuple[str, dict]:
    """(folder, manifest) of the checkpoint the tracker names; ValueError when inconsistent."""
    folder = file_io.existing_iteration_dir(iteration_dir(root, iteration))
    if folder is None:
        raise FileNotFoundError(f"checkpoint {iteration_dir(root, iteration)} named by "
                                f"{os.path.join(root, TRACKER)} is missing")
    path = os.path.join(folder, MANIFEST)
    manifest = _load_manifest(path)
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("iteration") != iteration:
        raise ValueError(f"checkpoint manifest {path} is of format {manifest.get('format_version')}"
                         f" / iteration {manifest.get('iteration')}; expected format "
                         f"{FORMAT_VERSION}, iteration {iteration} (the tracker's)")
    return folder, manifest


def _read_payload(path: str, mmap: bool = False) -> dict:
    """One rank file, unverified (``load_checkpoint`` verifies against the manifest first)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # truncated / not a torch file / unsafe content
        raise ValueError(f"checkpoint file {path} is corrupt or unreadable: {error}") from error
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint file {path} is not a tpfuse checkpoint of format "
                         f"{FORMAT_VERSION}")
    return payload


def verified_reader(manifest: dict):
    """``read(path, mmap=False)``: a rank file checked against ``manifest`` — size and sha256 of
    its bytes, then its own iteration, rank and layout."""
    def read(path: str, mmap: bool = False) -> dict:
        name = os.path.basename(path)
        expected = manifest["files"].get(name)
        if expected is None:
            raise ValueError(f"checkpoint file {path} is not listed in the manifest")
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file {path} is missing")
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint file {path} is not a regular file (a FIFO, device or "
                             "folder); refusing to read it")
        found = file_io.file_digest(path)
        if found != expected:
            raise ValueError(f"checkpoint file {path} is corrupt: {found['bytes']} bytes with "
                             f"sha256 {found['sha256'][:16]}…, the manifest records "
                             f"{expected['bytes']} bytes with sha256 {expected['sha256'][:16]}…")
        payload = _read_payload(path, mmap=mmap)
        claimed = (payload.get("iteration"), payload.get("rank"), payload.get("layout"))
        wanted = (manifest["iteration"], int(name[len("rank_"):-len(".pt")]), manifest["layout"])
        if claimed != wanted:
            raise ValueError(f"checkpoint file {path} belongs elsewhere: it says iteration "
                             f"{claimed[0]}, rank {claimed[1]}, layout {claimed[2]}; its place "
                             f"says iteration {wanted[0]}, rank {wanted[1]}, layout {wanted[2]}")
        return payload
    return read


def verify_checkpoint(root: str) -> int | None:
    """Check (no collective, any process) that the checkpoint the tracker names is complete:
    manifest, every listed rank file with its size and sha256, each file's own iteration / rank
    / layout. Returns its iteration (None: no checkpoint); ValueError / FileNotFoundError else."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    folder, manifest = read_manifest(root, iteration)
    read = verified_reader(manifest)
    for name in sorted(manifest["files"]):
        read(os.path.join(folder, name), mmap=True)
    return iteration


def _same_optimizer_shards(saved: dict, optimizer) -> bool:
    """Whether this rank's optimizer pieces cover exactly the element ranges the saved state
    does (the distributed optimizer's shards follow the gradient-bucket layout: another
    ``--ddp-bucket-size`` gives other ranges in the same tp/pp/dp layout). True for optimizers
    without pieces."""
    pieces = getattr(optimizer, "pieces", None)
    entries = saved.get("params") if isinstance(saved, dict) else None
    if pieces is None or not isinstance(entries, list):
        return True
    if len(entries) != len(getattr(optimizer, "model_params", entries)):
        return True                # another model: refused by load_state_dict with its message
    for piece in pieces:
        entry = entries[piece.position]
        if entry is None or (entry["start"], entry["end"]) != (piece.start, piece.end):
            return False
    return True


def _restore_same_layout(folder, read, model_chunks, optimizer) -> dict | None:
    """This rank's own file restored as is; None (nothing restored) when its optimizer shards
    cover other element ranges than this run's (then the reshard path loads it)."""
    payload = read(_rank_file(folder, dist.get_rank()))
    if not _same_optimizer_shards(payload["optimizer"], optimizer):
        return None
    if len(payload["model"]) != len(model_chunks):
        raise ValueError(f"checkpoint {folder} holds {len(payload['model'])} model chunks per "
                         f"rank, this rank has {len(model_chunks)}")
    for chunk, chunk_state in zip(model_chunks, payload["model"]):
        load_full_state_dict(chunk, chunk_state)
    optimizer.load_state_dict(payload["optimizer"])
    return payload


def _load_other_layout(folder: str, model_chunks, optimizer, state, read) -> dict:
    """Reshard on every rank; raise everywhere when any rank cannot."""
    payload, error = None, None
    try:
        payload = reshard.load_resharded(folder, model_chunks, optimizer, state,
                                         layout_signature(state, optimizer), read)
    except Exception as caught:  # noqa: BLE001 — re-raised below, after every rank has agreed
        error = caught
    agree(error, f"resharding checkpoint {folder}")
    return payload


def load_weights_only(root: str, model_chunks, state) -> None:
    """``--finetune``: the model's weights from a checkpoint of any layout (verified against its
    manifest, another model refused); nothing else is read. Collective: all ranks agree."""
    error = None
    try:
        folder, manifest = read_manifest(root, latest_iteration(root))
        check_same_model(manifest.get("model_signature"), model_signature(model_chunks),
                         f"checkpoint {folder}")
        reshard.load_model_weights(folder, verified_reader(manifest), model_chunks,
                                   state.tp_size, state.tp_rank)
    except Exception as caught:  # noqa: BLE001 — re-raised below, after every rank has agreed
        error = caught
    agree(error, f"loading the weights of checkpoint {root} (--finetune)")


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, state) -> dict:
    """Restore this rank's shards and states; returns {"iteration", "consumed_samples", "extra"}.

    A collective over the world (see the module docstring). FileNotFoundError when ``root``
    holds no checkpoint at all (no tracker).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER} there (no complete checkpoint)")
    payload, error = None, None
    try:
        folder, manifest = read_manifest(root, iteration)
        if manifest.get("weights_only"):
            raise ValueError(f"checkpoint {folder} holds model weights only (no optimizer or "
                             "scheduler state, e.g. from tpfuse-convert): train from it with "
                             "--finetune")
        check_same_model(manifest.get("model_signature"), model_signature(model_chunks),
                         f"checkpoint {folder}")
        read = verified_reader(manifest)
        same_layout = manifest["layout"] == layout_signature(state, optimizer)
        if same_layout:
            payload = _restore_same_layout(folder, read, model_chunks, optimizer)
    except Exception as caught:  # noqa: BLE001 — re-raised below, after every rank has agreed
        error = caught
    agree(error, f"loading checkpoint {root}")
    if same_layout and any_rank_failed(payload is None):
        same_layout = False        # another shard layout (bucket sizes): reshard, on every rank
    if not same_layout:
        payload = _load_other_layout(folder, model_chunks, optimizer, state, read)
    scheduler.load_state_dict(payload["scheduler"])
    if same_layout:
        _set_rng_state(payload["rng"])
    return {"iteration": payload["iteration"], "consumed_samples": payload["consumed_samples"],
            "extra": payload["extra"]}
