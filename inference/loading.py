"""Loading a model from a checkpoint without any training state.

``load_model(checkpoint_dir, state=None)`` → this rank's GPTModel chunks, in eval mode, for the
layout of ``state`` (default: the default ParallelState; a plain process without
torch.distributed is tp = pp = 1), whatever layout wrote the checkpoint:

    rank 0's file ─"model_config"→ TransformerConfig with this run's tp / pp / vpp and the
        inference settings below
    build_model on the meta device (no random init drawn) → to_empty(device)
    checkpoint/reshard.py: every parameter re-cut from the old layout's shards (optimizer state,
        scheduler and RNG are never read)

Inference settings: sequence parallelism off unless ``sequence_parallel=True`` at tp > 1 (then
the model splits a step's sequence over TP as in training, and ``generate`` runs the steps TP
cannot split — a decode step's single token — with SP off: ``sequence_parallel.py``), dropout
0, no recompute, no context parallelism, layers split evenly over the pipeline stages.
Experts: the checkpoint's experts (saved at any ep / etp) are re-cut for this run's ep and etp
(default ep = 1: every expert on every rank of the TP group, split over etp = tp).

MoE under TP without sequence parallelism (inference only): training requires SP with MoE at
tp > 1 (Megatron-core's rule: each TP rank routes and back-propagates its own s/tp tokens). In
inference every TP rank holds the same (s, b, h) tokens; both dispatchers stay exact on such
replicated tokens — the all-gather dispatcher gathers the tp copies over etp × ep, every rank
computes its experts' (etp-partial) rows for all of them, and the reduce-scatter sums the etp
partials of each copy and returns each rank its own copy; the all-to-all dispatcher likewise
exchanges and sums per copy. No loss or gradient is formed (eval mode, no_grad), so nothing is
counted tp times. ``inference_config`` therefore validates such a config with SP on (the
training rule) and then turns it off. The padded vocabulary stays the checkpoint's where tp divides it
(``make_vocab_size_divisible_by`` becomes padded / tp); otherwise the zero padding rows are refitted
to this tp's padding, as the trainer's resharding does (generation never produces padded ids).
Local: no collective, so any subset of ranks may load.
"""
from __future__ import annotations

import os

import torch

from tpfuse.checkpoint import reshard
from tpfuse.checkpoint.sharding import dense_sizes, sizes_of
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


def config_without_sequence_parallel(values: dict, **overrides):
    """``config_from_dict(values, **overrides)`` with sequence parallelism off, also for an MoE
    model at tp > 1 (validated with SP on, the training rule, then SP off: see the module
    docstring for why inference on replicated tokens is exact)."""
    overrides = dict(overrides, sequence_parallel=False)
    tp = overrides.get("tensor_model_parallel_size", values.get("tensor_model_parallel_size", 1))
    experts = overrides.get("num_moe_experts", values.get("num_moe_experts"))
    if experts is None or tp == 1:
        return config_from_dict(values, **overrides)
    config = config_from_dict(values, **dict(overrides, sequence_parallel=True))
    config.sequence_parallel = False
    return config


def inference_config(saved: dict, tp: int = 1, pp: int = 1, vpp: int | None = None,
                     params_dtype: torch.dtype | None = None, ep: int = 1,
                     etp: int | None = None, sequence_parallel: bool = False):
    """The checkpoint's TransformerConfig re-targeted to (tp, pp, vpp, ep, etp) for inference
    (``sequence_parallel``: kept on at tp > 1; at tp = 1 there is nothing to split)."""
    padded = config_from_dict(saved).padded_vocab_size
    divisible = padded // tp if padded % tp == 0 else saved["make_vocab_size_divisible_by"]
    overrides = dict(INFERENCE_SETTINGS, tensor_model_parallel_size=tp,
                     pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                     make_vocab_size_divisible_by=divisible)
    if saved.get("num_moe_experts") is not None:
        overrides.update(expert_model_parallel_size=ep,
                         expert_tensor_parallel_size=None if etp == tp else etp)
    if params_dtype is not None:
        overrides.update(params_dtype=params_dtype, bf16=False, fp16=False)
        if params_dtype in PRECISION_FLAGS:
            overrides[PRECISION_FLAGS[params_dtype]] = True
    if sequence_parallel and tp > 1:
        return config_from_dict(saved, **dict(overrides, sequence_parallel=True))
    return config_without_sequence_parallel(saved, **overrides)


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
               device=None, sequence_parallel: bool = False) -> list:
    """This rank's model chunks (one per virtual stage) with the checkpoint's weights
    (``sequence_parallel=True``: built with SP at tp > 1, see the module docstring)."""
    state = resolve_state(state)
    head = read_checkpoint_head(checkpoint_dir)
    saved = head.get("model_config")
    if saved is None:
        raise ValueError(f"checkpoint {checkpoint_dir} records no model config (written by an "
                         "older tpfuse); it can only be loaded by the trainer with its flags")
    sizes = sizes_of(state) if state is not None else dense_sizes(1, 0)
    config = inference_config(saved, sizes["tp"], state.pp_size if state is not None else 1,
                              state.vpp_size if state is not None else None, params_dtype,
                              ep=sizes["ep"], etp=sizes["etp"],
                              sequence_parallel=sequence_parallel)
    with torch.device("meta"):                      # shapes only: every value comes from disk
        chunks = build_model(make_gpt_model_provider(config), config, state)
    chunks = [materialize(chunk, device or _default_device()) for chunk in chunks]
    reshard.load_model_weights(*checkpoint_folder(checkpoint_dir), chunks, sizes=sizes)
    for chunk in chunks:
        chunk.eval()
    return chunks
