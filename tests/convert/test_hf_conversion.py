"""tpfuse-convert against HuggingFace ``transformers``' own GPT-2 and Llama (random, built here;
nothing is downloaded): logits, greedy continuations, the round trip, a trained model's export.

Tolerance of the logit comparisons (fp32, atol = rtol = 1e-5): both sides compute the same
function of the same weights; only the order of fp32 operations differs (one fused QKV GEMM vs
three, TP partial sums, a flash / blocked attention vs HF's), each rounding at ~6e-8 relative,
over two layers of width ≤ 64: ≲ 1e-6 in logits of size ~1. A wrong mapping — a head in the
wrong group, an untransposed Conv1D weight, a missing bias, a permuted rotary half — moves logits
by 1e-2 or more.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"     # nothing may be downloaded


from tpfuse.convert import export_hf, import_hf  # noqa: E402
from tpfuse.inference import generate, load_model, pipeline_forward  # noqa: E402

from support.hf_checks import assert_same_safetensors  # noqa: E402
from support.pretrain_run import run_pretrain  # noqa: E402

VOCAB = 100
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [42]]
STEPS = 8
SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _hf_model(kind):
    torch.manual_seed(0)
    if kind.startswith("gpt2"):
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                         n_positions=64, tie_word_embeddings=kind == "gpt2",
                                         **SPECIAL)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=64,
                                      rope_theta=500000.0, tie_word_embeddings=kind == "llama-tied",
                                      **SPECIAL)
    return transformers.LlamaForCausalLM(config).eval()


def _write_tokenizer(directory):
    """A word-level tokenizer.json ("w0".."w98", EOD "<|endoftext|>" = 0) built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|endoftext|>"] + [f"w{i}" for i in range(VOCAB - 1)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def converted(request, tmp_path_factory):
    """(HF model, its directory, tpfuse checkpoint at tp2 pp2, HF greedy continuations)."""
    root = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    model.save_pretrained(str(root / "hf"))
    _write_tokenizer(str(root / "hf"))
    import_hf(str(root / "hf"), str(root / "tpfuse"), tensor_model_parallel_size=2,
              pipeline_model_parallel_size=2, make_vocab_size_divisible_by=16)
    with torch.no_grad():
        continuations = [model.generate(torch.tensor([p]), max_new_tokens=STEPS,
                                        do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    assert any(len(c) == STEPS for c in continuations)      # not all stopped at eos at once
    return model, str(root / "hf"), str(root / "tpfuse"), continuations


def _ids():
    return torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits_and_greedy(root, tp):
    """Full-vocabulary logits (b, s, V) and greedy continuations from load_model at tp."""
    from tpfuse.parallel import parallel_state
    from tpfuse.parallel.mappings import gather_from_region

    state = parallel_state.initialize_model_parallel(tp) if tp > 1 else None
    chunks = load_model(root, state)
    ids = _ids()
    with torch.no_grad():
        logits = pipeline_forward(chunks, ids, None, state=state)
        if state is not None:
            logits = gather_from_region(logits, state.tp_group)
    return logits[..., :VOCAB], generate(chunks, PROMPTS, STEPS, greedy=True, eos_id=0,
                                         state=state)


def test_logits_and_greedy_continuations_equal_transformers_tp1(converted):
    model, _, root, continuations = converted
    logits, tokens = _logits_and_greedy(root, 1)
    with torch.no_grad():
        expected = model(_ids()).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert tokens == continuations


def test_logits_and_greedy_continuations_equal_transformers_tp2(converted, run_distributed):
    model, _, root, continuations = converted
    (logits, tokens), other = run_distributed(2, _logits_and_greedy, root, 2)
    with torch.no_grad():
        expected = model(_ids()).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert tokens == continuations == other[1]


def test_rank_files_load_into_the_trainers_model_strictly(converted, run_distributed):
    """Each tp2 pp2 rank file holds exactly its GPTModel chunk's state dict."""
    _, _, root, _ = converted
    assert run_distributed(4, _strict_load, root) == [True] * 4


def _strict_load(root):
    from tpfuse.checkpoint.reading import checkpoint_folder
    from tpfuse.inference.loading import inference_config
    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel import parallel_state

    state = parallel_state.initialize_model_parallel(2, 2)
    folder, read = checkpoint_folder(root)           # every file checked against the manifest
    payload = read(os.path.join(folder, f"rank_{state.rank:05d}.pt"))
    config = inference_config(payload["model_config"], 2, 2)
    (chunk,) = build_model(make_gpt_model_provider(config), config, state)
    chunk.load_state_dict(payload["model"][0], strict=True)
    return True


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-untied", "llama", "llama-tied"])
def test_export_of_import_is_bit_identical(tmp_path, kind):
    model = _hf_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "tpfuse"), tensor_model_parallel_size=2,
              pipeline_model_parallel_size=2)
    export_hf(str(tmp_path / "tpfuse"), str(tmp_path / "back"))
    assert_same_safetensors(tmp_path / "hf", tmp_path / "back")
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    shape_keys = {"gpt2": ["n_layer", "n_embd", "n_head", "n_positions", "activation_function"],
                  "llama": ["num_hidden_layers", "hidden_size", "num_key_value_heads",
                            "intermediate_size", "rms_norm_eps"]}[kind.split("-")[0]]
    for key in shape_keys + ["vocab_size", "tie_word_embeddings", "model_type", "eos_token_id"]:
        assert written[key] == original[key], key


def test_cli_text_generation_through_the_converted_tokenizer(converted, tmp_path, monkeypatch,
                                                             capsys):
    """tpfuse-convert then tpfuse-generate --prompt: the HF tokenizer.json travels along."""
    from tpfuse.convert.cli import main as convert
    from tpfuse.inference.cli import main as generate_cli

    model, hf_dir, _, _ = converted
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert convert(["--from-hf", hf_dir, "--save", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert generate_cli(["--load", str(tmp_path / "ckpt"), "--prompt", "w4 w5 w6",
                         "--max-new-tokens", "6", "--greedy", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with torch.no_grad():
        expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6,
                                  do_sample=False)[0, 3:].tolist()
    assert result["prompt_ids"] == [5, 6, 7] and result["generated_ids"] == expected
    assert result["text"] == " ".join(f"w{t - 1}" for t in expected if t != 0)


# -------------------------------------------------------------------- a model trained by tpfuse
TRAIN = [  # the main job's shape (LayerNorm, GeLU, learned positions, biases, tied), tp2 + SP
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "32", "--tokenizer-type", "ByteTokenizer",
    "--make-vocab-size-divisible-by", "16", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-2", "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000",
    "--no-progress-bar", "--no-layout-table", "--tensor-model-parallel-size", "2",
    "--sequence-parallel",
]


def test_trained_model_exported_gives_transformers_the_same_logits(run_distributed, tmp_path):
    run_distributed(2, run_pretrain, TRAIN + ["--save", str(tmp_path / "ckpt")])
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.eos_token_id == 256
    (ours,) = load_model(str(tmp_path / "ckpt"))
    ids = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids)[..., :257]
    assert not torch.equal(ours.layers[0].input_norm.weight, torch.ones(64))   # it trained
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
