"""``--ckpt-format torch_dist``: the trainer's whole state in Megatron's torch_dist layout, so one
checkpoint loads at any tp / pp / vpp / dp / ep / FSDP layout, and megatron-core reads its model.

Layout on disk (Megatron-LM's, plus tpfuse's manifest)::

    DIR/latest_checkpointed_iteration.txt   the newest complete checkpoint's iteration
    DIR/iter_0000020/metadata.json          {"sharded_backend": "torch_dist", ...}
    DIR/iter_0000020/.metadata, __R_I.distcp  torch.distributed.checkpoint's index and chunks
    DIR/iter_0000020/common.pt              rank 0's entries that are no sharded tensor
    DIR/iter_0000020/manifest.json          tpfuse's: format, iteration, layout, model
                                            signature, and the sha256 and size of every file

What is stored (``dist/gpt_layout.py`` gives the model's keys)::

    model          every parameter under its Megatron key (``decoder.layers.<name>`` stacked on
                   the layer axis, TP weights cut along their partition dim): whole TP shards,
                   gathered first where FSDP shards them by rows
    optimizer      every per-element state tensor of a parameter's optimizer state (Adam's
                   exp_avg / exp_avg_sq, a momentum buffer, ..., the fp32 main copy as
                   ``fp32_param``) as ``optimizer.state.<name>.<model key>``, cut exactly as the
                   parameter (Megatron's model-space layout): the distributed optimizer's and
                   FSDP's flat pieces ``[start, end)`` of the TP shard are gathered over the
                   parameter's data-parallel group (dp·cp, experts: edp) at save, and sliced
                   back to this rank's pieces at load; per-parameter scalars (the step) and
                   the param groups' hyper-parameters and loss scaler go into common.pt
    rng_state      one ShardedObject per rank (restored only into the same layout)
    common.pt      ``tpfuse``: iteration, consumed samples, layout, model signature and
                   config, scheduler, ``extra``; Megatron's ``iteration``, ``args``
                   (a Namespace of the model config and parallel sizes), ``checkpoint_version``

Saving keeps the trainer's guarantees of the per-rank format (``format.py``): non-finite weights
are refused on every rank, the files go into an exclusive staging folder that is renamed into
place once complete, the manifest records every file's sha256 and size, and the tracker is
replaced last, so a kill at any moment leaves the last complete checkpoint named. With
``AsyncTorchDistSaver`` the files are written by a background thread through a process group of
its own (gloo), and published like a synchronous save.

Loading checks, before any collective read: every file against the manifest (on every rank; a
truncated or altered ``.distcp`` is a ValueError naming it, agreed by all), the requested keys
and global shapes against the checkpoint's index (a ValueError naming the key and both shapes),
and the model signature. The vocabulary rows (padded to a multiple that changes with tp) are
refitted as in ``reshard.py``: the real ``vocab_size`` rows kept, zero rows appended. A folder
megatron-core wrote (a ``metadata.json`` without tpfuse's manifest: Megatron-LM's
``iter_*`` folders, or a bare ``dist_checkpointing.save`` folder) gives its model weights, the
optimizer state where it holds Megatron's model-space keys for this model or Megatron-LM's
``dp_reshardable`` buckets, its iteration, and the scheduler from Megatron-LM's
``opt_param_scheduler`` (``megatron_lm.py``); the RNG starts fresh then.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from . import file_io
from . import format as ckpt
from . import megatron_lm
from .async_save import AsyncCheckpointSaver, _Write, cpu_snapshot
# .dist.serialization and .dist.torch_dist import torch.distributed.checkpoint (0.7 s of start-up):
# the functions that read or write files import them
from .dist.core import CONFIG_FNAME, CheckpointingException, maybe_load_config
from .dist.gpt_layout import WORD_EMBEDDING_KEY, gpt_sharded_state_dict, megatron_name
from .dist.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, apply_factories
from .reshard import fit_vocab_rows, persistent_buffers
from .sharded_state import copy_into, full_state_dict
from .sharding import shard_for

FORMAT = "torch_dist"
COMMON = "tpfuse"                      # common.pt's entry holding the trainer's state
OPTIMIZER_PREFIX = "optimizer.state"
MAIN_COPY = ("main_param", "fp32_param")   # the optimizer's name of the fp32 copy, Megatron's
VOCAB_KEYS = (WORD_EMBEDDING_KEY, "output_layer.weight")
CHECKPOINT_VERSION = 3.0               # Megatron-LM's checkpoint_version


# ---------------------------------------------------------------------------- recognising
def is_dist_folder(folder: str) -> bool:
    """``folder`` holds a torch_dist checkpoint (its ``metadata.json``)."""
    return os.path.isfile(os.path.join(folder, CONFIG_FNAME))


def _manifest_format(folder: str) -> str | None:
    try:
        return ckpt._load_manifest(os.path.join(folder, ckpt.MANIFEST)).get("ckpt_format")
    except ValueError:
        return None


def checkpoint_dir_of(root: str) -> str | None:
    """The torch_dist folder ``root`` names for loading, None when it holds none: ``root``
    itself (a bare megatron-core folder), or the newest complete ``iter_*`` folder (tpfuse's)
    or the tracker's (Megatron-LM's)."""
    if is_dist_folder(root):
        return root
    iteration = ckpt.latest_iteration(root)
    if iteration is None:
        return None
    folder = file_io.existing_iteration_dir(ckpt.iteration_dir(root, iteration))
    if folder is None or not is_dist_folder(folder):
        return None
    if os.path.exists(os.path.join(folder, ckpt.MANIFEST)) and _manifest_format(folder) != FORMAT:
        return None
    return folder


# ---------------------------------------------------------------------------- model
def _model_sharded(model_chunks, tensors_per_chunk) -> list[dict]:
    """Per chunk ``{Megatron module name: sharded entry}``; ``tensors_per_chunk[c]`` the data."""
    return [gpt_sharded_state_dict(chunk, tensors=tensors)
            for chunk, tensors in zip(model_chunks, tensors_per_chunk)]


def _entries_by_param(model_chunks, sharded: list[dict]) -> dict:
    """id(parameter) → (its sharded entry, a name unique on this rank, its layout-independent
    name: the single-process model's, a tied output copy's the word embedding's); a weight
    shared by two modules once."""
    out = {}
    for c, (chunk, entries) in enumerate(zip(model_chunks, sharded)):
        global_names = chunk.global_parameter_names()
        for name, param in chunk.named_parameters():
            shared = getattr(param, "shared_embedding", False)
            out.setdefault(id(param), (entries[megatron_name(name)], f"model{c}/{name}",
                                       WORD_EMBEDDING_KEY if shared else global_names[name]))
    return out


def state_entry(entry, state_name: str, data: torch.Tensor):
    """Megatron's ``make_sharded_optimizer_tensor``: the parameter's entry with ``data``."""
    key = f"{OPTIMIZER_PREFIX}.{state_name}.{entry.key}"
    if isinstance(entry, ShardedTensorFactory):
        return replace(entry, key=key, data=data)
    return replace(entry, key=key, data=data, dtype=data.dtype)


# ---------------------------------------------------------------------------- optimizer
def _is_flat_state(value, piece: dict) -> bool:
    return torch.is_tensor(value) and value.ndim == 1 and \
        value.numel() == piece["end"] - piece["start"]


def stored_name(name: str) -> str:
    return MAIN_COPY[1] if name == MAIN_COPY[0] else name


def optimizer_name(stored: str) -> str:
    return MAIN_COPY[0] if stored == MAIN_COPY[1] else stored


def _sharded_pieces(optimizer) -> bool:
    """Whether the pieces of a parameter are spread over its data-parallel group (the
    distributed optimizer, FSDP) rather than each rank holding all of them."""
    return bool(getattr(optimizer, "distributed", False)
                or getattr(optimizer, "sharding_strategy", None))


def _dp_group(param, state):
    return state.group("edp") if getattr(param, "allreduce", True) is False else \
        state.dp_cp_group


def _state_names(optimizer, entries, names_of) -> dict:
    """Collective (world): per parameter (its layout-independent name), the names of its
    per-element state tensors (the union over the ranks holding a piece of it)."""
    mine = {}
    for position, param in enumerate(optimizer.model_params):
        piece = entries[position]
        if piece is not None:
            key = names_of[id(param)][2]
            mine.setdefault(key, set()).update(
                name for name, value in piece.items() if _is_flat_state(value, piece))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {}
    for names in gathered:
        for key, found in names.items():
            merged.setdefault(key, set()).update(found)
    return {key: sorted(found) for key, found in merged.items()}


def _whole_state(param, piece: dict | None, name: str, gather_group) -> torch.Tensor:
    """One state tensor of ``param``'s TP shard: this rank's piece placed at its offsets and,
    with ``gather_group``, every element taken from a rank of the group that holds it
    (an all-gather of the flat tensors and their coverage masks; the lowest such rank wins)."""
    numel = param.numel()
    device = piece[name].device if piece is not None and name in piece else param.device
    flat = torch.zeros(numel, dtype=torch.float32, device=device)
    covered = torch.zeros(numel, dtype=torch.float32, device=device)
    if piece is not None and name in piece:
        flat[piece["start"]:piece["end"]] = piece[name].to(device, torch.float32)
        covered[piece["start"]:piece["end"]] = 1.0
    if gather_group is not None and dist.get_world_size(gather_group) > 1:
        size = dist.get_world_size(gather_group)
        both = torch.stack([flat, covered])
        gathered = [torch.empty_like(both) for _ in range(size)]
        dist.all_gather(gathered, both, group=gather_group)
        flat = torch.zeros_like(flat)
        taken = torch.zeros_like(covered, dtype=torch.bool)
        for other in gathered:
            mask = other[1].bool() & ~taken
            flat[mask] = other[0][mask]
            taken |= mask
        covered = taken.float()
    if not bool(covered.bool().all()):
        missing = int((~covered.bool()).sum())
        raise ValueError(f"optimizer state {name} of a {tuple(param.shape)} parameter misses "
                         f"{missing} elements on its data-parallel group")
    return flat.view(tuple(param.shape)).cpu()


def _optimizer_sharded(optimizer, model_chunks, sharded, state) -> tuple[dict, dict]:
    """Collective: (``{stored key: ShardedTensor / factory}`` of every optimizer state tensor,
    the common entries: param groups, loss scaler, per-key names and scalars)."""
    saved = optimizer.state_dict()
    entries = saved["params"]
    by_param = _entries_by_param(model_chunks, sharded)
    names = _state_names(optimizer, entries, by_param)
    spread = _sharded_pieces(optimizer)
    out, scalars = {}, {}
    for position, param in enumerate(optimizer.model_params):
        entry, unique, global_name = by_param[id(param)]
        piece = entries[position]
        for name in names.get(global_name, []):
            whole = _whole_state(param, piece, name, _dp_group(param, state) if spread else None)
            out[f"{unique}/{name}"] = state_entry(entry, stored_name(name), whole)
        if piece is not None:
            scalars[global_name] = {k: cpu_snapshot(v) for k, v in piece.items()
                                    if k not in ("start", "end") and not _is_flat_state(v, piece)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, scalars)
    merged = {}
    for part in gathered:
        merged.update(part)
    common = {"param_groups": saved.get("param_groups"), "grad_scaler": saved.get("grad_scaler"),
              "format": saved.get("format"),
              "state_names": {key: [stored_name(n) for n in found]
                              for key, found in names.items()},
              "scalars": merged}
    return out, common


# ---------------------------------------------------------------------------- saving
def _args_namespace(model_chunks, state) -> argparse.Namespace:
    """Megatron-LM's ``args`` entry: the model config's fields and the parallel sizes."""
    args = dict(ckpt.model_config_dict(model_chunks) or {})
    args.update(tensor_model_parallel_size=state.tp_size,
                pipeline_model_parallel_size=state.pp_size,
                virtual_pipeline_model_parallel_size=state.vpp_size,
                context_parallel_size=state.size("cp"), expert_model_parallel_size=state.size("ep"),
                ckpt_format=FORMAT)
    return argparse.Namespace(**args)


def build_sharded_state(iteration, model_chunks, optimizer, scheduler, state, consumed_samples,
                        extra=None) -> tuple[dict, dict]:
    """Collective: (the sharded state dict of the whole training state, the manifest header)."""
    tensors = [full_state_dict(chunk) for chunk in model_chunks]     # whole TP shards
    sharded = _model_sharded(model_chunks, tensors)
    optimizer_tree, optimizer_common = _optimizer_sharded(optimizer, model_chunks, sharded, state)
    layout = ckpt.layout_signature(state, optimizer)
    signature = ckpt.model_signature(model_chunks)
    rank, world = dist.get_rank(), dist.get_world_size()
    tree = {f"model{c}": entries for c, entries in enumerate(sharded)}
    tree.update({
        "optimizer": optimizer_tree,
        "rng_state": ShardedObject("rng_state", ckpt._rng_state(), (world,), (rank,), 0),
        COMMON: {"format_version": ckpt.FORMAT_VERSION, "iteration": iteration,
                 "consumed_samples": consumed_samples, "layout": layout,
                 "model_signature": signature,
                 "model_config": ckpt.model_config_dict(model_chunks),
                 "scheduler": scheduler.state_dict(), "extra": extra or {},
                 "optimizer": optimizer_common},
        "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
        "args": _args_namespace(model_chunks, state),
    })
    header = {"ckpt_format": FORMAT, "layout": layout, "model_signature": signature}
    return tree, header


def folder_digests(folder: str) -> dict:
    """file name → {"sha256", "bytes"} of every file in ``folder`` (but the manifest)."""
    return {name: file_io.file_digest(os.path.join(folder, name))
            for name in sorted(os.listdir(folder))
            if name != ckpt.MANIFEST and os.path.isfile(os.path.join(folder, name))}


def publish(root, iteration, staging, error, header, keep_last=None) -> str:
    """Collective: every rank reports its write; rank 0 records the files' hashes in the
    manifest and publishes the folder (``format.publish_folder``)."""
    ckpt.agree(error, f"writing checkpoint iteration {iteration}")
    dist.barrier()
    return ckpt.publish_folder(root, iteration, staging, lambda: folder_digests(staging),
                               header, keep_last)


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, state,
                    consumed_samples: int, extra: dict | None = None,
                    keep_last: int | None = None) -> str:
    """Collective over the world: the torch_dist files into a staging folder, then publish."""
    from .dist import serialization
    staging = ckpt.begin_save(root, iteration, model_chunks)
    tree, header = build_sharded_state(iteration, model_chunks, optimizer, scheduler, state,
                                       consumed_samples, extra)
    prepared = serialization.prepare_save(tree)
    error = None
    try:
        serialization.write_prepared(*prepared, staging)
    except Exception as caught:  # noqa: BLE001 — re-raised by publish once every rank agreed
        error = caught
    return publish(root, iteration, staging, error, header, keep_last)


def _snapshot(prepared: tuple) -> tuple:
    """``prepare_save``'s output with every tensor copied to CPU memory."""
    common, tensors, objects = prepared
    tensors = [replace(sh, data=sh.data.detach().to("cpu", copy=True)) for sh in tensors]
    objects = [replace(sh, data=cpu_snapshot(sh.data)) for sh in objects]
    return cpu_snapshot(common), tensors, objects


class AsyncTorchDistSaver(AsyncCheckpointSaver):
    """``--async-save`` with ``--ckpt-format torch_dist``: the collective part at once
    (finite-weights check, staging folder, the state gathered and copied to CPU, the tiling
    check), the files written by a background thread whose torch.distributed.checkpoint
    collectives run over a gloo group of their own (created here: a collective), published
    like a synchronous save (``publish``) once every rank's thread is done."""

    def __init__(self, root: str, keep_last: int | None = None):
        super().__init__(root, keep_last)
        self.group = dist.new_group(backend="gloo")

    def save(self, iteration, model_chunks, optimizer, scheduler, state, consumed_samples,
             extra=None) -> None:
        from .dist import serialization
        self.wait()
        staging = ckpt.begin_save(self.root, iteration, model_chunks)
        tree, header = build_sharded_state(iteration, model_chunks, optimizer, scheduler, state,
                                           consumed_samples, extra)
        prepared = _snapshot(serialization.prepare_save(tree))

        def job():
            serialization.write_prepared(*prepared, staging, process_group=self.group)
        self.pending = (iteration, _Write(staging, job), header)

    def publish(self, iteration: int, write: _Write, header: dict) -> None:
        publish(self.root, iteration, write.staging, write.error, header, self.keep_last)

    def close(self) -> None:
        """After the last ``wait`` (collective): the writers' gloo group is destroyed; no thread
        uses it any more."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


# ---------------------------------------------------------------------------- loading
def _check_files(folder: str, manifest: dict) -> None:
    """Every file the manifest lists is there with its recorded size and sha256."""
    for name, expected in sorted(manifest["files"].items()):
        path = os.path.join(folder, os.path.basename(str(name)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file {path} is missing")
        found = file_io.file_digest(path)
        if found != expected:
            raise ValueError(f"checkpoint file {path} is corrupt: {found['bytes']} bytes with "
                             f"sha256 {found['sha256'][:16]}…, the manifest records "
                             f"{expected['bytes']} bytes with sha256 {expected['sha256'][:16]}…")


def verified_common(folder: str) -> dict:
    """common.pt after the files are checked against the manifest (when tpfuse wrote it)."""
    from .dist import serialization
    manifest_path = os.path.join(folder, ckpt.MANIFEST)
    if os.path.exists(manifest_path):
        manifest = ckpt._load_manifest(manifest_path)
        if manifest.get("ckpt_format") != FORMAT:
            raise ValueError(f"checkpoint {folder} is not a torch_dist checkpoint (its manifest "
                             f"says format {manifest.get('ckpt_format')!r})")
        _check_files(folder, manifest)
    config = maybe_load_config(folder)
    if config is None or config.sharded_backend != FORMAT:
        raise ValueError(f"checkpoint {folder} is not a torch_dist checkpoint (its "
                         f"{CONFIG_FNAME} names backend "
                         f"{None if config is None else config.sharded_backend!r})")
    try:
        return serialization.load_common_state_dict(folder)
    except Exception as error:  # noqa: BLE001 — a truncated / foreign common.pt
        raise ValueError(f"checkpoint file {os.path.join(folder, 'common.pt')} is corrupt or "
                         f"unreadable: {error}") from error


class _VocabRefit:
    """A vocabulary tensor stored with other padding rows: read whole, refitted, re-cut."""

    def __init__(self, entry: ShardedTensor, stored_shape: tuple, vocab_size: int, sizes):
        self.entry, self.vocab_size, self.sizes = entry, vocab_size, sizes
        self.request = ShardedTensor.from_rank_offsets(
            entry.key, torch.empty(stored_shape, dtype=entry.dtype), replica_id=0)

    def finish(self, full: torch.Tensor) -> torch.Tensor:
        rows = self.entry.global_shape[0]
        if full.shape[0] != rows:
            full = fit_vocab_rows(full, rows, self.vocab_size)
        tp, tp_rank = self.sizes
        return shard_for(full, 0 if self.entry.local_shape[0] != rows else None, 1, tp, tp_rank)


def check_shapes(requests: dict, metadata, folder: str, vocab_size: int | None, sizes) -> dict:
    """Every requested tensor is in the checkpoint with this model's global shape (a ValueError
    naming the key and both shapes); vocabulary tensors whose padding differs become
    ``_VocabRefit`` requests."""
    for name, entry in list(requests.items()):
        leaves = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
        for leaf in _flat(leaves):
            stored = metadata.state_dict_metadata.get(leaf.key)
            if stored is None:
                raise ValueError(f"checkpoint {folder} does not fit this model: it has no tensor "
                                 f"{leaf.key!r}")
            shape = tuple(getattr(stored, "size", ()))
            if shape == tuple(leaf.global_shape):
                continue
            vocab = leaf.key.endswith(VOCAB_KEYS) and vocab_size is not None and \
                len(shape) == len(leaf.global_shape) and shape[1:] == leaf.global_shape[1:] \
                and shape[0] >= vocab_size
            if not vocab:
                raise ValueError(f"checkpoint {folder} does not fit this model: tensor "
                                 f"{leaf.key!r} has the global shape {shape} there, this model's "
                                 f"is {tuple(leaf.global_shape)}")
            requests[name] = _VocabRefit(leaf, shape, vocab_size, sizes)
    return requests


def _flat(leaves):
    for leaf in leaves if isinstance(leaves, list) else [leaves]:
        if isinstance(leaf, list):
            yield from _flat(leaf)
        else:
            yield leaf


def load_requests(requests: dict, folder: str) -> dict:
    """Collective: name → the loaded tensor of every request (refits applied)."""
    from .dist import serialization
    tree = {name: (r.request if isinstance(r, _VocabRefit) else r) for name, r in requests.items()}
    loaded = serialization.load(tree, folder)
    return {name: (r.finish(loaded[name]) if isinstance(r, _VocabRefit) else loaded[name])
            for name, r in requests.items()}


def _load_templates(model_chunks) -> list[dict]:
    """Empty tensors of every chunk's state-dict shapes (the load requests' data, on CPU)."""
    return [{name: torch.empty(tuple(t.shape), dtype=t.dtype)
             for name, t in chunk.state_dict(keep_vars=True).items()} for chunk in model_chunks]


def _model_tensors(chunk) -> dict:
    """name → tensor of what a chunk loads: its parameters and persistent buffers (the routers'
    expert biases, Megatron's ``router.expert_bias``)."""
    return {**dict(chunk.named_parameters()), **persistent_buffers(chunk)}


def _model_requests(model_chunks, sharded) -> dict:
    requests = {}
    for c, (chunk, entries) in enumerate(zip(model_chunks, sharded)):
        for name in _model_tensors(chunk):
            requests[f"model{c}/{name}"] = entries[megatron_name(name)]
    return requests


def _optimizer_requests(optimizer, model_chunks, sharded, metadata, state_names) -> dict:
    """Per parameter this rank holds a piece of: its stored state tensors (``state_names``:
    key → stored names; None: the Megatron names present in the checkpoint)."""
    by_param = _entries_by_param(model_chunks, sharded)
    positions = {piece.position for piece in optimizer.pieces}
    requests = {}
    for position, param in enumerate(optimizer.model_params):
        if position not in positions:
            continue
        entry, unique, global_name = by_param[id(param)]
        names = state_names.get(global_name, []) if state_names is not None else [
            n for n in ("exp_avg", "exp_avg_sq", "fp32_param")
            if f"{OPTIMIZER_PREFIX}.{n}.{entry.key}" in metadata.state_dict_metadata]
        template = torch.empty(tuple(param.shape), dtype=torch.float32)
        for name in names:
            requests[f"{unique}/{name}"] = state_entry(entry, name, template)
    return requests


def _apply_model(model_chunks, loaded: dict) -> None:
    with torch.no_grad():
        for c, chunk in enumerate(model_chunks):
            for name, tensor in _model_tensors(chunk).items():
                copy_into(tensor, loaded[f"model{c}/{name}"])


def _apply_optimizer(optimizer, model_chunks, sharded, loaded: dict, common: dict | None,
                     megatron_step=None) -> None:
    """Every piece from the loaded whole states, sliced to ``[start, end)``; the scalars and the
    loss scaler from common.pt (``common``; None for a megatron-core checkpoint: its pieces
    with a stored state take ``megatron_step``, the others keep this run's fresh state)."""
    by_param = _entries_by_param(model_chunks, sharded)
    scalars = (common or {}).get("scalars", {})
    for piece in optimizer.pieces:
        _, unique, global_name = by_param[id(piece.model_param)]
        saved = {"start": piece.start, "end": piece.end}
        saved.update(scalars.get(global_name, {}))
        if common is None:
            saved["step"] = torch.tensor(0.0) if megatron_step is None else megatron_step
        prefix = f"{unique}/"
        states = {optimizer_name(name[len(prefix):]): tensor.reshape(-1)[piece.start:piece.end]
                  for name, tensor in loaded.items() if name.startswith(prefix)}
        if not states and common is None:
            continue                # a megatron-core checkpoint without this optimizer state
        optimizer.load_piece(piece, dict(saved, **states))
    if common and optimizer.grad_scaler is not None and common.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])


