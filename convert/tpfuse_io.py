"""A tpfuse checkpoint written or read whole in one process (conversion), in the checkpoint
format of ``tpfuse.checkpoint``.

``write_checkpoint(root, config, params, extra)``: ``params`` are the single-process model's
tensors (``GPTModel.global_parameter_names`` names, padded vocabulary). For every rank of the
config's tp × pp layout (dp = cp = 1, so global rank = tp_rank + tp · pp_rank) it writes
``iter_0000000/rank_RRRRR.pt`` with what ``save_checkpoint`` records about the model — the
chunk's state dict (exactly ``GPTModel.state_dict()``'s keys, persistent buffers included: pipeline stage p holds
``layers_for(config, p)`` renumbered from 0, the first the embedding, the last the final norm and
the output layer, a tied one as the embedding's tensor or, with pp > 1, its copy), the
``"reshard"`` records and ``"model_config"`` — and no optimizer, scheduler or RNG state, then the
iteration's ``manifest.json`` (each file's size and sha256, the layout, the model signature) the
trainer's loaders verify. The whole directory appears at once (``staged_directory``).

Which tensors are sharded, along which dimension and with which stride comes from the parameters
of a single-process GPTModel built on the meta device, the same attributes resharding reads.

``read_checkpoint(root)`` → (TransformerConfig, single-process tensors, extra) of any layout.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from tpfuse.checkpoint import file_io as io
from tpfuse.checkpoint import format as ckpt
from tpfuse.checkpoint import reshard
from tpfuse.checkpoint.reading import checkpoint_folder, read_checkpoint_head
from tpfuse.models.cli import config_from_dict, config_to_dict
from tpfuse.models.gpt import GPTModel
from tpfuse.models.layer_assignment import layers_for

from .hf_io import staged_directory

WORD = reshard.WORD_EMBEDDING
TIED_OUTPUT = "output_layer.weight"


def single_process_config(config):
    """``config`` at tp = pp = 1 with the same padded vocabulary (the unsharded model)."""
    return config_from_dict(
        config_to_dict(config), tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        sequence_parallel=False, make_vocab_size_divisible_by=config.padded_vocab_size)


def single_process_model(config):
    """The unsharded GPTModel on the meta device: its parameters' shapes and TP attributes."""
    with torch.device("meta"):
        return GPTModel(single_process_config(config), state=None)


def _local_name(name: str, layers: list, pre: bool, post: bool) -> str | None:
    """The name on a stage holding ``layers`` (None when the stage does not hold it)."""
    parts = name.split(".")
    if parts[0] == "layers":
        index = int(parts[1])
        return None if index not in layers else ".".join(["layers", str(layers.index(index))]
                                                         + parts[2:])
    if parts[0] == "embedding":
        return name if pre else None
    return name if post else None                      # final_norm.*, output_layer.weight


def rank_payload(config, params: dict, records: dict, tp_rank: int, pp_rank: int,
                 header: dict, extra: dict, buffers: tuple = ()) -> dict:
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    layers = layers_for(config, pp_rank)
    pre, post = pp_rank == 0, pp_rank == pp - 1
    state, local_records = {}, {}
    for name, record in records.items():
        local = _local_name(name, layers, pre, post)
        if local is not None:
            state[local] = reshard.shard_for(params[name], record["dim"], record["stride"], tp,
                                             tp_rank)
            local_records[local] = record
    if post and not config.untie_embeddings_and_output_weights:
        if pre:                                        # the very same tensor (state_dict lists it)
            state[TIED_OUTPUT] = state[WORD]
        else:                                          # the last stage's copy of the embedding
            state[TIED_OUTPUT] = reshard.shard_for(params[WORD], 0, 1, tp, tp_rank)
            local_records[TIED_OUTPUT] = {**records[WORD], "global": TIED_OUTPUT,
                                          "tied_copy": True}
    buffer_names = {}
    for name in buffers:                               # replicated: every TP rank the whole
        local = _local_name(name, layers, pre, post)
        if local is not None:
            state[local], buffer_names[local] = params[name], name
    reshard_record = {"coords": {"tp": tp_rank, "pp": pp_rank, "dp": 0, "cp": 0},
                      "params": [local_records], "optimizer_names": []}
    if buffer_names:
        reshard_record["buffers"] = [buffer_names]
    return {
        "format_version": ckpt.FORMAT_VERSION, "iteration": 0, "consumed_samples": 0,
        **header, "rank": tp_rank + tp * pp_rank, "model": [state],
        "model_config": config_to_dict(config), "extra": extra, "reshard": reshard_record,
    }


def write_checkpoint(root: str, config, params: dict, extra: dict, files: dict | None = None):
    """Every rank file of ``config``'s layout with its manifest (sizes and sha256, layout, model
    signature: what the trainer's loaders verify), plus ``files`` (name → source) at the root."""
    model = single_process_model(config)
    records = reshard.chunk_records(model, reshard.dense_sizes(1, 0))
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    header = {"layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "dp": 1, "cp": 1, "vpp": 1,
                         "distributed_optimizer": False},
              "model_signature": ckpt.model_signature([model])}
    weights_only = {"weights_only": True}        # the trainer takes it with --finetune only
    buffers = tuple(reshard.buffer_global_names(model).values())   # the expert biases
    missing = sorted((set(records) | set(buffers)) - set(params))
    if missing:
        raise ValueError(f"no tensor for parameters {missing[:3]} of the tpfuse model")
    for name, record in records.items():
        if list(params[name].shape) != record["full_shape"]:
            raise ValueError(f"tensor for {name} has shape {list(params[name].shape)}, the tpfuse "
                             f"model needs {record['full_shape']}")
    with staged_directory(root) as staging:
        folder = ckpt.iteration_dir(staging, 0)
        os.makedirs(folder)
        digests = {}
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                payload = rank_payload(config, params, records, tp_rank, pp_rank, header, extra,
                                       buffers)
                name = f"rank_{payload['rank']:05d}.pt"
                digests[name] = io.atomic_torch_save(payload, os.path.join(folder, name))
        manifest = dict(header, **weights_only, format_version=ckpt.FORMAT_VERSION, iteration=0,
                        files=digests)
        io.atomic_write_bytes(os.path.join(folder, ckpt.MANIFEST),
                              json.dumps(manifest, indent=1).encode())
        for name, source in (files or {}).items():
            shutil.copyfile(source, os.path.join(staging, name))
        io.atomic_write_bytes(os.path.join(staging, ckpt.TRACKER), b"0\n")


def read_checkpoint(root: str):
    """(TransformerConfig, {single-process name: full tensor}, extra) of a tpfuse checkpoint."""
    if os.path.exists(os.path.join(root, "config.json")) and not os.path.exists(
            os.path.join(root, ckpt.TRACKER)):
        raise ValueError(f"{root} is a HuggingFace model directory, not a tpfuse checkpoint "
                         "(use --from-hf)")
    head = read_checkpoint_head(root)
    if head.get("model_config") is None:
        raise ValueError(f"checkpoint {root} records no model config (written by an older "
                         "tpfuse): it cannot be converted")
    config = config_from_dict(head["model_config"])
    state = reshard.assemble_global_state(*checkpoint_folder(root), optimizer=False,
                                          buffers=True)
    return config, {name: entry["param"] for name, entry in state.items()}, head.get("extra") or {}
