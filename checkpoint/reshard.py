"""Loading a checkpoint into a different TP / PP / VPP / DP layout (resharding).

Why it works: every tensor-parallel weight is a slice of one layout-independent master (see
``tp_layers/init.py``), and every pipeline / virtual stage holds whole global layers. So a
parameter of the single-process model, named by ``GPTModel.global_parameter_names()``, can be
rebuilt from the old layout's shards and re-cut for the new one.

Sharding algebra (Megatron's ``partition_stride``). The partitioned dimension of size n is cut into
``tp·s`` blocks of n/(tp·s); TP rank r holds blocks r, r+tp, …, r+(s-1)·tp, concatenated::

    shard_r(W)  = cat_i  W[(r + i·tp)·n/(tp·s) : (r + i·tp + 1)·n/(tp·s)]          i = 0..s-1
    W           = cat_{i, r}  chunk_i(shard_r(W))       (i outer, r inner: the inverse)
    reshard(old shards, tp_new, r_new) = shard_{r_new}(unshard(old shards))

Replicated parameters (norm weights, row-parallel biases, learned positions) are identical on
every TP rank; TP rank 0's copy is taken. DP replicas are identical, so the weights are read from
the old ranks with dp rank 0 (and cp rank 0).

Expert parameters (MoE, ``allreduce = False``) stack their ep rank's consecutive block of experts
on dim 0 and are split over the expert-tensor-parallel group along their partition dim; they are
read from the old ranks with expert-data-parallel rank 0, keyed by (ep rank, etp rank), and re-cut
by ``sharding.py``.

Optimizer state (``training/optimizer.py``'s ``state_dict``): per model parameter, each rank saved
the flat elements ``[start, end)`` it optimizes — all of them, or with the distributed optimizer
its shard — with the Adam moments (SGD's / Muon's momentum buffer) and, for bf16/fp16, the fp32 main copy. Reading every old rank's
file and placing each piece at its offsets rebuilds the whole flattened state of every TP shard;
those must cover every element (else the checkpoint is incomplete: a ValueError). Then the moments
and main copies (parameter-shaped) are resharded exactly like the weights, and each new rank takes
the elements of its own pieces: a change of DP size (with or without the distributed optimizer)
redistributes the shards. The scalar ``step`` and the loss scaler are carried over; the group hyper-parameters (lr,
weight decay, betas, eps) stay the loading run's, as on a same-layout load. The last pipeline stage's copy of the tied
word embedding (``shared_embedding``) is rebuilt from the embedding itself: both copies always hold
the same values and the same Adam moments (their gradients are all-reduced before every step).

Padded vocabulary: ``padded_vocab_size`` is a multiple of make_vocab_size_divisible_by × tp, so it
can change with tp. The padding rows of the word embedding and output layer are zero, masked out
of the loss and never updated (see ``models/embedding.py``), so the vocabulary parameters (and their
Adam moments / main copies) are refitted: the real ``vocab_size`` rows are kept and zero rows
appended up to this run's padded size. A different real vocabulary is refused (``format.py``
compares the model configurations before any weight is touched).

Persistent buffers (the MoE routers' expert bias): replicated state outside the optimizer, saved
under their local names and listed in the metadata with their global ones (the module's prefix
mapped as its parameters' are); the lowest old rank holding a global name is read, and a buffer the
checkpoint lacks is a ValueError naming it.

Not resharded: RNG states (their streams depend on the layout: a resharded run keeps the freshly
seeded generators, and ``load_resharded`` says so on rank 0). Memory: each rank maps (mmap) every
old file, so a rank briefly holds the full tensors of the parameters it needs.
"""
from __future__ import annotations

import glob
import os

import torch

from .sharded_state import copy_into
from .sharding import (  # noqa: F401 (full_from_shards, reshard_tensor, shard_for: re-exported)
    dense_sizes, full_from_shards, full_tensor, local_part, reshard_tensor, shard_for, sizes_of)

WORD_EMBEDDING = "embedding.word_embeddings.weight"   # GPTModel's single-process name


# -------------------------------------------------------------------- save-time metadata
def _partition(param) -> tuple[int | None, int]:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    return None, 1


