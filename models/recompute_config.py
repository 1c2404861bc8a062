"""The activation-recompute part of TransformerConfig: choices and validation (Megatron's rules)."""
from __future__ import annotations

from tpfuse.parallel.checks import require_choice
from tpfuse.tp_layers.checkpointing import RECOMPUTE_MODULES   # what the layers implement

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
MEGATRON_ONLY_RECOMPUTE_MODULES = ("moe_act", "mla_up_proj", "moe", "shared_experts")


def validate_recompute(config) -> None:
    """Megatron's rules (transformer_config / arguments): full needs a method and a layer
    count; selective takes modules (default core_attn) and no layer count;
    distribute_saved_activations needs full recompute, tp > 1 and no sequence parallelism."""
    granularity = config.recompute_granularity
    if granularity is None:
        for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            if getattr(config, name) is not None:
                raise ValueError(f"{name}={getattr(config, name)} needs "
                                 "recompute_granularity='full' or 'selective'")
    else:
        require_choice(config, "recompute_granularity", RECOMPUTE_GRANULARITIES)
    if granularity == "full":
        require_choice(config, "recompute_method", RECOMPUTE_METHODS)
        if config.recompute_num_layers is None:
            raise ValueError("recompute_granularity='full' needs recompute_num_layers")
        if config.recompute_modules is not None:
            raise ValueError(f"recompute_modules={config.recompute_modules} applies to "
                             "recompute_granularity='selective', not 'full'")
    if granularity == "selective":
        _validate_selective(config)
    _validate_distributed(config)


def _validate_selective(config):
    for name in ("recompute_method", "recompute_num_layers"):
        if getattr(config, name) is not None:
            raise ValueError(f"{name}={getattr(config, name)} must be None with "
                             "recompute_granularity='selective' (it applies to 'full')")
    for module in config.recompute_modules:
        if module == "mla_up_proj" and getattr(config, "multi_latent_attention", False):
            continue                          # the MLA layer's up projections (tp_layers/mla.py)
        if module in MEGATRON_ONLY_RECOMPUTE_MODULES:
            raise ValueError(f"recompute_modules: {module!r} recomputes MoE / MLA parts, "
                             f"which this model does not have; use {RECOMPUTE_MODULES}")
        if module not in RECOMPUTE_MODULES:
            raise ValueError(f"recompute_modules: {module!r} must be one of "
                             f"{list(RECOMPUTE_MODULES)}")


def _validate_distributed(config):
    if not config.distribute_saved_activations:
        return
    if config.tensor_model_parallel_size <= 1:
        raise ValueError("distribute_saved_activations needs tensor_model_parallel_size > 1 "
                         "(the activations are split across the TP group)")
    if config.recompute_granularity != "full":
        raise ValueError("distribute_saved_activations needs recompute_granularity='full', "
                         f"got {config.recompute_granularity!r}")
    if config.sequence_parallel:
        raise ValueError("distribute_saved_activations must be False with "
                         "sequence_parallel=True (the input is already split over TP)")
