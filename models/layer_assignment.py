"""Which global transformer layers a model chunk (pipeline rank, virtual stage) holds. Pure.

Even split (Megatron's interleaved assignment): with L layers, pp ranks and vpp chunks per rank,
each chunk holds L_chunk = L / (pp·vpp) consecutive layers, and chunk c of rank r holds
``[(c·pp + r)·L_chunk, (c·pp + r + 1)·L_chunk)``. Model order is therefore: chunk 0 of ranks
0..pp−1, then chunk 1 of ranks 0..pp−1, and so on.

Uneven split (Megatron's ``--decoder-first/last-pipeline-num-layers``): the first and/or last stage
hold the given number of layers, the remaining layers are shared evenly by the other stages. With
vpp chunks, every stage's count is divided by vpp and each "virtual round" c (layers
``[c·L/vpp, (c+1)·L/vpp)``) is laid out over the stages in rank order with those per-chunk counts.
This is Megatron-core's offset formula for a given first stage; where only the last stage is given,
the first stage is an ordinary stage (Megatron's interleaved offset assumes a given first stage).

Every function raises ValueError naming the fields instead of dropping or duplicating a layer.
"""
from __future__ import annotations

from tpfuse.parallel.checks import is_int


def stage_layer_counts(num_layers, pp, vpp=1, first=None, last=None):
    """Layers held by each pipeline rank (all its chunks together), validated.

    Returns a list of pp integers summing to num_layers, each divisible by vpp.
    """
    for name, value in (("decoder_first_pipeline_num_layers", first),
                        ("decoder_last_pipeline_num_layers", last)):
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{name}={value!r} must be a non-negative integer")
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp} × "
                f"virtual_pipeline_model_parallel_size={vpp}; give "
                "decoder_first/last_pipeline_num_layers for an uneven split")
        return [num_layers // pp] * pp
    counts = _uneven_counts(num_layers, pp, first, last)
    for rank, count in enumerate(counts):
        if count % vpp:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers (uneven split "
                f"decoder_first_pipeline_num_layers={first}, decoder_last_pipeline_num_layers="
                f"{last}), not divisible by virtual_pipeline_model_parallel_size={vpp}")
    return counts


def _uneven_counts(num_layers, pp, first, last):
    if pp < 2:
        raise ValueError("decoder_first/last_pipeline_num_layers need "
                         f"pipeline_model_parallel_size > 1 (got {pp})")
    given = (first or 0) + (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    remaining = num_layers - given
    where = (f"num_layers={num_layers}, pipeline_model_parallel_size={pp}, "
             f"decoder_first_pipeline_num_layers={first}, decoder_last_pipeline_num_layers={last}")
    if remaining < 0:
        raise ValueError(f"the first/last stages hold more layers than num_layers ({where})")
    if middle_stages == 0 and remaining:
        raise ValueError(f"{remaining} layers are left over with no other stage ({where})")
    if middle_stages and remaining % middle_stages:
        raise ValueError(f"{remaining} remaining layers do not split evenly over "
                         f"{middle_stages} other stages ({where})")
    per_middle = remaining // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _chunk_span(config, pp_rank, vp_stage):
    """(first global layer, layer count) of chunk ``vp_stage`` of pipeline rank ``pp_rank``::

        start = c·L/vpp + Σ_{r' < r} counts[r']/vpp,     count = counts[r]/vpp
    """
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is outside pipeline_model_parallel_size={pp}")
    chunk = 0 if vp_stage is None else vp_stage
    if not 0 <= chunk < vpp:
        raise ValueError(
            f"vp_stage={vp_stage} is outside virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size}")
    counts = stage_layer_counts(config.num_layers, pp, vpp,
                                config.decoder_first_pipeline_num_layers,
                                config.decoder_last_pipeline_num_layers)
    per_chunk = [count // vpp for count in counts]        # layers of each rank in one round
    start = chunk * (config.num_layers // vpp) + sum(per_chunk[:pp_rank])
    return start, per_chunk[pp_rank]


def layer_offset(config, pp_rank, vp_stage=None):
    """Global index of the first layer of chunk ``vp_stage`` of pipeline rank ``pp_rank`` (where
    its layers would start when it holds none): Megatron's ``get_transformer_layer_offset``."""
    return _chunk_span(config, pp_rank, vp_stage)[0]


def layers_for(config, pp_rank, vp_stage=None):
    """Global layer indices held by chunk ``vp_stage`` of pipeline rank ``pp_rank``."""
    start, count = _chunk_span(config, pp_rank, vp_stage)
    return list(range(start, start + count))