def chunk_records(chunk, sizes: dict) -> dict:
    """local name → {global, dim, stride, full_shape, tied_copy, expert} for one model chunk (what
    every rank file carries under "reshard"; also used to write converted checkpoints); ``sizes``
    as ``sharding.sizes_of`` / ``dense_sizes``."""
    names = chunk.global_parameter_names()
    records = {}
    for local, param in chunk.named_parameters():
        dim, stride = _partition(param)
        expert = getattr(param, "allreduce", True) is False
        full_shape = list(param.shape)
        if expert:
            full_shape[0] *= sizes["ep"]
        if dim is not None:
            full_shape[dim] *= sizes["etp" if expert else "tp"]
        records[local] = {"global": names[local], "dim": dim, "stride": stride,
                          "full_shape": full_shape, "expert": expert,
                          "tied_copy": bool(getattr(param, "shared_embedding", False))}
    return records


def save_metadata(model_chunks, optimizer, state) -> dict | None:
    """What a later load needs to reshard this rank's file; None for chunks without global names.

    ``optimizer_names[i]`` is the global name of ``optimizer.model_params[i]``."""
    if not all(hasattr(chunk, "global_parameter_names") for chunk in model_chunks):
        return None
    records = [chunk_records(chunk, sizes_of(state)) for chunk in model_chunks]
    global_by_id = {}
    for chunk, records_of_chunk in zip(model_chunks, records):
        for local, param in chunk.named_parameters():
            global_by_id[id(param)] = records_of_chunk[local]["global"]
    optimizer_names = [global_by_id[id(p)] for p in optimizer.model_params]
    coords = {"tp": state.tp_rank, "pp": state.pp_rank, "dp": state.dp_rank,
              "cp": state.rank_in("cp") or 0, "ep": state.ep_rank, "etp": state.etp_rank,
              "edp": state.edp_rank}
    metadata = {"coords": coords, "params": records, "optimizer_names": optimizer_names}
    buffers = [buffer_global_names(chunk) for chunk in model_chunks]
    if any(buffers):
        metadata["buffers"] = buffers
    return metadata


def persistent_buffers(chunk) -> dict:
    """local name → tensor of the chunk's persistent buffers (those its state_dict saves)."""
    found = {}
    for prefix, module in chunk.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def buffer_global_names(chunk) -> dict:
    """local → global name of each persistent buffer: its module's local prefix replaced by the
    global one that module's parameters have."""
    prefixes = {}
    for local, name in chunk.global_parameter_names().items():
        leaf = local.rpartition(".")[2]
        prefixes[local.rpartition(".")[0]] = name[:len(name) - len(leaf) - 1]
    names = {}
    for local in persistent_buffers(chunk):
        module, _, leaf = local.rpartition(".")
        if module in prefixes:
            names[local] = f"{prefixes[module]}.{leaf}"
    return names


# -------------------------------------------------------------------- reading the old layout
def _all_payloads(folder: str, read_payload) -> list[dict]:
    """Every old rank's file (mapped), checked for completeness and resharding metadata."""
    paths = sorted(glob.glob(os.path.join(folder, "rank_*.pt")))
    if not paths:
        raise FileNotFoundError(f"checkpoint folder {folder} holds no rank files")
    payloads = [read_payload(path, mmap=True) for path in paths]
    world = payloads[0]["layout"]["world_size"]
    if len(paths) != world:
        raise FileNotFoundError(f"checkpoint folder {folder} holds {len(paths)} rank files, "
                                f"its layout {payloads[0]['layout']} needs {world}")
    for path, payload in zip(paths, payloads):
        if payload.get("reshard") is None:
            raise ValueError(f"checkpoint file {path} carries no resharding metadata (saved from "
                             f"model chunks without global_parameter_names()); it can only be "
                             f"loaded into its own layout {payload['layout']}")
    return payloads


def _is_dp0(payload: dict) -> bool:
    return payload["reshard"]["coords"]["dp"] == 0 and payload["reshard"]["coords"]["cp"] == 0


def _holds_source(payload: dict, record: dict) -> bool:
    """Is this old rank's copy the one to read (dense: dp rank 0; expert: edp rank 0)?"""
    if record.get("expert"):
        return payload["reshard"]["coords"].get("edp", 0) == 0
    return _is_dp0(payload)


