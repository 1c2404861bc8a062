"""Loading a model from a checkpoint without any training state.

``load_model(checkpoint_dir, state=None)`` → this rank's GPTModel chunks, in eval mode, for the
layout of ``state`` (default: the default ParallelState; a plain process without
torch.distributed is tp = pp = 1), whatever layout wrote the checkpoint:

    rank 0's file ─"model_config"→ TransformerConfig with this run's tp / pp / vpp and the
        inference settings below
    build_model on the meta device (no random init drawn) → to_empty(device)
    checkpoint/reshard.py: every parameter re-cut from the old layout's shards (optimizer state,
        scheduler and RNG are never read)

Inference settings: sequence parallelism off (a decode step holds one token per sequence, which
cannot be split over TP), dropout 0, no recompute, no context parallelism, layers split evenly
over the pipeline stages. The padded vocabulary stays the checkpoint's where tp divides it
(``make_vocab_size_divisible_by`` becomes padded / tp); otherwise the zero padding rows are refitted
to this tp's padding, as the trainer's resharding does (generation never produces padded ids).
Local: no collective, so any subset of ranks may load.
"""
from __future__ import annotations

import os

import torch

from tpfuse.checkpoint import reshard
from tpfuse.checkpoint.reading import (  # noqa: F401 (load_tokenizer: tpfuse.inference's export)
    checkpoint_folder, load_tokenizer, read_checkpoint_head)
from tpfuse.models.build import build_model, make_gpt_model_provider
from tpfuse.models.cli import config_from_dict
from tpfuse.models.gpt import resolve_state

INFERENCE_SETTINGS = {
    "sequence_parallel": False, "context_parallel_size": 1, "hidden_dropout": 0.0,
    "attention_dropout": 0.0, "recompute_granularity": None, "recompute_method": None,
    "recompute_num_layers": None, "num_layers_per_virtual_pipeline_stage": None,
    "microbatch_group_size_per_vp_stage": None, "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
}
PRECISION_FLAGS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def inference_config(saved: dict, tp: int = 1, pp: int = 1, vpp: int | None = None,
                     params_dtype: torch.dtype | None = None):
    """The checkpoint's TransformerConfig re-targeted to (tp, pp, vpp) for inference."""
    padded = config_from_dict(saved).padded_vocab_size
    divisible = padded // tp if padded % tp == 0 else saved["make_vocab_size_divisible_by"]
    overrides = dict(INFERENCE_SETTINGS, tensor_model_parallel_size=tp,
                     pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                     make_vocab_size_divisible_by=divisible)
    if params_dtype is not None:
        overrides.update(params_dtype=params_dtype, bf16=False, fp16=False)
        if params_dtype in PRECISION_FLAGS:
            overrides[PRECISION_FLAGS[params_dtype]] = True
    return config_from_dict(saved, **overrides)


def _default_device() -> torch.device:
    """The ranks' device (the backend's: gloo keeps the model on the CPU even where CUDA exists,
    as its send/recv take CPU tensors only); without torch.distributed, CUDA when present."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from tpfuse.parallel.devices import collective_device

        return collective_device()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(chunk, device):
    """Real (uninitialised) storage for a meta-built chunk.

    ``to_empty`` makes a new Parameter per module: the tied output layer is re-tied and the
    parameters' Megatron attributes (``tensor_model_parallel``, ``partition_dim``, ...) that
    resharding reads are carried over."""
    attributes = {name: dict(vars(param)) for name, param in chunk.named_parameters()}
    chunk.to_empty(device=device)
    if chunk.pre_process and chunk.post_process and chunk.share_embeddings_and_output_weights:
        chunk.output_layer.weight = chunk.embedding.word_embeddings.weight
    for name, param in chunk.named_parameters():
        vars(param).update(attributes[name])
    return chunk


def load_model(checkpoint_dir: str, state=None, *, params_dtype: torch.dtype | None = None,
               device=None) -> list:
    """This rank's model chunks (one per virtual stage) with the checkpoint's weights."""
    state = resolve_state(state)
    head = read_checkpoint_head(checkpoint_dir)
    saved = head.get("model_config")
    if saved is None:
        raise ValueError(f"checkpoint {checkpoint_dir} records no model config (written by an "
                         "older tpfuse); it can only be loaded by the trainer with its flags")
    tp, tp_rank = (state.tp_size, state.tp_rank) if state is not None else (1, 0)
    config = inference_config(saved, tp, state.pp_size if state is not None else 1,
                              state.vpp_size if state is not None else None, params_dtype)
    with torch.device("meta"):                      # shapes only: every value comes from disk
        chunks = build_model(make_gpt_model_provider(config), config, state)
    chunks = [materialize(chunk, device or _default_device()) for chunk in chunks]
    reshard.load_model_weights(*checkpoint_folder(checkpoint_dir), chunks, tp, tp_rank)
    for chunk in chunks:
        chunk.eval()
    return chunks
