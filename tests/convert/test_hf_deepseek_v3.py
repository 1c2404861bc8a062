"""tpfuse-convert for DeepSeek-V3 (multi-latent attention with YaRN rope, the first layer dense,
then sigmoid-routed MoE with an expert bias, group-limited choice, top-k scaling and a shared
expert) against ``transformers``' own DeepseekV3ForCausalLM (random, built here; nothing is
downloaded): HF → tpfuse → HF through the command line, each direction certified, the export
bit-identical, logits and greedy tokens equal at tp 1 and tp 2.

Tolerance: the certificate's own (convert/certificate.py: the fp32 summation-order bound) for the
logits, and greedy tokens exactly (random models' top-two gaps are far above it). The router
weights and the expert bias are spread so that a wrong group choice, a bias used in the weights,
a missing scaling factor or renormalisation, swapped latent / rope columns or a missing shared
expert move the logits by far more.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded


from tpfuse.convert.cli import main  # noqa: E402
from tpfuse.inference import generate, load_model  # noqa: E402

from support.hf_checks import assert_same_safetensors, hf_greedy  # noqa: E402

VOCAB = 100
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]
STEPS = 5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {  # name: config overrides
    # q compressed (q_lora_rank), YaRN, 4 groups of 2 experts, 2 groups chosen, top-4 (each
    # group ranked by its 4 / 2 = 2 best scores on both sides)
    "q-lora-yarn-groups": dict(q_lora_rank=24, rope_parameters=YARN, n_group=4, topk_group=2,
                               num_experts_per_tok=4),
    # no q compression, plain rope, no groups
    "plain-rope": dict(q_lora_rank=None, n_group=1, topk_group=1),
}


def _hf_deepseek_v3(**overrides):
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                  first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=12, routed_scaling_factor=2.5, n_group=1,
                  topk_group=1,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = transformers.DeepseekV3Config(**{**values, **overrides})
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():                      # spread the routers and biases so they matter
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return model.eval()


def _logit_gap(ours, model, seed):
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(ids)[..., :VOCAB] - model(ids).logits).abs().max()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_v3_round_trip_is_certified_and_bit_identical(tmp_path, variant):
    model = _hf_deepseek_v3(**VARIANTS[variant])
    model.save_pretrained(str(tmp_path / "hf"))
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                 "--make-vocab-size-divisible-by", "16"]) == 0
    assert main(["--to-hf", "--load", str(tmp_path / "ckpt"), "--save",
                 str(tmp_path / "back")]) == 0
    for folder in ("ckpt", "back"):
        stored = json.loads((tmp_path / folder / "certificate.json").read_text())
        assert stored["computed"] and stored["max_abs_logit_diff"] <= stored["tolerance"] < 1e-3

    (ours,) = load_model(str(tmp_path / "ckpt"))
    c = ours.config
    assert c.multi_latent_attention and c.moe_layer_freq == [0, 1, 1]
    assert c.moe_router_enable_expert_bias and c.moe_router_score_function == "sigmoid"
    assert _logit_gap(ours, model, 3) <= stored["tolerance"]
    assert generate(ours, PROMPTS, STEPS, greedy=True) == hf_greedy(model, PROMPTS, STEPS)

    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["DeepseekV3ForCausalLM"]
    assert back["first_k_dense_replace"] == 1 and back["q_lora_rank"] == model.config.q_lora_rank
    assert_same_safetensors(tmp_path / "hf", tmp_path / "back")


def test_deepseek_v3_imported_at_tp2_generates_as_transformers(run_distributed, tmp_path):
    """Imported at tp 2 (SP on, as MoE under TP trains), greedy generation on two ranks equals
    transformers', and the checkpoint loaded in one process gives its logits."""
    model = _hf_deepseek_v3(**VARIANTS["q-lora-yarn-groups"])
    model.save_pretrained(str(tmp_path / "hf"))
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                 "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                 "16"]) == 0
    stored = json.loads((tmp_path / "ckpt" / "certificate.json").read_text())
    (ours,) = load_model(str(tmp_path / "ckpt"))
    assert _logit_gap(ours, model, 4) <= stored["tolerance"]
    expected = hf_greedy(model, PROMPTS, STEPS)
    for tokens in run_distributed(2, _generate_at_tp2, str(tmp_path / "ckpt")):
        assert tokens == expected


def _generate_at_tp2(folder):
    from tpfuse.parallel import parallel_state

    state = parallel_state.initialize_model_parallel(2)
    chunks = load_model(folder, state)
    return generate(chunks, PROMPTS, STEPS, greedy=True, state=state)


@pytest.mark.parametrize("overrides,message", [
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"n_group": 4, "topk_group": 2}, "n_group=4 with num_experts_per_tok=2 and topk_group=2")],
    ids=["rope_interleave", "norm_topk_prob", "attention_bias", "groups"])
def test_deepseek_v3_fields_tpfuse_cannot_express_are_refused_by_name(tmp_path, capsys, overrides,
                                                                        message):
    _hf_deepseek_v3().save_pretrained(str(tmp_path / "hf"))
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, **overrides)))
    capsys.readouterr()                              # drop save_pretrained's progress bar
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / "ckpt")