def _shard_key(record: dict, coords: dict):
    """Which shard an old rank holds: its tp rank, or (ep rank, etp rank) for an expert."""
    if record.get("expert"):
        return coords.get("ep", 0), coords.get("etp", coords["tp"])
    return coords["tp"]


def _index_old_shards(payloads: list[dict], optimizer: bool = True) -> dict:
    """global name → {"record", "weights": {key: shard}, "optim": {key: state dict}} with key a
    tp rank, or (ep rank, etp rank) for an expert parameter.

    Weights come from the dp-rank-0 files (experts: edp rank 0); optimizer pieces from every file
    (see the module docstring), assembled into parameter-shaped moments / main copies per shard."""
    index = {}
    for payload in payloads:
        meta = payload["reshard"]
        for chunk_state, records in zip(payload["model"], meta["params"]):
            for local, record in records.items():
                if record["tied_copy"] or not _holds_source(payload, record):
                    continue           # tied copy: the embedding itself is the source of truth
                entry = index.setdefault(record["global"], {"record": record, "weights": {},
                                                            "optim": {}})
                entry["weights"][_shard_key(record, meta["coords"])] = chunk_state[local]
    if not optimizer:
        return index
    flat = {}                          # (name, shard key) → {"step", key: flat tensor, "covered"}
    for payload in payloads:
        meta = payload["reshard"]
        if payload.get("optimizer") is None:
            continue                   # a weights-only checkpoint (e.g. converted)
        for position, name in enumerate(meta["optimizer_names"]):
            piece = payload["optimizer"]["params"][position]
            if name in index and piece is not None:
                key = _shard_key(index[name]["record"], meta["coords"])
                _place_piece(flat, index[name], name, key, piece)
    for (name, key), state in flat.items():
        index[name]["optim"][key] = _shaped_optimizer_state(index[name], name, state)
    return index


def _shard_shape(record: dict, tp: int) -> list:
    shape = list(record["full_shape"])
    if record["dim"] is not None:
        shape[record["dim"]] //= tp
    return shape


def _place_piece(flat: dict, entry: dict, name: str, key, piece: dict) -> None:
    """Copy one saved piece ``[start, end)`` into the flat state of (name, shard key)."""
    weight = entry["weights"].get(key, next(iter(entry["weights"].values())))
    numel = weight.numel()
    covered = torch.zeros(numel, dtype=torch.bool, device="cpu")     # assembled on the host
    state = flat.setdefault((name, key), {"step": piece.get("step"), "covered": covered})
    start, end = piece["start"], piece["end"]
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "main_param"):
        if key in piece:
            target = state.setdefault(key, torch.zeros(numel, dtype=piece[key].dtype,
                                                       device="cpu"))
            target[start:end] = piece[key]
    state["covered"][start:end] = True


def _shaped_optimizer_state(entry: dict, name: str, state: dict) -> dict:
    if not bool(state["covered"].all()):
        missing = int((~state["covered"]).sum())
        raise ValueError(f"checkpoint optimizer state of {name} misses {missing} elements (a "
                         f"rank file of the distributed optimizer's shards is absent or foreign)")
    shape = next(iter(entry["weights"].values())).shape
    shaped = {key: value.view(shape) for key, value in state.items()
              if key not in ("step", "covered")}
    return dict(shaped, step=state["step"])


VOCAB_PARAMETERS = (WORD_EMBEDDING, "output_layer.weight")


def fit_vocab_rows(full: torch.Tensor, rows: int, vocab_size: int) -> torch.Tensor:
    """``full`` with its real ``vocab_size`` rows kept and zero padding up to ``rows``."""
    real = full[:vocab_size]
    return torch.cat([real, real.new_zeros((rows - vocab_size, *real.shape[1:]))])


