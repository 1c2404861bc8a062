"""Activation memory of one TransformerLayer against Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", Table 2 (flash attention: no 5as/h term).

What the layer keeps for backward is counted with ``torch.autograd.graph.saved_tensors_hooks``
during one forward: every saved tensor's storage once (views of one buffer share it), parameters
excluded. The paper, per layer in bytes with 2-byte activations and 1-byte dropout masks:
34·sbh with tensor parallelism + sequence parallelism divided by t everywhere (34sbh/t), and
10·sbh + 24·sbh/t with tensor parallelism alone (layer-norm inputs and the QKV / fc1 inputs stay
replicated). Counted in activation elements and without dropout (p = 0: no masks) that is
    TP + SP   16·sbh/t                     (= (34 − 2 masks)/2)
    TP only    4·sbh + 12·sbh/t             (= (10 − 2)/2 + 24/2 / t)
with the breakdown: layer-norm inputs 2, QKV input 1, q k v 3, attention output = projection
input 1, fc1 input 1, gelu input (pre-activation) 4, fc2 input 4 — where the attention output is
one tensor for the projection GEMM and the attention backward (see ATTENTION_OUTPUT_LAYOUT_COPIES
for the one copy the layer still makes). Besides these: per layer norm the fp32 row statistics
(mean, rstd: 2·sb, divided by t with SP) and the attention's fp32 log-sum-exp (b·a·s/t). The count must equal that sum exactly (fp32 here: 4 bytes per element),
so the gathered SP input (sbh, not sbh/t) may no longer be kept for the weight gradient: the
fused backward re-gathers it in the dgrad ring.
"""

import pytest

from tpfuse.tp_layers.activation_memory import measure, paper_bytes

S, B, H, HEADS = 16, 2, 128, 8      # d = 16 (the flash path), ≥ 2 heads per rank; FFN = 4H as in the paper
# flash_attention gets q, k, v as views of the fused QKV output, (s, b, h, d)-ordered, and writes its
# [b, h, s, d] output in that order (both backends), so the projection's (s, b, h·d) input is a view
# of it: the attention backward and the projection GEMM share one tensor, as in the paper. (With
# rotary embeddings q and k are fresh [b, h, s, d] tensors and the reshape copies: sbh/t more.)
ATTENTION_OUTPUT_LAYOUT_COPIES = 0


def _measure(tp, sequence_parallel):
    return measure(tp, sequence_parallel, S, B, H, HEADS)


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_saved_activation_bytes_per_layer_follow_the_paper(tp, sequence_parallel, run_distributed):
    measured = [_measure(1, False)] if tp == 1 else run_distributed(tp, _measure, tp, sequence_parallel)
    expected = paper_bytes(S, B, H, HEADS, tp, sequence_parallel, element_size=4,
                           layout_copies=ATTENTION_OUTPUT_LAYOUT_COPIES)
    assert measured == [expected] * tp, (measured, expected)


def test_sequence_parallelism_divides_the_layer_memory_by_tp(run_distributed):
    """The headline of the paper's section 4.2.2: with SP every rank keeps 1/t of tp = 1's."""
    single = _measure(1, False)
    assert run_distributed(2, _measure, 2, True) == [single // 2] * 2 and single % 2 == 0