def _megatron_step(common: dict):
    """The Adam step megatron-core records as ``common_step`` (None when absent)."""
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    for nesting in (optimizer, (optimizer or {}).get("optimizer") if optimizer else None):
        step = ((nesting or {}).get("state") or {}).get("common_step") \
            if isinstance(nesting, dict) else None
        if step is not None:
            return torch.as_tensor(step, dtype=torch.float32)
    return None


def _megatron_scheduler(common: dict, scheduler):
    """The LRScheduler state of a Megatron-LM checkpoint's opt_param_scheduler (None without
    one, or without a scheduler to restore)."""
    saved = common.get("opt_param_scheduler")
    if scheduler is None or not isinstance(saved, dict) or \
            not megatron_lm.is_megatron_common(common):
        return None
    return megatron_lm.scheduler_state(saved, common["args"], scheduler.unit)


def _bucket_state(common, metadata, folder):
    """The dp_reshardable optimizer state of a Megatron-LM checkpoint, None when it has none."""
    if not any(megatron_lm.is_bucket_key(key) for key in metadata.state_dict_metadata):
        return None
    return megatron_lm.BucketState(metadata, common.get("args"), folder)


def _plan_load(folder, model_chunks, optimizer, state, weights_only: bool, scheduler=None):
    """(common, requests, sharded, whether the checkpoint is tpfuse's, the Megatron-LM
    scheduler state, the Megatron-LM bucket state): every check that needs no collective."""
    from .dist import torch_dist
    common = verified_common(folder)
    ours = isinstance(common.get(COMMON), dict)
    sharded = _model_sharded(model_chunks, _load_templates(model_chunks))
    metadata = torch_dist.read_metadata(folder)
    requests = _model_requests(model_chunks, sharded)
    if not weights_only:
        names = common[COMMON]["optimizer"]["state_names"] if ours else None
        requests.update(_optimizer_requests(optimizer, model_chunks, sharded, metadata, names))
    config = getattr(model_chunks[0], "config", None)
    requests = check_shapes(requests, metadata, folder, getattr(config, "vocab_size", None),
                             (state.tp_size, state.tp_rank))
    if ours:                    # the keys and shapes fit: what differs beyond them
        ckpt.check_same_model(common[COMMON].get("model_signature"),
                              ckpt.model_signature(model_chunks), f"checkpoint {folder}")
    megatron_schedule = buckets = None
    if not ours and not weights_only:
        megatron_schedule = _megatron_scheduler(common, scheduler)
        buckets = _bucket_state(common, metadata, folder)
        if buckets is not None:
            requests.update(buckets.requests())
    return common, requests, sharded, ours, megatron_schedule, buckets


