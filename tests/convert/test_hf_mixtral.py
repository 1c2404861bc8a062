"""tpfuse-convert for Mixtral-style MoE models against ``transformers``' own Mixtral (random, built
here; nothing is downloaded), and the export of a checkpoint trained at tp2 + SP, ep2.

Tolerance (fp32, atol = rtol = 1e-5) as in test_hf_conversion.py: the same function of the same
weights, only the order of fp32 operations differs (fused QKV / gate-up GEMMs, the experts'
stacked GEMMs, the weighted sum of the k expert outputs in another order), each rounding at
~6e-8 relative over two layers of width ≤ 64: ≲ 1e-6 in logits of size ~1. A swapped w1 / w3,
an untransposed expert weight or another routing normalisation moves logits by 1e-2 or more.
Greedy tokens are compared exactly (random models' top-two gaps are far above 1e-6). The export
of a checkpoint trained at tp2 + SP, ep2 is checked in tests/inference/test_inference_moe.py (it
reuses that module's trained checkpoint).
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded

from tpfuse.convert import export_hf, import_hf  # noqa: E402
from tpfuse.convert.cli import main  # noqa: E402
from tpfuse.inference import generate, load_model  # noqa: E402

from support.hf_checks import (assert_export_refused, assert_same_safetensors,  # noqa: E402
                               hf_greedy)

VOCAB = 100
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]
STEPS = 6


def _hf_mixtral(**overrides):
    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**values, **overrides}))
    with torch.no_grad():                      # spread the router so routing is not uniform
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("tp", [1, 2])
def test_mixtral_import_gives_transformers_logits_and_tokens(tmp_path, tp):
    """Imported at tp (experts split like the dense layers), loaded in one process."""
    model = _hf_mixtral()
    model.save_pretrained(str(tmp_path / "hf"))
    config = import_hf(str(tmp_path / "hf"), str(tmp_path / "tpfuse"),
                       tensor_model_parallel_size=tp, make_vocab_size_divisible_by=16)
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    (ours,) = load_model(str(tmp_path / "tpfuse"))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        logits = ours(ids)[..., :VOCAB]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert generate(ours, PROMPTS, STEPS, greedy=True) == hf_greedy(model, PROMPTS, STEPS)


def test_mixtral_export_of_import_is_bit_identical(tmp_path):
    model = _hf_mixtral()
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "tpfuse"), make_vocab_size_divisible_by=16)
    hf = export_hf(str(tmp_path / "tpfuse"), str(tmp_path / "back"))
    assert hf["architectures"] == ["MixtralForCausalLM"]
    assert_same_safetensors(tmp_path / "hf", tmp_path / "back")


def test_moe_model_without_a_mixtral_counterpart_is_a_clear_refusal(tmp_path, capsys):
    from tpfuse.models import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                               vocab_size=40, num_moe_experts=2, moe_router_topk=1,
                               activation="swiglu", normalization="RMSNorm",
                               position_embedding_type="rope", add_bias_linear=False,
                               ffn_hidden_size=32, moe_shared_expert_intermediate_size=16,
                               make_vocab_size_divisible_by=8)
    assert_export_refused(tmp_path, capsys, config,
                          "moe_shared_expert_intermediate_size=16 (needs None)")
