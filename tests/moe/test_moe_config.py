"""The MoE settings: validation errors naming the values (at config construction, before any
process group exists), Megatron's flag names and defaults, the layer pattern, the world-size check
of the trainer, the GPT model's choice of MoE layers and its generation with the KV cache."""
import argparse
import re
import types

import pytest
import torch

from tpfuse.models.cli import add_config_arguments, config_from_args, config_to_argv
from tpfuse.models.config import TransformerConfig
from tpfuse.models.moe_config import moe_layer_pattern, parse_moe_layer_freq

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=61,
            num_moe_experts=4)


def make(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


def parse(argv):
    return config_from_args(add_config_arguments(argparse.ArgumentParser()).parse_args(argv))


def test_defaults_follow_megatron():
    config = make()
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size == 128
    assert (config.moe_router_topk, config.moe_router_load_balancing_type,
            config.moe_token_dispatcher_type, config.moe_aux_loss_coeff) == (
        2, "aux_loss", "allgather", 0.0)
    assert config.moe_expert_capacity_factor is None and not config.moe_grouped_gemm
    assert moe_layer_pattern(make(moe_layer_freq=2)) == (True, False, True, False)
    assert moe_layer_pattern(make(num_moe_experts=None)) == (False,) * 4


@pytest.mark.parametrize("overrides, named", [
    (dict(num_moe_experts=6, expert_model_parallel_size=4),
     "num_moe_experts=6 is not divisible by expert_model_parallel_size=4"),
    (dict(moe_router_topk=5), "moe_router_topk=5 exceeds num_moe_experts=4"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor=0.0 must be > 0"),
    (dict(moe_expert_capacity_factor=-1.5), "moe_expert_capacity_factor=-1.5"),
    (dict(num_moe_experts=None, expert_model_parallel_size=2),
     "expert_model_parallel_size=2 needs num_moe_experts"),
    (dict(tensor_model_parallel_size=2), "needs sequence_parallel=True"),
    (dict(moe_ffn_hidden_size=30, expert_tensor_parallel_size=4),
     "moe_ffn_hidden_size=30 is not divisible by expert_tensor_parallel_size=4"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
    (dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0),
     "moe_token_dispatcher_type='alltoall'"),
    (dict(moe_router_score_function="relu"), "moe_router_score_function='relu'"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex'"),
    (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff=-0.1"),
    (dict(moe_router_num_groups=2), "must be set together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "not divisible by "
                                                              "moe_router_num_groups=3"),
    (dict(moe_layer_freq=[1, 0]), "one 0/1 per layer (num_layers=4)"),
    (dict(moe_layer_freq=0), "moe_layer_freq=0"),
    (dict(moe_shared_expert_intermediate_size=15, tensor_model_parallel_size=2,
          sequence_parallel=True), "moe_shared_expert_intermediate_size=15"),
    (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate=True needs "
                                        "moe_shared_expert_intermediate_size"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias=True "
                                               "(--moe-router-enable-expert-bias): expert bias "
                                               "for aux-loss-free routing only supports the "
                                               "sigmoid score function"),
    (dict(moe_router_bias_update_rate=-1e-3), "moe_router_bias_update_rate=-0.001 must be"),
    (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
     "moe_shared_expert_overlap=True (--moe-shared-expert-overlap) only works with the alltoall "
     "token dispatcher"),
])
def test_invalid_moe_settings_raise_naming_the_values(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        make(**overrides)


def test_megatron_flags_and_round_trip():
    config = parse(["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "8", "--vocab-size", "61", "--num-experts", "8",
                    "--moe-router-topk", "1", "--moe-layer-freq", "([0]+[1]*3)*2",
                    "--moe-router-pre-softmax", "--moe-aux-loss-coeff", "0.01",
                    "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.25",
                    "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type",
                    "alltoall", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size",
                    "64", "--moe-shared-expert-gate", "--expert-model-parallel-size", "2",
                    "--moe-ffn-hidden-size", "48"])
    assert config.num_moe_experts == 8 and config.moe_router_topk == 1
    assert config.moe_layer_freq == [0, 1, 1, 1, 0, 1, 1, 1]
    assert config.moe_router_pre_softmax and config.moe_grouped_gemm
    assert config.moe_pad_expert_input_to_capacity and config.moe_expert_capacity_factor == 1.25
    assert (config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size) == (48, 64)
    assert config.moe_shared_expert_gate
    assert parse(config_to_argv(config)) == config


def test_deepseek_v3_flags_defaults_and_round_trip():
    """Megatron's defaults (no bias, rate 1e-3, no overlap) and flags; DeepSeek's first-k-dense
    layer pattern as Megatron writes it."""
    config = make()
    assert (config.moe_router_enable_expert_bias, config.moe_router_bias_update_rate,
            config.moe_shared_expert_overlap) == (False, 1e-3, False)
    config = parse(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "8", "--vocab-size", "61", "--num-experts", "8",
                    "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-score-function",
                    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                    "0.01", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                    "--moe-router-topk-scaling-factor", "2.5", "--moe-token-dispatcher-type",
                    "alltoall", "--moe-shared-expert-intermediate-size", "64",
                    "--moe-shared-expert-overlap"])
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert moe_layer_pattern(config) == (False, True, True, True)
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.01
    assert config.moe_shared_expert_overlap
    assert parse(config_to_argv(config)) == config


def test_layer_freq_expressions_are_parsed_safely():
    assert parse_moe_layer_freq("3") == 3
    assert parse_moe_layer_freq("[1,0]*2") == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="moe_layer_freq"):
        parse_moe_layer_freq("__import__('os')")


def test_world_that_expert_layout_cannot_split_is_a_value_error(monkeypatch):
    from tpfuse.runtime import initialize

    monkeypatch.setattr(initialize.dist, "get_world_size", lambda: 6)
    with pytest.raises(ValueError, match=re.escape(
            "world size 6 is not divisible by expert_tensor_parallel_size (1) × "
            "expert_model_parallel_size (4) × pipeline_model_parallel_size (1)")):
        initialize.check_layout(make(expert_model_parallel_size=4))
    initialize.check_layout(make(expert_model_parallel_size=2))        # 6 = 1 × 2 × 3 edp


def test_gpt_model_uses_moe_layers_where_the_pattern_says():
    from tpfuse.models import GPTModel
    from tpfuse.moe import MoELayer
    from tpfuse.tp_layers import ParallelMLP

    config = make(moe_layer_freq=[0, 1, 1, 0], moe_aux_loss_coeff=0.01, hidden_dropout=0.0,
                  attention_dropout=0.0)
    model = GPTModel(config)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [ParallelMLP, MoELayer, MoELayer, ParallelMLP]
    experts = [p for p in model.parameters() if getattr(p, "allreduce", True) is False]
    assert len(experts) == 2 * 4 and all(p.shape[0] == 4 for p in experts)
    ids = torch.randint(0, 61, (2, 8))
    loss = model(ids, labels=ids).mean()
    loss.backward()
    assert set(model.router_losses.values["load_balancing_loss"]) == {1, 2}
    assert all(p.grad is not None for p in experts)


def test_generation_with_the_kv_cache_equals_recomputation_in_an_moe_model():
    """Routing is per token, so decoding one token at a time against the KV cache must give the
    tokens of re-running the whole sequence each step (the same seeded sampling: equal logits up
    to fp32 rounding pick the same token)."""
    from tpfuse.inference.generate import generate
    from tpfuse.models import GPTModel

    torch.manual_seed(0)
    model = GPTModel(make(seq_length=24, moe_grouped_gemm=True, moe_router_topk=2,
                          moe_shared_expert_intermediate_size=32)).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    cached, recomputed = (generate(model, prompts, 10, temperature=1.0, seed=3, use_cache=use)
                          for use in (True, False))
    assert cached == recomputed and len(set(cached[0])) > 1      # not a constant sequence


def test_gpt_model_rejects_a_state_with_other_expert_sizes():
    from tpfuse.models.gpt import check_layout_matches

    state = types.SimpleNamespace(tp_size=1, pp_size=1, cp_size=1, vpp_size=None, ep_size=1,
                                  etp_size=1)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 but the ParallelState "
                                         "has 1"):
        check_layout_matches(make(expert_model_parallel_size=2), state)


def test_moe_flops_by_hand():
    from tpfuse.training.throughput import flops_per_iteration

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                               vocab_size=100, make_vocab_size_divisible_by=128,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                               moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=8)
    # per token: attention 2·8·24 + 2·2·4·8 + 2·8·8 = 640 per layer; layer 0 dense gelu mlp
    # 2·8·32·2 = 1024; layer 1 router 2·8·4 = 64 + (2 experts · 16 + shared 8) · 2·8·2 = 1280;
    # logits 2·8·128 = 2048 → 2·640 + 1024 + 1344 + 2048 = 5696
    assert flops_per_iteration(config, 3) == 3 * 3 * 4 * 5696


def test_full_recompute_gives_the_same_gradients_and_logs_each_loss_once():
    """Recomputed MoE layers re-run the router inside backward: the gradients (router losses
    included) and the logged losses are those of the plain run (fp32, same ops: 1e-6)."""
    from tpfuse.models import GPTModel

    common = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, hidden_dropout=0.0,
                  attention_dropout=0.0)
    plain = GPTModel(make(**common))
    recomputed = GPTModel(make(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=2, **common))
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in (plain, recomputed):
        model(ids, labels=ids).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=name)
    for name in ("load_balancing_loss", "z_loss"):
        assert recomputed.router_losses.values[name].keys() == plain.router_losses.values[name].keys()
        for layer, value in plain.router_losses.values[name].items():
            torch.testing.assert_close(recomputed.router_losses.values[name][layer], value)