def _bucket_optimizer_states(buckets, model_chunks, sharded, loaded: dict, folder) -> dict:
    """``{"<unique>/<stored state name>": this rank's piece}`` of every parameter from the
    bucket tensors (vocabulary rows refitted as the weights); the main copies checked against
    the loaded weights (the bucket layout's check)."""
    config = getattr(model_chunks[0], "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    stacked = {name: buckets.stacked(loaded, name) for name in buckets.states}
    out = {}
    for entry, unique, _ in _entries_by_param(model_chunks, sharded).values():
        if not isinstance(entry, ShardedTensor):
            raise ValueError(f"checkpoint {folder}: the dp_reshardable optimizer state of "
                             f"{entry.key} (a {type(entry).__name__}) is not supported")
        for name, tensors in stacked.items():
            full = tensors[entry.key]
            if full.shape[0] != entry.global_shape[0] and entry.key.endswith(VOCAB_KEYS):
                full = fit_vocab_rows(full, entry.global_shape[0], vocab_size)
            out[f"{unique}/{megatron_lm.STATE_NAMES[name]}"] = megatron_lm.local_piece(entry,
                                                                                      full)
        main = out.get(f"{unique}/{megatron_lm.STATE_NAMES['param']}")
        weight = loaded.get(unique)
        if main is not None and weight is not None and \
                not torch.equal(main.to(weight.dtype), weight.to(main.device)):
            raise ValueError(f"checkpoint {folder}: the main copy of {entry.key} in its "
                             "dp_reshardable optimizer state differs from its weight: the "
                             "bucket layout is not megatron-core's for this model")
    return out


def _load(folder, model_chunks, optimizer, state, weights_only: bool, what: str,
          scheduler=None):
    """Collective: the checks (agreed on every rank), the read, the model (and optimizer)."""
    planned, error = None, None
    try:
        planned = _plan_load(folder, model_chunks, optimizer, state, weights_only, scheduler)
    except (ValueError, OSError, CheckpointingException) as caught:
        error = caught
    ckpt.agree(error, what)
    common, requests, sharded, ours, megatron_schedule, buckets = planned
    try:
        loaded = load_requests(requests, folder)
    except CheckpointingException as caught:      # raised on every rank alike
        raise ValueError(f"{what}: {caught}") from caught
    error = None
    try:
        _apply_model(model_chunks, loaded)
        if not weights_only:
            step = None if ours else _megatron_step(common)
            if buckets is not None:
                loaded.update(_bucket_optimizer_states(buckets, model_chunks, sharded, loaded,
                                                       folder))
                bucket_step = buckets.step(loaded)
                step = step if bucket_step is None else bucket_step
            _apply_optimizer(optimizer, model_chunks, sharded, loaded,
                             common[COMMON]["optimizer"] if ours else None, step)
    except Exception as caught:  # noqa: BLE001 — re-raised below, after every rank has agreed
        error = caught
    ckpt.agree(error, what)
    return common, ours, megatron_schedule


def _rng_of(folder: str):
    """Collective: this rank's saved RNG states."""
    from .dist import serialization
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = serialization.load({"rng": ShardedObject("rng_state", None, (world,), (rank,), 0)},
                                folder)
    return loaded["rng"]


def load_checkpoint(folder: str, model_chunks, optimizer, scheduler, state,
                    use_checkpoint_scheduler: bool = False) -> dict:
    """Restore the training state from the torch_dist ``folder``; returns {"iteration",
    "consumed_samples", "extra"}. A collective over the world (module docstring).
    ``use_checkpoint_scheduler`` (``--use-checkpoint-opt_param-scheduler``): the lr schedule's
    peak, floor, warm-up, decay length and style are the checkpoint's, not this run's."""
    what = f"loading checkpoint {folder}"
    common, ours, megatron_schedule = _load(folder, model_chunks, optimizer, state, False, what,
                                            scheduler)
    if not ours:
        if megatron_schedule is not None:
            scheduler.load_state_dict(megatron_schedule, with_schedule=use_checkpoint_scheduler)
        if dist.get_rank() == 0:
            restored = "the scheduler restored, the RNG starts fresh" \
                if megatron_schedule is not None else "the scheduler and RNG start fresh"
            print(f"> checkpoint {folder}: written by megatron-core; its model (and optimizer "
                  f"state where present) loaded, {restored}", flush=True)
        args = common.get("args")
        return {"iteration": int(common.get("iteration", 0) or 0),
                "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
                "extra": {}}
    saved = common[COMMON]
    scheduler.load_state_dict(saved["scheduler"], with_schedule=use_checkpoint_scheduler)
    same_layout = saved["layout"] == ckpt.layout_signature(state, optimizer)
    if same_layout and dist.get_world_size() == saved["layout"].get("world_size"):
        ckpt._set_rng_state(_rng_of(folder))
    elif dist.get_rank() == 0:
        print(f"> checkpoint {folder}: loaded from layout {saved['layout']} into "
              f"{ckpt.layout_signature(state, optimizer)}; RNG states are not restored (the "
              "freshly seeded generators are kept)", flush=True)
    return {"iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"],
            "extra": saved["extra"]}


