"""``tpfuse-convert --ckpt-convert-format torch_dist|tpfuse --load DIR --save OUT``: a training
checkpoint rewritten in the other format, in one process (no torch.distributed).

    tpfuse → torch_dist   every rank file read (verified) and assembled into the single-process
                          tensors (``reshard.assemble_global_state``: weights, Adam moments, fp32
                          main copies, step), stored under Megatron's keys at tp = pp = 1
    torch_dist → tpfuse   the stored tensors read whole at tp = pp = 1 and written as one rank
                          file with its resharding records, so the trainer loads it at any
                          layout through the resharding path

The model (its keys, partition dims and strides) comes from the checkpoint's recorded config,
built on the meta device (``tpfuse_io.single_process_model``: the same padded vocabulary).
Iteration, consumed samples, scheduler, loss scaler, param groups and ``extra`` carry over; RNG
states do not (their streams depend on the layout), so a converted checkpoint resumes like a
resharded one. The output appears whole (staging folder, manifest, tracker: ``format.py``).
"""
from __future__ import annotations

import os

import torch

from tpfuse.checkpoint import file_io
from tpfuse.checkpoint import format as ckpt
from tpfuse.checkpoint import reshard
from tpfuse.checkpoint import torch_dist_format as tdf
from tpfuse.checkpoint.dist import serialization, torch_dist
from tpfuse.checkpoint.dist.gpt_layout import gpt_sharded_state_dict, megatron_name
from tpfuse.checkpoint.reading import checkpoint_folder, read_checkpoint_head
from tpfuse.checkpoint.sharding import dense_sizes
from tpfuse.models.cli import config_from_dict

from .tpfuse_io import single_process_model

CONVERTED_LAYOUT = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "cp": 1, "vpp": 1, "ep": 1,
                    "etp": 1, "distributed_optimizer": False, "converted": True}


def _model(head: dict):
    if head.get("model_config") is None:
        raise ValueError("the checkpoint records no model config: it cannot be converted")
    return single_process_model(config_from_dict(head["model_config"]))


def _staging(root: str, iteration: int) -> str:
    if os.path.isdir(root) and os.listdir(root):
        raise ValueError(f"--save {root} is not empty: convert into a new or empty folder")
    return file_io.make_staging_dir(root, os.path.basename(ckpt.iteration_dir(root, iteration)))


def tpfuse_to_torch_dist(load: str, save: str) -> str:
    """The newest checkpoint of ``load`` (per-rank format) as a torch_dist one in ``save``."""
    head = read_checkpoint_head(load)
    if head.get("optimizer") is None:
        raise ValueError(f"checkpoint {load} holds model weights only; convert a training "
                         "checkpoint")
    chunk = _model(head)
    full = reshard.assemble_global_state(*checkpoint_folder(load))
    names = chunk.global_parameter_names()
    tensors = {name: full[names[name]]["param"] for name, _ in chunk.named_parameters()}
    sharded = gpt_sharded_state_dict(chunk, tensors=tensors)
    optimizer, state_names, scalars = {}, {}, {}
    for name, _ in chunk.named_parameters():
        entry, saved = sharded[megatron_name(name)], full[names[name]]
        states = {key: value for key, value in saved.items()
                  if key != "param" and torch.is_tensor(value) and value.ndim > 0}
        for key, value in states.items():
            optimizer[f"model0/{name}/{key}"] = tdf.state_entry(entry, tdf.stored_name(key),
                                                               value.float())
        state_names[names[name]] = [tdf.stored_name(key) for key in sorted(states)]
        scalars[names[name]] = {key: value for key, value in saved.items()
                                if key != "param" and key not in states}
    saved_optimizer = head["optimizer"]
    common_optimizer = {"param_groups": saved_optimizer.get("param_groups"),
                        "grad_scaler": saved_optimizer.get("grad_scaler"),
                        "format": saved_optimizer.get("format"), "state_names": state_names,
                        "scalars": scalars}
    layout = dict(head["layout"], converted=True)
    tree = {"model0": sharded, "optimizer": optimizer,
            tdf.COMMON: {"format_version": ckpt.FORMAT_VERSION, "iteration": head["iteration"],
                         "consumed_samples": head["consumed_samples"], "layout": layout,
                         "model_signature": head["model_signature"],
                         "model_config": head["model_config"], "scheduler": head["scheduler"],
                         "extra": head.get("extra") or {}, "optimizer": common_optimizer},
            "iteration": head["iteration"], "checkpoint_version": tdf.CHECKPOINT_VERSION}
    staging = _staging(save, head["iteration"])
    serialization.save(tree, staging)
    header = {"ckpt_format": tdf.FORMAT, "layout": layout,
              "model_signature": head["model_signature"]}
    return ckpt.publish_folder(save, head["iteration"], staging,
                               lambda: tdf.folder_digests(staging), header)


