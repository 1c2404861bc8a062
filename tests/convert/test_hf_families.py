"""tpfuse-convert for Mistral (sliding window), Qwen2 (QKV biases) and Llama 3.1 (llama3 rotary
scaling) against ``transformers``' own models (random, built here; nothing is downloaded): logits and greedy tokens, the round trip.

Tolerance (fp32, atol = rtol = 1e-5), as in test_hf_conversion.py: the same function of the same
weights with fp32 operations in another order (~6e-8 relative each, two layers of width 32):
≲ 1e-6 in logits of size ~1. A window off by one key, a missing or misplaced q/k/v bias moves
logits by 1e-3 or more (the window is 4 on sequences of 12, so it cuts most keys). The llama3
scaling test checks that the scaling matters: without it the logits differ by more than 1e-4.
"""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded


from tpfuse.convert import export_hf, import_hf  # noqa: E402
from tpfuse.inference import generate, load_model  # noqa: E402

from support.hf_checks import assert_same_safetensors, hf_greedy  # noqa: E402

VOCAB = 100
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12]]
STEPS = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "llama3":
        config = transformers.LlamaConfig(**dict(COMMON, hidden_size=64, num_attention_heads=2,
                                                 num_key_value_heads=1,
                                                 max_position_embeddings=16384), rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})
        return transformers.LlamaForCausalLM(config).eval()
    if kind == "mistral":
        config = transformers.MistralConfig(sliding_window=4, **COMMON)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**COMMON)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():                        # biases drawn, not zero
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "llama3"])
def test_family_import_gives_transformers_logits_and_tokens_and_exports_back(tmp_path, kind):
    model = _hf_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    config = import_hf(str(tmp_path / "hf"), str(tmp_path / "tpfuse"),
                       make_vocab_size_divisible_by=16)
    assert {"mistral": config.window_size == (3, 0), "qwen2": config.add_qkv_bias,
            "llama3": config.use_rope_scaling and config.rope_scaling_factor == 8.0}[kind]
    (ours,) = load_model(str(tmp_path / "tpfuse"))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        logits = ours(ids)[..., :VOCAB]
        hf_tokens = hf_greedy(model, PROMPTS, STEPS)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert generate(ours, PROMPTS, STEPS, greedy=True) == hf_tokens
    hf = export_hf(str(tmp_path / "tpfuse"), str(tmp_path / "back"))
    assert hf["model_type"] == ("llama" if kind == "llama3" else kind)
    assert_same_safetensors(tmp_path / "hf", tmp_path / "back")


def test_llama3_scaling_at_long_positions_and_without_it(tmp_path):
    """Rotary attention depends on distances only, so the scaling (of the low frequencies:
    wavelengths > 2048) shows over long distances: on 1024 tokens the scaled model equals
    transformers (same tolerance), and the comparison is able to fail: unscaled, it misses."""
    model = _hf_model("llama3")
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "tpfuse"), make_vocab_size_divisible_by=16)
    (ours,) = load_model(str(tmp_path / "tpfuse"))
    ids = torch.randint(1, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(1024)[None]
    with torch.no_grad():
        expected = model(ids, position_ids=positions).logits
        torch.testing.assert_close(ours(ids, positions)[..., :VOCAB], expected, rtol=1e-5,
                                   atol=1e-5)
        ours.config.use_rope_scaling = False
        gap = (ours(ids, positions)[..., :VOCAB] - expected).abs().max()
    assert gap > 1e-3


def test_conversions_write_a_certificate_that_verify_recomputes(tmp_path, capsys):
    import json

    from tpfuse.convert import certificate
    from tpfuse.convert.cli import main

    _hf_model("qwen2").save_pretrained(str(tmp_path / "hf"))
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert main(["--to-hf", "--load", str(tmp_path / "ckpt"), "--save",
                 str(tmp_path / "back")]) == 0
    for folder in ("ckpt", "back"):
        stored = json.loads((tmp_path / folder / "certificate.json").read_text())
        assert stored["computed"] and stored["max_abs_logit_diff"] <= stored["tolerance"] < 1e-3
        assert main(["--verify", str(tmp_path / folder)]) == 0
    assert "<= tolerance" in capsys.readouterr().out
    with torch.no_grad():                          # a corrupted export fails its verification
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
        model.model.layers[0].self_attn.q_proj.bias.add_(0.5)
        model.save_pretrained(str(tmp_path / "back_model"))
    for name in ("model.safetensors",):
        os.replace(tmp_path / "back_model" / name, tmp_path / "back" / name)
    assert main(["--verify", str(tmp_path / "back")]) == 2
    assert "above the tolerance" in capsys.readouterr().err
    with pytest.raises(ValueError, match="above the tolerance"):
        certificate.check({"computed": True, "max_abs_logit_diff": 1.0, "tolerance": 1e-5})
    # the stored paths are relative to the certificate's folder: moved together, a pair verifies
    stored = json.loads((tmp_path / "ckpt" / "certificate.json").read_text())
    assert [stored[side] for side in certificate.SIDES] == [".", os.path.join("..", "hf")]
    (tmp_path / "moved").mkdir()
    for folder in ("hf", "ckpt"):
        os.replace(tmp_path / folder, tmp_path / "moved" / folder)
    assert main(["--verify", str(tmp_path / "moved" / "ckpt")]) == 0


def test_use_checkpoint_args_takes_the_shape_and_lets_rotary_run_longer(tmp_path):
    """--use-checkpoint-args: no model flag is given, the converted Qwen2's shape comes from the
    checkpoint; --seq-length 128 beyond its 64 positions is allowed (rotary: no position table)."""
    from tpfuse.training.arguments import parse_args

    _hf_model("qwen2").save_pretrained(str(tmp_path / "hf"))
    saved = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                      make_vocab_size_divisible_by=16)
    config, _ = parse_args(["--load", str(tmp_path / "ckpt"), "--finetune",
                            "--use-checkpoint-args", "--seq-length", "128", "--mock-data",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "99",
                            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0.0"])
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "vocab_size", "normalization", "activation",
                 "position_embedding_type", "rotary_base", "add_bias_linear", "add_qkv_bias",
                 "untie_embeddings_and_output_weights", "layernorm_epsilon"):
        assert getattr(config, name) == getattr(saved, name), name
    assert config.seq_length == 128 and config.max_position_embeddings == 128
    with pytest.raises(ValueError, match="--use-checkpoint-args needs --load"):
        parse_args(["--use-checkpoint-args", "--mock-data", "--micro-batch-size", "1",
                    "--lr", "0.1", "--train-iters", "1"])
