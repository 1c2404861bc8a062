"""ParallelAttention and ParallelMLP vs dense torch computations from the same master weights.

gloo world of 4, TP size looping over 1, 2, 4 inside the job, sequence parallelism on and off.
Multi-head attention with biases (head dim 4: the explicit-softmax path), grouped-query attention
with rotary embeddings (head dim 16: the flash_attention path; explicit, shifted position ids),
gelu MLP and SwiGLU MLP. Outputs, input grads and every parameter grad
(reassembled from the shards) are compared on every rank; tolerance: tests/support/tp_testing.py
(attention adds a softmax, whose fp32 rounding is of the same order).
"""
import torch

from support.dense_reference import B, S, check_against_dense, dense_attention, dense_mlp
from support.tp_testing import expect_value_error, tp_layouts, tp_state
from tpfuse.tp_layers import ParallelAttention, ParallelMLP


def _attention_and_mlp_against_dense():
    cases = 0
    positions = torch.arange(S).expand(B, S) + torch.tensor([[0], [5]])  # per-sequence offsets
    for tp, state in tp_layouts():
        for sp in (False, True):
            tag = f"tp={tp} sp={sp}"
            mha = ParallelAttention(16, 4, sequence_parallel=sp, state=state)
            check_against_dense(mha, state, sp, lambda p, x: dense_attention(p, "", x, 4, 4), 16,
                   f"MHA {tag}")
            gqa = ParallelAttention(128, 8, num_query_groups=4, add_bias_linear=False,
                                    position_embedding_type="rope", rotary_base=100.0,
                                    sequence_parallel=sp, state=state)
            check_against_dense(gqa, state, sp,
                   lambda p, x: dense_attention(p, "", x, 8, 4, rope_base=100.0,
                                                positions=positions),
                   128, f"GQA+rope {tag}", position_ids=positions)
            for activation, ffn in (("gelu", 32), ("swiglu", 24)):
                mlp = ParallelMLP(16, ffn, activation=activation, sequence_parallel=sp, state=state)
                check_against_dense(mlp, state, sp, lambda p, x, a=activation: dense_mlp(p, "", x, a), 16,
                       f"MLP {activation} {tag}")
            cases += 4
    return cases


def test_attention_and_mlp_match_dense(run_distributed):
    assert run_distributed(4, _attention_and_mlp_against_dense) == [24] * 4


def _bad_settings():
    with tp_state(4) as state:
        expect_value_error(lambda: ParallelAttention(18, 4, state=state), "hidden_size=18",
                           "num_attention_heads=4")
        expect_value_error(lambda: ParallelAttention(12, 6, state=state),
                           "num_attention_heads=6", "tp=4")
        expect_value_error(lambda: ParallelAttention(16, 8, num_query_groups=2, state=state),
                           "num_query_groups=2", "tp=4")
        expect_value_error(lambda: ParallelAttention(16, 8, num_query_groups=3, state=state),
                           "num_attention_heads=8", "num_query_groups=3")
        expect_value_error(lambda: ParallelAttention(12, 4, position_embedding_type="rope",
                                                     state=state), "even head dim")
        expect_value_error(lambda: ParallelAttention(16, 4, position_embedding_type="alibi",
                                                     state=state), "alibi")
        expect_value_error(lambda: ParallelMLP(16, 10, state=state), "ffn_hidden_size=10", "tp=4")
        expect_value_error(lambda: ParallelMLP(16, 8, activation="relu2", state=state), "relu2")
        attention = ParallelAttention(16, 4, sequence_parallel=True, state=state)
        # position ids for the wrong length are rejected before the QKV all-gather
        expect_value_error(lambda: attention(torch.randn(2, B, 16), torch.zeros(B, 7)),
                           "position_ids shape")
    return True


def test_bad_settings(run_distributed):
    assert run_distributed(4, _bad_settings) == [True] * 4
