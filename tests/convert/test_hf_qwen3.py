"""tpfuse-convert for Qwen3 (q / k RMSNorm before rotary, head_dim ≠ hidden / heads, tied) and
Qwen3-MoE (no shared expert, dense layers by ``decoder_sparse_step`` / ``mlp_only_layers``, both
``norm_topk_prob`` routings) against ``transformers``' own models (random, built here; nothing is
downloaded): HF → tpfuse at tp2 × pp2 through the command line (certified), loaded at tp1 and
tp2 (MoE: and ep2), logits and greedy tokens; → HF again bit-identical; refusals by name.

Tolerance: the certificate's own (convert/certificate.py: the fp32 summation-order bound
2·N·2⁻²⁴·(L + 1)·max(1, M), N the longest reduction, here the output projection's heads × head
dim = 64; ~1e-5) for every logit comparison, and greedy tokens exactly (random models' top-two
gaps are far above it). The q / k norm weights, routers and head dim are drawn so they matter: a
norm taken as 1 (the check below), norm after rotary instead of before, a head dim of h / heads,
the other routing normalisation or a dense layer taken as sparse move logits by 1e-3 or more.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded


from tpfuse.convert.cli import main  # noqa: E402
from tpfuse.inference import generate, load_model, pipeline_forward  # noqa: E402

from support.hf_checks import (assert_export_refused, assert_same_safetensors,  # noqa: E402
                               hf_greedy)

VOCAB = 100
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]
STEPS = 5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MOE_VARIANTS = {  # name: config overrides
    # layer 0 dense by decoder_sparse_step = 2, renormalised top-k (the released models)
    "step2-normalised": dict(decoder_sparse_step=2, norm_topk_prob=True),
    # every layer sparse, raw top-k softmax probabilities (transformers' default)
    "all-sparse-raw": dict(norm_topk_prob=False),
}


def _spread(model):
    """Draw the q / k norm weights and the routers away from their constant initialisation."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model.eval()


def _hf_qwen3(**overrides):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True, **overrides})
    return _spread(transformers.Qwen3ForCausalLM(config))


def _hf_qwen3_moe(**overrides):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**COMMON, **MOE, **overrides})
    return _spread(transformers.Qwen3MoeForCausalLM(config))


