"""TransformerConfig validation (errors name the fields), derived defaults, and the CLI mapping."""
import argparse
import re

import pytest
import torch

from tpfuse.models.cli import (add_config_arguments, config_from_args, config_to_argv,
                               format_field_table, main)
from tpfuse.models.config import CATEGORIES, TransformerConfig, config_fields

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=61)


def make(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


def parse(argv):
    parser = add_config_arguments(argparse.ArgumentParser())
    return config_from_args(parser.parse_args(argv))


def test_derived_defaults_follow_megatron():
    config = make()
    assert config.ffn_hidden_size == 4 * 32
    assert config.num_query_groups == 4
    assert config.max_position_embeddings == 8
    assert config.params_dtype == torch.float32
    assert config.untie_embeddings_and_output_weights is False          # tied by default
    # Megatron: pad to a multiple of 128 * tp
    assert config.padded_vocab_size == 128
    assert make(tensor_model_parallel_size=2).padded_vocab_size == 256
    assert make(make_vocab_size_divisible_by=1, tensor_model_parallel_size=2).padded_vocab_size == 62
    # Megatron's swiglu default: int((4h * 2/3) / 64) * 64 = int(170.7 / 64) * 64 = 128 for h=64
    assert make(hidden_size=64, activation="swiglu").ffn_hidden_size == 128
    assert make(bf16=True).params_dtype == torch.bfloat16
    assert make(pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=1).virtual_pipeline_model_parallel_size == 2
    # the interleaving group size stays None, meaning pp (the executor's default, Megatron's)
    assert make(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1
                ).microbatch_group_size_per_vp_stage is None
    # one chunk per rank is the plain schedule: normalised to None
    assert make(pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2).virtual_pipeline_model_parallel_size is None


def test_sequence_parallel_without_tp_is_disabled_like_megatron():
    with pytest.warns(UserWarning, match="sequence_parallel"):
        config = make(sequence_parallel=True)
    assert config.sequence_parallel is False
    assert make(sequence_parallel=True, tensor_model_parallel_size=2).sequence_parallel is True


@pytest.mark.parametrize("overrides, named", [
    (dict(num_layers=0), "num_layers=0"),
    (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=4"),
    (dict(num_query_groups=3), "num_query_groups=3"),
    (dict(tensor_model_parallel_size=8), "num_attention_heads=4 is not divisible by "
                                         "tensor_model_parallel_size=8"),
    (dict(num_query_groups=1, tensor_model_parallel_size=2), "num_query_groups=1"),
    (dict(ffn_hidden_size=33, tensor_model_parallel_size=2), "ffn_hidden_size=33"),
    (dict(seq_length=7, tensor_model_parallel_size=2, sequence_parallel=True), "seq_length=7"),
    (dict(normalization="BatchNorm"), "normalization='BatchNorm'"),
    (dict(activation="relu"), "activation='relu'"),
    (dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
    (dict(max_position_embeddings=4), "max_position_embeddings=4"),
    (dict(hidden_dropout=1.0), "hidden_dropout=1.0"),
    (dict(init_method_std=0.0), "init_method_std=0.0"),
    (dict(num_layers=6, pipeline_model_parallel_size=4), "num_layers=6"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
     "virtual_pipeline_model_parallel_size=4"),
    (dict(virtual_pipeline_model_parallel_size=2), "pipeline_model_parallel_size > 1"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
     "num_layers_per_virtual_pipeline_stage=3"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
          virtual_pipeline_model_parallel_size=4), "disagrees"),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=1,
          microbatch_group_size_per_vp_stage=2), "microbatch_group_size_per_vp_stage=2"),
    (dict(bf16=True, fp16=True), "bf16=True and fp16=True"),
    (dict(p2p_recv_ahead=-1), "p2p_recv_ahead=-1"),
    (dict(bf16=True, params_dtype=torch.float32), "params_dtype"),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "'moe_act'"),
    (dict(recompute_granularity="selective", recompute_modules=["attn"]), "'attn'"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "recompute_num_layers=1"),
    (dict(recompute_modules=["mlp"]), "recompute_modules"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
          distribute_saved_activations=True), "tensor_model_parallel_size > 1"),
    (dict(recompute_granularity="full", recompute_num_layers=1), "recompute_method=None"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers"),
    (dict(recompute_method="block"), "recompute_granularity"),
    (dict(hidden_size=16, activation="swiglu"), "ffn_hidden_size=0"),
    (dict(vocab_size=0), "vocab_size=0"),
    (dict(context_parallel_size=2, attention_dropout=0.0, seq_length=6),
     "seq_length=6 is not divisible by 2 × context_parallel_size (2) = 4"),
    (dict(context_parallel_size=2, attention_dropout=0.0, tensor_model_parallel_size=2,
          sequence_parallel=True, seq_length=12), "seq_length=12 is not divisible by 2 × "
                                                  "context_parallel_size (2)"
                                   " × tensor_model_parallel_size (2)"),
    (dict(context_parallel_size=4, attention_dropout=0.0, seq_length=16, num_query_groups=2,
          cp_comm_type="a2a"), "query groups (kv heads) per tensor-parallel rank = 2 is not "
                               "divisible by context_parallel_size=4"),
    (dict(cp_comm_type="a2a+p2p"), "cp_comm_type='a2a+p2p'"),
    (dict(window_size=(4, 2)), "window_size=(4, 2)"),
    (dict(window_size="4,x"), "window_size='4,x'"),
])
def test_invalid_settings_raise_naming_fields(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        make(**overrides)


def test_window_and_comm_type_forms():
    """Megatron's --window-size L,R and the TE/HF meaning of the window (W = L + 1 positions)."""
    assert parse(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                  "--seq-length", "4", "--window-size", "127,0"]).attention_window == 128
    assert make(window_size=[3, 0]).window_size == (3, 0)        # a JSON list (checkpoints)
    assert make(window_size=(-1, 0)).window_size is None and make().attention_window is None
    assert make(cp_comm_type="allgather").cp_comm_type == "all_gather"   # Megatron's spelling


