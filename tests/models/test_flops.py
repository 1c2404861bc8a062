"""tpfuse.models.flops: the dimension form of the FLOP count against the formula written out, the
config form against the dimension form, and utilisation's arithmetic."""
import pytest

from tpfuse.models import TransformerConfig
from tpfuse.models.flops import (dense_gpt_forward_flops_per_token, flops_per_iteration,
                                 forward_flops_per_token, utilisation)


def test_dense_formula_written_out():
    h, layers, s, f, kv, vocab = 64, 3, 32, 160, 32, 128
    per_layer = 2 * h * (h + 2 * kv) + 4 * s * h + 2 * h * h + 2 * h * f * 3
    assert dense_gpt_forward_flops_per_token(
        hidden_size=h, num_layers=layers, seq_length=s, ffn_hidden_size=f, kv_width=kv,
        vocab_size=vocab, swiglu=True) == layers * per_layer + 2 * h * vocab


@pytest.mark.parametrize("recompute", [None, "full"])
def test_config_form_matches_dimensions(recompute):
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, seq_length=32, max_position_embeddings=32,
                               vocab_size=100, make_vocab_size_divisible_by=64,
                               activation="swiglu", recompute_granularity=recompute,
                               recompute_method="uniform" if recompute else None,
                               recompute_num_layers=1 if recompute else None)
    per_token = dense_gpt_forward_flops_per_token(
        hidden_size=64, num_layers=2, seq_length=32, ffn_hidden_size=config.ffn_hidden_size,
        kv_width=2 * 16, vocab_size=128, swiglu=True)
    assert forward_flops_per_token(config) == per_token
    assert flops_per_iteration(config, 3) == (4 if recompute else 3) * 3 * 32 * per_token


def test_utilisation():
    assert utilisation(4e12, 2.0, 2) == {"tflops_per_rank": 1.0}
    assert utilisation(4e12, 2.0, 2, peak_tflops=4.0) == {"tflops_per_rank": 1.0, "mfu": 0.25}