def load_weights_only(folder: str, model_chunks, state) -> None:
    """``--finetune``: the model's weights only. Collective."""
    _load(folder, model_chunks, None, state, True,
          f"loading the weights of checkpoint {folder} (--finetune)")


def verify_folder(folder: str) -> None:
    """Check (no collective) a torch_dist folder's files against its manifest and that its
    common.pt reads; ValueError / FileNotFoundError naming the file otherwise."""
    verified_common(folder)


def megatron_lm_common(root: str) -> dict | None:
    """common.pt of the Megatron-LM checkpoint ``root`` names (its ``args``, iteration,
    scheduler ...), None for any other folder or one that does not read (its loading then says
    why); local, no collective."""
    folder = checkpoint_dir_of(root) if os.path.isdir(root) else None
    if folder is None or os.path.exists(os.path.join(folder, ckpt.MANIFEST)):
        return None
    from .dist import serialization
    try:
        common = serialization.load_common_state_dict(folder)
    except Exception:  # noqa: BLE001 — a foreign or damaged common.pt: the load reports it
        return None
    return common if megatron_lm.is_megatron_common(common) else None


def check_megatron_optimizer(root: str, common: dict) -> None:
    """Check (local, no collective) that tpfuse can map the dp_reshardable optimizer state of
    the Megatron-LM checkpoint ``root`` names (``common``: its common.pt): the ValueError of
    ``megatron_lm.BucketState``, naming the setting that wrote it, otherwise."""
    from .dist import torch_dist
    folder = checkpoint_dir_of(root)
    _bucket_state(common, torch_dist.read_metadata(folder), folder)


