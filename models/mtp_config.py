"""The multi-token prediction part of TransformerConfig: validation (``--mtp-num-layers``,
``--mtp-loss-scaling-factor``; Megatron's names and defaults: off, 0.1).

The MTP layers live on the chunk holding the output layer (the last pipeline stage); each is of
the last decoder layer's kind (``moe_config.is_moe_layer``: an MoE layer in DeepSeek-V3). Under
context parallelism the token shift crosses the cp ranks' chunks (each takes the next chunks'
first tokens from their holders: ``parallel/context_sequence.py``). What they cannot do here is
refused at config construction, before any process group exists, with a ValueError naming the
flags: learned absolute positions with pipeline parallelism (the last stage would need a
synchronised copy of the position embedding as well as of the word embedding; Megatron keeps an
unsynchronised one); rope models (DeepSeek-V3's) have no position weights.
"""
from __future__ import annotations

import math

from tpfuse.parallel.checks import is_int, is_real


def validate_multi_token_prediction(config) -> None:
    """ValueError for a bad or unsupported ``mtp_num_layers`` / ``mtp_loss_scaling_factor``."""
    factor = config.mtp_loss_scaling_factor
    if not is_real(factor) or not math.isfinite(factor) or factor < 0:
        raise ValueError(f"mtp_loss_scaling_factor={factor!r} (--mtp-loss-scaling-factor) must be "
                         "a finite number >= 0")
    layers = config.mtp_num_layers
    if layers is None:
        return
    if not is_int(layers) or layers < 1:
        raise ValueError(f"mtp_num_layers={layers!r} (--mtp-num-layers) must be a positive "
                         "integer, or None for no multi-token prediction")
    where = f"mtp_num_layers={layers} (--mtp-num-layers)"
    if config.pipeline_model_parallel_size > 1 and \
            config.position_embedding_type == "learned_absolute":
        raise ValueError(
            f"{where} with pipeline_model_parallel_size={config.pipeline_model_parallel_size} "
            "needs --position-embedding-type rope: the MTP layers on the last stage would need "
            "a copy of the learned position embedding, which is not kept in sync")
