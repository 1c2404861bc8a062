"""DeepSeek-V3 routing and aux-loss-free balancing against references.

- Routing (sigmoid scores, group-limited top-k, expert bias, top-k normalisation, scaling factor):
  ``TopKRouter`` against transformers' ``DeepseekV3TopkRouter`` (the released model's gate) with
  the same tiny random weight and bias. Both compute σ, the gather, the normalisation and the
  scaling in fp32 with the same operations, so the experts chosen must be the same and the weights
  agree to a few fp32 ulps (rel 1e-6 = 8·eps(fp32)).
- The bias update: the counts of the training forwards of a step (micro-batches, one re-run by
  activation recompute that must not count, an eval forward that must not count) and the step
  ``bias += rate·sign(mean(n) − n)``, against a per-token plain-torch reference (sorting the biased
  scores) — exactly: counts are integers, the step ±rate or 0.
- Two ranks holding half the micro-batches each reach the one-process bias (the counts all-reduced
  over the stage's tp-dp-cp ranks), exactly.
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpfuse.models.config import TransformerConfig
from tpfuse.moe import RouterLossTracker, TopKRouter
from tpfuse.moe.expert_bias import update_expert_biases
from tpfuse.moe.groups import MoEGroups

HIDDEN, EXPERTS, TOPK, GROUPS, GROUP_TOPK, SCALING = 16, 8, 4, 4, 2, 2.5


def _config(**overrides):
    settings = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, seq_length=8,
                    vocab_size=64, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=GROUPS, moe_router_group_topk=GROUP_TOPK,
                    moe_router_topk_scaling_factor=SCALING, moe_router_dtype="fp32")
    return TransformerConfig(**{**settings, **overrides})


def _router(config, seed=0):
    torch.manual_seed(seed)
    return TopKRouter(config, MoEGroups(), 0, RouterLossTracker())


def _hf_gate(weight, bias, grouped=True):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=EXPERTS,
                                 num_experts_per_tok=TOPK, n_group=GROUPS if grouped else 1,
                                 topk_group=GROUP_TOPK if grouped else 1, norm_topk_prob=True,
                                 routed_scaling_factor=SCALING)
    gate = DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        gate.weight.copy_(weight)
        gate.e_score_correction_bias.copy_(bias)
    return gate


@pytest.mark.parametrize("grouped", [True, False])
def test_routing_matches_transformers_deepseek_v3_gate(grouped):
    """Selected experts and their weights equal DeepseekV3TopkRouter's, with a bias large enough
    to change choices (checked: the bias-free choice differs for some tokens)."""
    group_args = ({} if grouped else dict(moe_router_num_groups=None, moe_router_group_topk=None))
    router = _router(_config(**group_args)).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.05)
    hidden = torch.randn(6, 2, HIDDEN, generator=gen)                       # (s, b, h)
    gate = _hf_gate(router.weight.detach(), router.expert_bias, grouped)
    _, hf_weights, hf_indices = gate(hidden)
    with torch.no_grad():
        probs, routing_map = router(hidden)
    for t in range(hf_indices.shape[0]):
        chosen = sorted(hf_indices[t].tolist())
        assert routing_map[t].nonzero().flatten().tolist() == chosen, f"token {t}"
        expected = torch.zeros(EXPERTS).scatter(0, hf_indices[t], hf_weights[t])
        torch.testing.assert_close(probs[t], expected, rtol=1e-6, atol=0, msg=f"token {t}")
    with torch.no_grad():
        router.expert_bias.zero_()
        _, unbiased_map = router(hidden)
    assert (unbiased_map != routing_map).any(), "the bias must change some choice"


def _reference_counts(weight, bias, micro_batches):
    """Tokens per expert, one token at a time: σ(x·w_e) + bias_e sorted, the best k kept,
    without group limits."""
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    for hidden in micro_batches:
        for token in hidden.reshape(-1, HIDDEN).double():
            biased = torch.sigmoid(weight.double() @ token) + bias.double()
            for e in sorted(range(EXPERTS), key=lambda e: -biased[e].item())[:TOPK]:
                counts[e] += 1
    return counts


def _reference_step(bias, counts, rate):
    mean = counts.sum() / EXPERTS
    return bias + rate * torch.sign(mean - counts)


class _Chunk(nn.Module):
    """A model chunk holding routers, as update_expert_biases searches them."""

    def __init__(self, routers):
        super().__init__()
        self.routers = nn.ModuleList(routers)


NO_GROUPS = dict(moe_router_num_groups=None, moe_router_group_topk=None)


def test_bias_update_matches_a_plain_torch_reference():
    """Two steps of three micro-batches each (one through activation recompute, whose re-run in
    backward is not counted; an eval forward in between is not counted either); rate 0.01."""
    rate = 0.01
    config = _config(moe_router_bias_update_rate=rate, **NO_GROUPS)
    router = _router(config)
    chunk = _Chunk([router])
    gen = torch.Generator().manual_seed(5)
    bias = torch.zeros(EXPERTS, dtype=torch.float64)
    for _ in range(2):
        micro_batches = [torch.randn(4, 2, HIDDEN, generator=gen) for _ in range(3)]
        counts = _reference_counts(router.weight.detach(), bias, micro_batches)
        router.train()
        for i, hidden in enumerate(micro_batches):
            x = hidden.requires_grad_()
            if i == 1:
                probs, _ = checkpoint(router, x, use_reentrant=False)
            else:
                probs, _ = router(x)
            probs.sum().backward()
        router.eval()
        router(micro_batches[0])
        assert torch.equal(router.local_tokens_per_expert.double(), counts)
        update_expert_biases([chunk], config.moe_router_bias_update_rate)
        bias = _reference_step(bias, counts, rate)
        torch.testing.assert_close(router.expert_bias.double(), bias, rtol=0, atol=1e-7)
        assert not router.local_tokens_per_expert.any()     # zeroed for the next step
    assert bias.abs().max() > 0                              # it moved


def test_the_bias_is_a_persistent_fp32_buffer_not_a_parameter():
    router = _router(_config(params_dtype=torch.bfloat16, bf16=True))
    assert "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()
    assert router.expert_bias.dtype == torch.float32
    assert [name for name, _ in router.named_parameters()] == ["weight"]
    assert _router(_config(moe_router_enable_expert_bias=False)).expert_bias is None


def _two_ranks_bias(micro_batches, rate):
    import torch.distributed as dist

    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(ep=2)
    try:
        config = _config(moe_router_bias_update_rate=rate, expert_model_parallel_size=2,
                         **NO_GROUPS)
        router = _router(config).train()
        for hidden in micro_batches[dist.get_rank()::2]:
            router(hidden)
        update_expert_biases([_Chunk([router])], rate, state.group("tp-dp-cp"))
        return router.expert_bias.clone()
    finally:
        state.destroy()


def test_two_ranks_reach_the_one_process_bias(run_distributed):
    """ep 2 (the two ranks are data-parallel replicas too): each routes every other micro-batch;
    after the update both hold the bias one process computes from all of them."""
    rate = 1e-3
    gen = torch.Generator().manual_seed(9)
    micro_batches = [torch.randn(4, 2, HIDDEN, generator=gen) for _ in range(4)]
    single = _router(_config(moe_router_bias_update_rate=rate, **NO_GROUPS)).train()
    for hidden in micro_batches:
        single(hidden)
    update_expert_biases([_Chunk([single])], rate)
    for bias in run_distributed(2, _two_ranks_bias, micro_batches, rate):
        assert torch.equal(bias, single.expert_bias)
    assert single.expert_bias.abs().max() > 0