def read_head(folder: str) -> dict:
    """What every rank file of the per-rank format shares (``model_config``, ``extra``, ...),
    from common.pt (checked against the manifest); local, no collective."""
    common = verified_common(folder)
    head = common.get(COMMON)
    if not isinstance(head, dict):
        raise ValueError(f"checkpoint {folder} was written by megatron-core: it records no "
                         "tpfuse model config")
    return head


# ---------------------------------------------------------------------------- either format
def load_any(root: str, model_chunks, optimizer, scheduler, state,
             use_checkpoint_scheduler: bool = False) -> dict:
    """``format.load_checkpoint``, or this module's for a torch_dist checkpoint (tpfuse's or
    megatron-core's) — recognised by what ``root`` holds. Collective."""
    folder = checkpoint_dir_of(root)
    if folder is None:
        return ckpt.load_checkpoint(root, model_chunks, optimizer, scheduler, state)
    return load_checkpoint(folder, model_chunks, optimizer, scheduler, state,
                           use_checkpoint_scheduler)


def load_weights_only_any(root: str, model_chunks, state) -> None:
    """``--finetune`` of either format. Collective."""
    folder = checkpoint_dir_of(root)
    if folder is None:
        return ckpt.load_weights_only(root, model_chunks, state)
    return load_weights_only(folder, model_chunks, state)


def verify_checkpoint(root: str) -> int | None:
    """``format.verify_checkpoint`` of either format (no collective): the newest complete
    checkpoint's iteration, None without one; ValueError / FileNotFoundError naming the file."""
    folder = checkpoint_dir_of(root)
    if folder is None:
        return ckpt.verify_checkpoint(root)
    verify_folder(folder)
    return ckpt.latest_iteration(root)