def assemble_global_state(folder: str, read_payload, optimizer: bool = True,
                          buffers: bool = False) -> dict:
    """{global name: {"param": full tensor, <optimizer key>: full tensor or scalar}} of a folder.

    The single-process view of any layout's checkpoint (tied copies folded into the embedding);
    ``optimizer=False``: parameters only (optimizer pieces are not read); ``buffers``: the
    persistent buffers too, each as ``{"param": value}`` under its global name.
    """
    payloads = _all_payloads(folder, read_payload)
    old_layout = payloads[0]["layout"]
    full = {}
    for name, entry in _index_old_shards(payloads, optimizer).items():
        full[name] = {"param": full_tensor(entry, entry["weights"], name, old_layout)}
        by_key = entry["optim"]
        if by_key:
            for key, value in by_key[min(by_key)].items():
                if torch.is_tensor(value) and value.ndim > 0:
                    value = full_tensor(entry, {k: s[key] for k, s in by_key.items()}, name,
                                        old_layout)
                full[name][key] = value
    if buffers:
        full.update({name: {"param": value} for name, value in _saved_buffers(payloads).items()})
    return full


# -------------------------------------------------------------------- building this rank's state
def _source_name(record: dict) -> str:
    return WORD_EMBEDDING if record["tied_copy"] else record["global"]


def _my_slice(entry: dict, tensors_by_key: dict, name: str, old_layout: dict,
              sizes: dict) -> torch.Tensor:
    """This rank's slice of a parameter (or optimizer tensor); a vocabulary parameter's padding
    is refitted to this run's (``entry["new_rows"]``, ``entry["vocab_size"]``, set by ``_plan``)."""
    record = entry["record"]
    if record["dim"] is None and not record.get("expert"):
        return tensors_by_key[min(tensors_by_key)].clone()
    full = full_tensor(entry, tensors_by_key, name, old_layout)
    if entry.get("new_rows", full.shape[0]) != full.shape[0]:
        full = fit_vocab_rows(full, entry["new_rows"], entry["vocab_size"])
    return local_part(record, full, sizes)


def _check_same_parameter(name: str, old: dict, new: dict) -> None:
    old_shape = list(old["full_shape"])
    if name in VOCAB_PARAMETERS:       # padded rows may differ; the real vocabulary may not
        old_shape[0] = new["full_shape"][0]
    if old_shape != new["full_shape"] or old["dim"] != new["dim"] \
            or old["stride"] != new["stride"]:
        raise ValueError(f"cannot reshard parameter {name}: checkpoint has full shape "
                         f"{old['full_shape']} (partition dim {old['dim']}, stride "
                         f"{old['stride']}), this model has {new['full_shape']} (partition dim "
                         f"{new['dim']}, stride {new['stride']})")


def _plan(model_chunks, index: dict, sizes: dict) -> list[tuple]:
    """[(param, source global name)] for every local parameter; raises on any mismatch. Marks
    vocabulary parameters whose padding changes with ``new_rows`` / ``vocab_size``."""
    plan = []
    for chunk in model_chunks:
        records = chunk_records(chunk, sizes)
        for local, param in chunk.named_parameters():
            name = _source_name(records[local])
            if name not in index:
                raise ValueError(f"cannot reshard: parameter {name} is not in the checkpoint")
            new = dict(records[local], tied_copy=False)
            _check_same_parameter(name, index[name]["record"], new)
            if new["full_shape"] != index[name]["record"]["full_shape"]:   # vocabulary padding
                index[name].update(new_rows=new["full_shape"][0],
                                   vocab_size=chunk.config.vocab_size)
            plan.append((param, name))
    return plan


def _load_weights(plan, index: dict, old_layout: dict, sizes: dict) -> None:
    with torch.no_grad():
        for param, name in plan:
            entry = index[name]
            copy_into(param, _my_slice(entry, entry["weights"], name, old_layout, sizes))


def _resharded_piece(piece, name: str, index: dict, old_layout: dict, sizes: dict) -> dict:
    """The saved-state entry of one new piece: this rank's TP slice of every parameter-shaped
    tensor, flattened and cut to the piece's ``[start, end)``; ``step`` carried over."""
    by_tp = index[name]["optim"]
    if not by_tp:
        raise ValueError(f"cannot reshard: the checkpoint has no optimizer state for {name}")
    first = by_tp[min(by_tp)]
    entry = {"start": piece.start, "end": piece.end, "step": first.get("step")}
    for key, value in first.items():
        if key != "step":
            full = _my_slice(index[name], {r: by_tp[r][key] for r in by_tp},
                             f"{name} ({key})", old_layout, sizes)
            entry[key] = full.reshape(-1)[piece.start:piece.end]
    return entry


