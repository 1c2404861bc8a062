"""tpfuse-convert for Qwen2-MoE (softmax router over all experts, top-k not renormalised unless
``norm_topk_prob``; a shared expert scaled by σ(shared_expert_gate(x)); QKV biases; dense layers
by ``mlp_only_layers``) against ``transformers``' own Qwen2-MoE (random, built here; nothing is
downloaded): HF → tpfuse → HF through the command line, each direction certified, the export
bit-identical, logits and greedy tokens equal.

Tolerance: the certificate's own (convert/certificate.py: the fp32 summation-order bound, ~1e-5
here) for the logits of the converted checkpoint, and greedy tokens exactly (random models'
top-two gaps are far above it). A renormalised routing where HF keeps the raw softmax, a missing
or ungated shared expert, swapped gate / up rows or a dense layer taken as sparse move logits by
1e-2 or more (the routers and gates are spread so that they matter).
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded


from tpfuse.convert.cli import main  # noqa: E402
from tpfuse.inference import generate, load_model  # noqa: E402

from support.hf_checks import (assert_export_refused, assert_same_safetensors,  # noqa: E402
                               hf_greedy)

VOCAB = 100
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]
STEPS = 5
VARIANTS = {  # name: config overrides
    # every layer sparse, raw top-k softmax probabilities (Qwen2-MoE's default)
    "all-sparse": dict(),
    # layer 0 dense, renormalised top-k, no QKV bias
    "dense-first-normalised": dict(mlp_only_layers=[0], norm_topk_prob=True, qkv_bias=False),
}


def _hf_qwen2_moe(**overrides):
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = transformers.Qwen2MoeConfig(**{**values, **overrides})
    model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():                      # spread routers, gates and biases so they matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_qwen2_moe_round_trip_is_certified_and_bit_identical(tmp_path, variant):
    model = _hf_qwen2_moe(**VARIANTS[variant])
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
    assert c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size == 24
    assert c.moe_router_pre_softmax == (variant == "all-sparse")
    assert c.moe_layer_freq == (1 if variant == "all-sparse" else [0, 1])
    assert c.add_qkv_bias == (variant == "all-sparse")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gap = (ours(ids)[..., :VOCAB] - model(ids).logits).abs().max()
    assert gap <= stored["tolerance"]
    assert generate(ours, PROMPTS, STEPS, greedy=True) == hf_greedy(model, PROMPTS, STEPS)

    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["Qwen2MoeForCausalLM"]
    assert back["norm_topk_prob"] == (variant != "all-sparse")
    assert_same_safetensors(tmp_path / "hf", tmp_path / "back")


def test_qwen2_moe_imported_at_tp2_loads_in_one_process(tmp_path):
    """Imported at tp 2 (SP on, as MoE under TP trains; the shared expert split like a dense
    MLP), loaded at tp 1: the transformers logits within the same tolerance."""
    model = _hf_qwen2_moe()
    model.save_pretrained(str(tmp_path / "hf"))
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"),
                 "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by",
                 "16"]) == 0
    stored = json.loads((tmp_path / "ckpt" / "certificate.json").read_text())
    (ours,) = load_model(str(tmp_path / "ckpt"))
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        gap = (ours(ids)[..., :VOCAB] - model(ids).logits).abs().max()
    assert gap <= stored["tolerance"]


def test_qwen2_moe_sliding_window_is_a_clear_refusal(tmp_path, capsys):
    _hf_qwen2_moe().save_pretrained(str(tmp_path / "hf"))
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, use_sliding_window=True, sliding_window=4)))
    capsys.readouterr()                              # drop save_pretrained's progress bar
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use_sliding_window=true" in err[0]
    assert not os.path.exists(tmp_path / "ckpt")


def test_ungated_shared_expert_has_no_counterpart_and_says_why(tmp_path, capsys):
    from tpfuse.models import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                               vocab_size=40, num_moe_experts=2, moe_router_topk=1,
                               activation="swiglu", normalization="RMSNorm",
                               position_embedding_type="rope", add_bias_linear=False,
                               add_qkv_bias=True, ffn_hidden_size=32,
                               moe_shared_expert_intermediate_size=16,
                               make_vocab_size_divisible_by=8)
    assert_export_refused(tmp_path, capsys, config,
                          "qwen2_moe: moe_shared_expert_gate=False (needs True)")
