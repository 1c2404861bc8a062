"""ParallelAttention with ``qk_layernorm`` vs a dense head-by-head computation from the same
masters (``support.dense_reference.dense_attention(..., qk_norm=...)``): every query and key
head normalised over the head dim with one shared (d,) weight each, before rotary.

gloo world of 2, tp 1 and 2, sequence parallelism on and off: RMSNorm with grouped-query
attention and rotary (head dim 16, the flash path; k normalised over the KV heads) and core
attention recompute; LayerNorm (weight and bias) with multi-head attention (head dim 4, the
explicit path). The q / k norm weights are replicated, each rank seeing only its heads: their
gradients must equal the dense ones on every rank (the TP all-reduce). Tolerance:
tests/support/tp_testing.py's fp32 one (the norm adds one reduction over d, of the softmax's
order).
"""
import torch

from support.dense_reference import B, S, check_against_dense, dense_attention
from support.tp_testing import tp_layouts
from tpfuse.tp_layers import ParallelAttention

EPS = 1e-6


def _check(module, state, sp, dense_fn, hidden, tag, position_ids=None):
    grads = check_against_dense(module, state, sp, dense_fn, hidden, tag, position_ids, seed=300)
    assert {"q_layernorm.weight", "k_layernorm.weight"} <= set(grads), sorted(grads)


def _qk_layernorm_against_dense():
    cases = 0
    positions = torch.arange(S).expand(B, S) + torch.tensor([[0], [3]])
    for tp, state in tp_layouts((1, 2)):
        for sp in (False, True):
            tag = f"tp={tp} sp={sp}"
            gqa = ParallelAttention(64, 4, num_query_groups=2, add_bias_linear=False,
                                    position_embedding_type="rope", rotary_base=100.0,
                                    sequence_parallel=sp, state=state, qk_layernorm=True,
                                    normalization="RMSNorm", layernorm_epsilon=EPS,
                                    recompute_core_attention=True)
            _check(gqa, state, sp,
                   lambda p, x: dense_attention(p, "", x, 4, 2, rope_base=100.0,
                                                positions=positions, qk_norm=("RMSNorm", EPS)),
                   64, f"GQA+rope RMSNorm {tag}", positions)
            mha = ParallelAttention(16, 4, sequence_parallel=sp, state=state, qk_layernorm=True,
                                    normalization="LayerNorm", layernorm_epsilon=EPS)
            _check(mha, state, sp,
                   lambda p, x: dense_attention(p, "", x, 4, 4, qk_norm=("LayerNorm", EPS)),
                   16, f"MHA LayerNorm {tag}")
            cases += 2
    return cases


def test_qk_layernorm_matches_dense_at_tp1_and_tp2(run_distributed):
    assert run_distributed(2, _qk_layernorm_against_dense) == [8] * 2


def test_qk_layernorm_parameters_are_head_dim_and_off_by_default():
    plain = ParallelAttention(16, 4)
    assert plain.q_layernorm is None and plain.k_layernorm is None
    assert not any("layernorm" in name for name, _ in plain.named_parameters())
    normed = ParallelAttention(32, 4, num_query_groups=2, qk_layernorm=True,
                               normalization="LayerNorm")
    shapes = {name: tuple(p.shape) for name, p in normed.named_parameters() if "layernorm" in name}
    assert shapes == {f"{n}_layernorm.{w}": (8,) for n in "qk" for w in ("weight", "bias")}