def _saved_buffers(payloads: list[dict]) -> dict:
    """global name → the saved value of every persistent buffer (the lowest old rank's copy)."""
    found = {}
    for payload in sorted(payloads, key=lambda p: p["rank"]):
        names = payload["reshard"].get("buffers") or []
        for chunk_state, chunk_names in zip(payload["model"], names):
            for local, name in chunk_names.items():
                found.setdefault(name, chunk_state[local])
    return found


def _load_buffers(model_chunks, payloads: list[dict]) -> None:
    """Copy every persistent buffer of the chunks (replicated) from the checkpoint."""
    saved = None
    with torch.no_grad():
        for chunk in model_chunks:
            buffers = persistent_buffers(chunk)
            for local, name in buffer_global_names(chunk).items():
                saved = _saved_buffers(payloads) if saved is None else saved
                if name not in saved:
                    raise ValueError(f"cannot reshard: buffer {name} is not in the checkpoint")
                buffers[local].copy_(saved[name])


def _load_optimizer(optimizer, plan, payloads, index: dict, old_layout: dict,
                    sizes: dict) -> None:
    name_by_id = {id(param): name for param, name in plan}
    saved = payloads[0]["optimizer"]
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"cannot reshard the optimizer: the checkpoint has "
                         f"{len(saved['param_groups'])} parameter groups, this run has "
                         f"{len(optimizer.param_groups)}")
    for piece in optimizer.pieces:
        name = name_by_id[id(piece.model_param)]
        optimizer.load_piece(piece, _resharded_piece(piece, name, index, old_layout, sizes))
    if optimizer.grad_scaler is not None and saved.get("grad_scaler") is not None:
        optimizer.grad_scaler.load_state_dict(saved["grad_scaler"])


def load_resharded(folder: str, model_chunks, optimizer, state, new_layout: dict,
                   read_payload) -> dict:
    """Fill this rank's parameters and optimizer from a checkpoint of another layout.

    ``read_payload(path, mmap=...)`` reads and validates one rank file. Returns the old rank-0
    payload's iteration / consumed_samples / extra / scheduler (all layout-independent).
    """
    payloads = _all_payloads(folder, read_payload)
    old_layout = payloads[0]["layout"]
    index = _index_old_shards(payloads)
    sizes = sizes_of(state)
    plan = _plan(model_chunks, index, sizes)
    _load_weights(plan, index, old_layout, sizes)
    _load_buffers(model_chunks, payloads)
    _load_optimizer(optimizer, plan, payloads, index, old_layout, sizes)
    if _is_global_rank_zero():
        print(f"> checkpoint {folder}: resharded from layout {old_layout} to {new_layout}; "
              "RNG states are not restored (the freshly seeded generators are kept)", flush=True)
    return min(payloads, key=lambda p: p["rank"])


def _is_global_rank_zero() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def load_model_weights(folder: str, read_payload, model_chunks, tp: int = 1, tp_rank: int = 0,
                       sizes: dict | None = None) -> dict:
    """Fill only the chunks' parameters (TP rank ``tp_rank`` of ``tp``; experts unsplit over ep,
    split over etp = tp; or cut by ``sizes`` as ``sharding.sizes_of`` gives them, experts over
    ep and etp too) from a checkpoint folder of any layout; no optimizer state is read, none
    is needed. Local, not a collective.

    The same checks as a resharding load (missing parameter, shape). Returns
    the old rank-0 payload (its ``model_config``, ``extra``, ``layout``, ...)."""
    payloads = _all_payloads(folder, read_payload)
    old_layout = payloads[0]["layout"]
    index = _index_old_shards(payloads, optimizer=False)
    sizes = sizes or dense_sizes(tp, tp_rank)
    _load_weights(_plan(model_chunks, index, sizes), index, old_layout, sizes)
    _load_buffers(model_chunks, payloads)
    return min(payloads, key=lambda p: p["rank"])
