"""MLA's model flags: Megatron-LM's names and defaults, round trip through the CLI, and one
ValueError naming every flag MLA cannot be combined with (at config construction)."""
import argparse

import pytest

from tpfuse.models.cli import add_config_arguments, config_from_args, config_to_argv
from tpfuse.models.config import TransformerConfig
from tpfuse.models.mla_config import mla_rotary

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=61)
MLA_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
             "--seq-length", "8", "--multi-latent-attention", "--q-lora-rank", "8",
             "--kv-lora-rank", "12", "--qk-head-dim", "4", "--qk-pos-emb-head-dim", "2",
             "--v-head-dim", "6", "--rope-type", "yarn", "--rotary-scaling-factor", "40",
             "--mscale", "0.707", "--mscale-all-dim", "0.707", "--recompute-activations",
             "--recompute-modules", "mla_up_proj", "core_attn"]


def parse(argv):
    return config_from_args(add_config_arguments(argparse.ArgumentParser()).parse_args(argv))


def test_megatron_lm_defaults():
    """Megatron-LM's _add_mla_args defaults (its --kv-lora-rank flag defaults to 32, while
    MLATransformerConfig's field says 512; the flag is what a Megatron-LM run gets)."""
    config = TransformerConfig(**BASE)
    assert not config.multi_latent_attention and config.q_lora_rank is None
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (32, 128, 64, 128)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim) == (None, 1.0, 1.0, 0.0)
    assert (config.original_max_position_embeddings, config.beta_fast,
            config.beta_slow) == (4096, 32.0, 1.0)
    assert mla_rotary(TransformerConfig(**BASE, multi_latent_attention=True)).rope_type == "yarn"


def test_flags_parse_and_round_trip():
    config = parse(MLA_FLAGS)
    assert config.multi_latent_attention and config.q_lora_rank == 8
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (12, 4, 2, 6)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim) == ("yarn", 40.0, 0.707, 0.707)
    assert config.recompute_modules == ["mla_up_proj", "core_attn"]
    assert parse(config_to_argv(config)) == config


def test_unsupported_combinations_are_named_in_one_error():
    with pytest.raises(ValueError) as error:
        TransformerConfig(**BASE, multi_latent_attention=True, num_query_groups=2,
                          add_qkv_bias=True, use_rope_scaling=True,
                          position_embedding_type="rope")
    message = str(error.value)
    assert message.startswith("--multi-latent-attention cannot be combined with")
    for flag in ("--num-query-groups 2", "--add-qkv-bias", "--use-rope-scaling"):
        assert flag in message


@pytest.mark.parametrize("overrides, fragment", [
    (dict(rope_type="yarn"), "needs --multi-latent-attention"),
    (dict(rope_type="ntk"), "rope_type='ntk' must be one of"),
    (dict(multi_latent_attention=True, qk_pos_emb_head_dim=3), "qk_pos_emb_head_dim=3 must be even"),
    (dict(multi_latent_attention=True, kv_lora_rank=0), "kv_lora_rank"),
    (dict(multi_latent_attention=True, q_lora_rank=0), "q_lora_rank"),
    (dict(multi_latent_attention=True, rotary_scaling_factor=0.0), "rotary_scaling_factor"),
    (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
     "which this model does not have"),
])
def test_bad_values_are_named(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        TransformerConfig(**BASE, **overrides)
