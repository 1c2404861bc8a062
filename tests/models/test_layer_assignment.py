"""layers_for: Megatron's interleaved assignment, uneven first/last splits, and loud errors."""
import itertools
import re

import pytest

from tpfuse.models.config import TransformerConfig
from tpfuse.models.layer_assignment import layers_for, stage_layer_counts


def make_config(num_layers, pp, vpp=None, first=None, last=None):
    return TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                             seq_length=4, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp,
                             decoder_first_pipeline_num_layers=first,
                             decoder_last_pipeline_num_layers=last)


def all_chunks(config):
    """(pp_rank, vp_stage) -> layers, every chunk of the model."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    return {(r, c): layers_for(config, r, c if vpp > 1 else None)
            for r in range(config.pipeline_model_parallel_size) for c in range(vpp)}


def model_order(config):
    """Layers in the order activations traverse the chunks: round c, then ranks 0..pp-1."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = all_chunks(config)
    return [layer for c in range(vpp) for r in range(config.pipeline_model_parallel_size)
            for layer in chunks[(r, c)]]


def test_even_split_matches_megatron_interleaved_formula():
    # Hand-computed: 8 layers, pp=2, vpp=2 -> L_chunk=2; chunk c of rank r holds (c*pp + r)*2 ...
    config = make_config(8, pp=2, vpp=2)
    assert layers_for(config, 0, 0) == [0, 1]
    assert layers_for(config, 1, 0) == [2, 3]
    assert layers_for(config, 0, 1) == [4, 5]
    assert layers_for(config, 1, 1) == [6, 7]
    assert layers_for(make_config(8, pp=4), 2) == [4, 5]


def test_uneven_split_first_and_last_stage_hold_fewer_layers():
    config = make_config(10, pp=4, first=1, last=3)     # middle stages share 6 -> 3 each
    assert [layers_for(config, r) for r in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    only_last = make_config(7, pp=3, last=1)            # the first two stages share 6
    assert [layers_for(only_last, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_uneven_split_with_virtual_stages_follows_rounds():
    # pp=2, vpp=2, first=2, last=6 -> per round: rank 0 holds 1, rank 1 holds 3 layers.
    config = make_config(8, pp=2, vpp=2, first=2, last=6)
    assert layers_for(config, 0, 0) == [0]
    assert layers_for(config, 1, 0) == [1, 2, 3]
    assert layers_for(config, 0, 1) == [4]
    assert layers_for(config, 1, 1) == [5, 6, 7]


CONFIGS = [
    (L, pp, vpp, first, last)
    for L, pp, vpp in itertools.product((4, 6, 8, 12, 16, 24), (1, 2, 3, 4), (None, 2, 3))
    for first, last in ((None, None), (0, None), (None, 2), (2, 2), (1, 3), (4, 0), (3, None))
]


def test_every_valid_config_partitions_the_layers_exactly():
    valid = 0
    for L, pp, vpp, first, last in CONFIGS:
        try:
            config = make_config(L, pp, vpp, first, last)
        except ValueError:
            continue
        valid += 1
        chunks = all_chunks(config)
        flat = sorted(layer for layers in chunks.values() for layer in layers)
        assert flat == list(range(L)), (L, pp, vpp, first, last)
        # the pipeline traverses the layers in order: no layer is reordered either
        assert model_order(config) == list(range(L)), (L, pp, vpp, first, last)
        counts = stage_layer_counts(L, pp, vpp or 1, first, last)
        for r in range(pp):
            assert sum(len(chunks[(r, c)]) for c in range(vpp or 1)) == counts[r]
    assert valid > 60          # the sweep exercised many layouts, not just the error paths


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_layers=7, pp=2), "num_layers=7"),
    (dict(num_layers=8, pp=2, vpp=3), "virtual_pipeline_model_parallel_size=3"),
    (dict(num_layers=9, pp=4, first=1, last=1), "do not split evenly"),
    (dict(num_layers=4, pp=2, first=3, last=3), "more layers than num_layers"),
    (dict(num_layers=8, pp=2, first=1, last=1), "left over"),
    (dict(num_layers=8, pp=2, vpp=2, first=1), "virtual_pipeline_model_parallel_size=2"),
    (dict(num_layers=8, pp=2, first=-1), "decoder_first_pipeline_num_layers=-1"),
    (dict(num_layers=8, pp=1, last=2), "pipeline_model_parallel_size > 1"),
])
def test_impossible_splits_raise_naming_fields(kwargs, named):
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=re.escape(named)):
        make_config(kwargs.pop("num_layers"), **kwargs)


def test_chunk_outside_the_layout_raises():
    config = make_config(8, pp=2, vpp=2)
    with pytest.raises(ValueError, match="pp_rank=2"):
        layers_for(config, 2, 0)
    with pytest.raises(ValueError, match="vp_stage=2"):
        layers_for(config, 0, 2)
    with pytest.raises(ValueError, match="vp_stage=1"):
        layers_for(make_config(8, pp=2), 0, 1)
