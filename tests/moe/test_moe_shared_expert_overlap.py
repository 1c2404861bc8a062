"""--moe-shared-expert-overlap: the shared expert runs while the alltoall dispatcher's all-to-all
over ep is in flight (forward and backward), with the same results as without the overlap.

Four gloo ranks, tp 2 + SP with ep 2 (the shared expert's own TP all-gather / reduce-scatter run
while the ep exchange travels) and ep 4. Reference: the same layer (same draws) without the
overlap, on the same tokens. The output is the same sum in the same order: equal bitwise. The
input gradient adds the router's, the dispatched tokens' and the shared expert's contributions in
another order (autograd reaches the shared expert later), so it may differ by the rounding of a
3-term fp32 sum: rtol 1e-6 (8·eps), atol 1e-7 of gradients of size ~1e-2..1; every parameter's
gradient is a sum over the same terms in the same order: equal bitwise.
"""
import pytest
import torch

from tpfuse.models.config import TransformerConfig
from tpfuse.moe import MoELayer, RouterLossTracker
from tpfuse.parallel.state import ParallelState

SEQ, BATCH, HIDDEN = 8, 2, 16


def _layer(state, tp, ep, overlap):
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=32,
        seq_length=SEQ, vocab_size=64, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        expert_model_parallel_size=ep, num_moe_experts=4, moe_ffn_hidden_size=8,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
        moe_aux_loss_coeff=0.1, moe_shared_expert_overlap=overlap)
    torch.manual_seed(0)
    return MoELayer(config, 0, RouterLossTracker(), state)


def _run(layer, x, dy):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _compare(tp, ep):
    import torch.distributed as dist

    state = ParallelState.initialize(tp=tp, ep=ep)
    try:
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        x = torch.randn(SEQ // tp, BATCH, HIDDEN, generator=gen)
        dy = torch.randn(SEQ // tp, BATCH, HIDDEN, generator=gen)
        plain = _run(_layer(state, tp, ep, False), x, dy)
        overlapped_layer = _layer(state, tp, ep, True)
        assert overlapped_layer.overlap_shared_expert
        overlapped = _run(overlapped_layer, x, dy)
        assert torch.equal(overlapped[0], plain[0])
        torch.testing.assert_close(overlapped[1], plain[1], rtol=1e-6, atol=1e-7)
        for name, grad in plain[2].items():
            assert torch.equal(overlapped[2][name], grad), name
    finally:
        state.destroy()


@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 4)])
def test_overlap_gives_the_results_without_it(run_distributed, tp, ep):
    run_distributed(4, _compare, tp, ep)