def torch_dist_to_tpfuse(load: str, save: str) -> str:
    """The torch_dist checkpoint of ``load`` (tpfuse's) as a per-rank one in ``save``."""
    folder = tdf.checkpoint_dir_of(load)
    if folder is None:
        raise ValueError(f"--load {load} holds no torch_dist checkpoint")
    head = tdf.read_head(folder)
    chunk = _model(head)
    templates = {name: torch.empty(tuple(t.shape), dtype=t.dtype)
                 for name, t in chunk.state_dict(keep_vars=True).items()}
    sharded = gpt_sharded_state_dict(chunk, tensors=templates)
    names = chunk.global_parameter_names()
    state_names = head["optimizer"]["state_names"]
    requests = {}
    for name, param in chunk.named_parameters():
        entry = sharded[megatron_name(name)]
        requests[f"model/{name}"] = entry
        template = torch.empty(tuple(param.shape), dtype=torch.float32)
        for key in state_names.get(names[name], []):
            requests[f"state/{name}/{key}"] = tdf.state_entry(entry, key, template)
    metadata = torch_dist.read_metadata(folder)
    requests = tdf.check_shapes(requests, metadata, folder, None, (1, 0))
    loaded = tdf.load_requests(requests, folder)
    model_state, entries, optimizer_names = {}, [], []
    for name, param in chunk.named_parameters():
        model_state[name] = loaded[f"model/{name}"]
        piece = {"start": 0, "end": param.numel()}
        piece.update(head["optimizer"]["scalars"].get(names[name], {}))
        for key in state_names.get(names[name], []):
            piece[tdf.optimizer_name(key)] = loaded[f"state/{name}/{key}"].reshape(-1)
        entries.append(piece)
        optimizer_names.append(names[name])
    saved_optimizer = head["optimizer"]
    records = [reshard.chunk_records(chunk, dense_sizes(1, 0))]
    coords = {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "etp": 0, "edp": 0}
    payload = {"format_version": ckpt.FORMAT_VERSION, "iteration": head["iteration"],
               "consumed_samples": head["consumed_samples"], "layout": CONVERTED_LAYOUT,
               "model_signature": head["model_signature"], "rank": 0, "model": [model_state],
               "model_config": head["model_config"],
               "optimizer": {"format": saved_optimizer.get("format"), "params": entries,
                             "param_groups": saved_optimizer.get("param_groups"),
                             "grad_scaler": saved_optimizer.get("grad_scaler")},
               "scheduler": head["scheduler"], "rng": {}, "extra": head.get("extra") or {},
               "reshard": {"coords": coords, "params": records,
                           "optimizer_names": optimizer_names}}
    staging = _staging(save, head["iteration"])
    digest = ckpt.write_rank_file(staging, payload)
    header = {"layout": CONVERTED_LAYOUT, "model_signature": head["model_signature"]}
    return ckpt.publish_folder(save, head["iteration"], staging,
                               lambda: {"rank_00000.pt": digest}, header)