def _converted(model, root):
    """HF dir → tpfuse checkpoint at tp2 pp2 → HF dir, each certified: (model, root, the import's
    tolerance, transformers' logits on ``_ids()``, its greedy tokens)."""
    model.save_pretrained(str(root / "hf"))
    assert main(["--from-hf", str(root / "hf"), "--save", str(root / "ckpt"),
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--make-vocab-size-divisible-by", "16"]) == 0
    assert main(["--to-hf", "--load", str(root / "ckpt"), "--save", str(root / "back")]) == 0
    tolerances = []
    for folder in ("ckpt", "back"):
        stored = json.loads((root / folder / "certificate.json").read_text())
        assert stored["computed"] and stored["max_abs_logit_diff"] <= stored["tolerance"] < 1e-3
        tolerances.append(stored["tolerance"])
    with torch.no_grad():
        expected = model(_ids()).logits
    return model, root, tolerances[0], expected, hf_greedy(model, PROMPTS, STEPS)


def _ids():
    return torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _converted(_hf_qwen3(), tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Variant name → ``_converted`` of that Qwen3-MoE."""
    return {name: _converted(_hf_qwen3_moe(**overrides), tmp_path_factory.mktemp(name))
            for name, overrides in MOE_VARIANTS.items()}


def _logits_and_greedy(root, tp=1, ep=1):
    """Logits (b, s, V) and greedy continuations from load_model at tp × ep (pp 1)."""
    from tpfuse.parallel import parallel_state
    from tpfuse.parallel.mappings import gather_from_region

    state = (parallel_state.initialize_model_parallel(tp, expert_model_parallel_size=ep)
             if tp * ep > 1 else None)
    chunks = load_model(root, state)
    with torch.no_grad():
        logits = pipeline_forward(chunks, _ids(), None, state=state)
        if tp > 1:
            logits = gather_from_region(logits, state.tp_group)
    return logits[..., :VOCAB], generate(chunks, PROMPTS, STEPS, greedy=True, state=state)


def _assert_matches(result, expected, tolerance, tokens):
    logits, greedy = result
    assert (logits - expected).abs().max() <= tolerance
    assert greedy == tokens


def test_qwen3_config_maps_head_dim_and_qk_norm(qwen3):
    _, root, _, _, _ = qwen3
    (ours,) = load_model(str(root / "ckpt"))
    c = ours.config
    assert c.qk_layernorm and c.kv_channels == 16 != c.hidden_size // c.num_attention_heads
    assert not c.untie_embeddings_and_output_weights and not c.add_bias_linear
    back = json.loads((root / "back" / "config.json").read_text())
    assert back["architectures"] == ["Qwen3ForCausalLM"] and back["head_dim"] == 16
    assert back["tie_word_embeddings"]
    from tpfuse.training.arguments import parse_args  # the trainer takes the shape too

    trained, _ = parse_args(["--load", str(root / "ckpt"), "--finetune", "--use-checkpoint-args",
                             "--seq-length", "16", "--mock-data", "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", str(VOCAB - 1),
                             "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0.0"])
    assert (trained.kv_channels, trained.qk_layernorm) == (16, True)


def test_qwen3_logits_and_tokens_at_tp1_and_the_norms_matter(qwen3):
    model, root, tolerance, expected, tokens = qwen3
    _assert_matches(_logits_and_greedy(str(root / "ckpt")), expected, tolerance, tokens)
    (ours,) = load_model(str(root / "ckpt"))
    with torch.no_grad():                        # the comparison can fail: unit q norms miss
        for layer in ours.layers:
            layer.self_attention.q_layernorm.weight.fill_(1.0)
        gap = (ours(_ids())[..., :VOCAB] - expected).abs().max()
    assert gap > 1e-3


def test_qwen3_logits_and_tokens_at_tp2(qwen3, run_distributed):
    model, root, tolerance, expected, tokens = qwen3
    for result in run_distributed(2, _logits_and_greedy, str(root / "ckpt"), 2):
        _assert_matches(result, expected, tolerance, tokens)


def test_qwen3_export_of_import_is_bit_identical(qwen3):
    _, root, _, _, _ = qwen3
    assert_same_safetensors(root / "hf", root / "back")


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_qwen3_moe_config_and_round_trip(qwen3_moe, variant):
    _, root, _, _, _ = qwen3_moe[variant]
    (ours,) = load_model(str(root / "ckpt"))
    c = ours.config
    assert c.qk_layernorm and c.kv_channels == 16 and c.moe_shared_expert_intermediate_size is None
    assert c.moe_router_pre_softmax == (variant == "all-sparse-raw")
    assert c.moe_layer_freq == (1 if variant == "all-sparse-raw" else [0, 1])
    back = json.loads((root / "back" / "config.json").read_text())
    assert back["architectures"] == ["Qwen3MoeForCausalLM"]
    assert back["norm_topk_prob"] == (variant != "all-sparse-raw")
    assert back["mlp_only_layers"] == ([] if variant == "all-sparse-raw" else [0])
    assert_same_safetensors(root / "hf", root / "back")


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_qwen3_moe_logits_and_tokens_at_tp1(qwen3_moe, variant):
    _, root, tolerance, expected, tokens = qwen3_moe[variant]
    _assert_matches(_logits_and_greedy(str(root / "ckpt")), expected, tolerance, tokens)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_qwen3_moe_logits_and_tokens_at_tp2_and_ep2(qwen3_moe, run_distributed, tp, ep):
    _, root, tolerance, expected, tokens = qwen3_moe["step2-normalised"]
    for result in run_distributed(2, _logits_and_greedy, str(root / "ckpt"), tp, ep):
        _assert_matches(result, expected, tolerance, tokens)


@pytest.mark.parametrize("build, edit, message", [
    (_hf_qwen3, dict(attention_bias=True), "Qwen3 attention_bias=true is not supported"),
    (_hf_qwen3, dict(use_sliding_window=True, sliding_window=4),
     "Qwen3 use_sliding_window=true"),
    (_hf_qwen3, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                      "factor": 4.0}), "rope_type='yarn' is not supported"),
    (_hf_qwen3_moe, dict(use_sliding_window=True, sliding_window=4),
     "Qwen3-MoE use_sliding_window=true"),
    (_hf_qwen3_moe, dict(mlp_only_layers=[0, 1]), "Qwen3-MoE config.json has no sparse layer"),
], ids=["attention-bias", "sliding-window", "yarn", "moe-sliding-window", "moe-all-dense"])
def test_unsupported_fields_are_refused_by_name(tmp_path, capsys, build, edit, message):
    build(num_hidden_layers=1 if build is _hf_qwen3 else 2).save_pretrained(str(tmp_path / "hf"))
    config_file = tmp_path / "hf" / "config.json"
    config_file.write_text(json.dumps(dict(json.loads(config_file.read_text()), **edit)))
    capsys.readouterr()                              # drop save_pretrained's progress bar
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not os.path.exists(tmp_path / "ckpt")


def test_moe_model_with_q_k_norms_and_a_shared_expert_has_no_counterpart(tmp_path, capsys):
    from tpfuse.models import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                               vocab_size=40, num_moe_experts=2, moe_router_topk=1,
                               activation="swiglu", normalization="RMSNorm",
                               position_embedding_type="rope", add_bias_linear=False,
                               qk_layernorm=True, ffn_hidden_size=32,
                               moe_shared_expert_intermediate_size=16,
                               make_vocab_size_divisible_by=8)
    assert_export_refused(tmp_path, capsys, config, "qwen3_moe: "
                          "moe_shared_expert_intermediate_size=16 (needs None: no shared expert)")


def test_keys_left_out_of_config_json_mean_what_transformers_builds():
    """A config.json without head_dim / num_key_value_heads (/ router_aux_loss_coef): the values
    are those of the transformers config class and the attention it builds (Qwen3: head_dim 128,
    32 KV heads; Qwen3-MoE: hidden / heads, 4 KV heads, aux loss 0.001)."""
    from tpfuse.convert import qwen3, qwen3_moe
    from tpfuse.models import TransformerConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                 num_attention_heads=32, max_position_embeddings=64)
    cases = [(qwen3, transformers.Qwen3Config, Qwen3Attention, {}),
             (qwen3_moe, transformers.Qwen3MoeConfig, Qwen3MoeAttention, MOE)]
    for module, config_class, attention_class, extra in cases:
        written = dict(shape, **extra)
        values = module.config_from_hf(written)
        ours = TransformerConfig(**values)
        hf_config = config_class(**written)
        attention = attention_class(hf_config, 0)
        assert ours.kv_channels == attention.head_dim
        assert ours.num_query_groups == hf_config.num_key_value_heads
        assert ours.moe_aux_loss_coeff == getattr(hf_config, "router_aux_loss_coef", 0.0)