def test_flags_use_megatron_names_and_dash_underscore_mapping():
    config = parse(["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "8", "--vocab-size", "61", "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                    "2", "--sequence-parallel", "--swiglu", "--normalization", "RMSNorm",
                    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                    "--init-method-std", "0.01", "--hidden-dropout", "0.0", "--attention-dropout",
                    "0.0", "--max-position-embeddings", "16", "--bf16", "--norm-epsilon", "1e-6",
                    "--disable-bias-linear", "--ffn-hidden-size", "64"])
    assert (config.num_layers, config.tensor_model_parallel_size) == (8, 2)
    assert config.virtual_pipeline_model_parallel_size == 2
    assert config.sequence_parallel and config.activation == "swiglu"
    assert config.normalization == "RMSNorm" and config.position_embedding_type == "rope"
    assert config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert config.params_dtype == torch.bfloat16 and config.layernorm_epsilon == 1e-6
    assert (config.init_method_std, config.hidden_dropout, config.max_position_embeddings) == (
        0.01, 0.0, 16)
    # the field-name spelling is accepted too where Megatron's differs
    assert parse(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                  "--seq-length", "4", "--layernorm-epsilon", "1e-3"]).layernorm_epsilon == 1e-3


def test_every_field_round_trips_through_flags():
    configs = [
        make(),
        make(tensor_model_parallel_size=2, sequence_parallel=True, activation="swiglu",
             ffn_hidden_size=64, normalization="RMSNorm", add_bias_linear=False, fp16=True,
             num_query_groups=2, hidden_dropout=0.0, rotary_base=500,
             position_embedding_type="rope"),
        make(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
             decoder_last_pipeline_num_layers=1, untie_embeddings_and_output_weights=True,
             recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
             seed=7, make_vocab_size_divisible_by=8, context_parallel_size=2,
             attention_dropout=0.0, cp_comm_type="a2a", window_size=(3, 0)),
        make(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2),
    ]
    for config in configs:
        assert parse(config_to_argv(config)) == config


def test_every_field_has_category_doc_and_a_flag():
    parser = add_config_arguments(argparse.ArgumentParser())
    dests = {action.dest for action in parser._actions}
    for f in config_fields():
        assert f.metadata["category"] in CATEGORIES
        assert f.metadata["help"]
        assert f.name in dests
    table = format_field_table()
    for flag in ("--num-layers", "--tensor-model-parallel-size", "--sequence-parallel",
                 "--num-layers-per-virtual-pipeline-stage", "--swiglu", "--norm-epsilon"):
        assert flag in table


def test_missing_required_flag_and_bad_override_are_named():
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--num-layers", "2", "--hidden-size", "8"])
    with pytest.raises(ValueError, match="num_attention_heads is required"):
        config_from_args(args)
    with pytest.raises(ValueError, match="nonsense"):
        config_from_args(args, num_attention_heads=2, seq_length=4, nonsense=1)
    assert config_from_args(args, num_attention_heads=2, seq_length=4).num_attention_heads == 2


def test_cli_lists_fields_and_rejects_invalid_configs(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "[parallelism]" in out and "--pipeline-model-parallel-size" in out
    assert main(["--num-layers", "7", "--hidden-size", "8", "--num-attention-heads", "2",
                 "--seq-length", "4", "--pipeline-model-parallel-size", "2"]) == 2
    assert "num_layers=7" in capsys.readouterr().err
