"""tpfuse-convert without ``transformers``: the fused-QKV algebra, the round trip through the
safetensors files, and bad input — each error names what is wrong and leaves nothing behind.

The HF-format fixtures here are written by tpfuse's own exporter from a random tpfuse model (the
files ``transformers`` itself writes and reads are checked in test_hf_conversion.py)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.pretrain_run import pretrain_error
from tpfuse.convert import export_hf, import_hf
from tpfuse.convert.cli import main
from tpfuse.convert.common import fuse_qkv, split_qkv
from tpfuse.inference import load_model
from tpfuse.models import GPTModel, TransformerConfig

LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, seq_length=16, vocab_size=50, normalization="RMSNorm",
             activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=50,
            activation="gelu_tanh", hidden_dropout=0.0, attention_dropout=0.0)


def test_fused_qkv_matches_index_arithmetic():
    """Group g of the fused tensor is [q rows of its heads; k_g; v_g] (d rows per head)."""
    heads, groups, d, h = 6, 3, 2, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    fused = fuse_qkv(q, k, v, groups)
    per_group = (heads // groups + 2) * d
    for g in range(groups):
        block = fused[g * per_group:(g + 1) * per_group]
        q_rows = q[g * (heads // groups) * d:(g + 1) * (heads // groups) * d]
        assert torch.equal(block, torch.cat([q_rows, k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups, d), (q, k, v)))


def _tpfuse_checkpoint(tmp_path, shape, name="ckpt"):
    """A random single-process tpfuse model saved through the converter's writer."""
    from tpfuse.convert.tpfuse_io import write_checkpoint

    config = TransformerConfig(**shape, make_vocab_size_divisible_by=16, seed=5)
    model = GPTModel(config)
    params = {model.global_parameter_names()[n]: p.detach() for n, p in model.named_parameters()}
    write_checkpoint(str(tmp_path / name), config, params, {"tokenizer": "byte"})
    return str(tmp_path / name), model


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_round_trip_through_hf_files_and_any_layout(tmp_path, shape):
    """tpfuse → HF files → tpfuse at tp2 pp2 → HF files: the same tensors, the same model."""
    root, model = _tpfuse_checkpoint(tmp_path, {"gpt2": GPT2, "llama": LLAMA}[shape])
    export_hf(root, str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "again"), tensor_model_parallel_size=2,
              pipeline_model_parallel_size=2, make_vocab_size_divisible_by=16)
    export_hf(str(tmp_path / "again"), str(tmp_path / "hf2"))
    first = load_file(str(tmp_path / "hf" / "model.safetensors"))
    second = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(first) == sorted(second)
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert first[next(n for n in first if "embed" in n or "wte" in n)].shape[0] == 50   # trimmed
    (loaded,) = load_model(str(tmp_path / "again"))
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():      # the same weights in the same single-process layout: exact
        # (padded vocabulary rows: random in the original, zeros after the trip; not compared)
        torch.testing.assert_close(loaded(ids)[..., :50], model.eval()(ids)[..., :50], rtol=0,
                                   atol=0)


@pytest.fixture
def hf_dir(tmp_path):
    root, _ = _tpfuse_checkpoint(tmp_path, GPT2)
    export_hf(root, str(tmp_path / "hf"))
    return tmp_path / "hf"


def _config(hf_dir):
    return json.loads((hf_dir / "config.json").read_text())


def _rewrite_config(hf_dir, **changes):
    config = _config(hf_dir)
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


def _rewrite_tensors(hf_dir, edit):
    path = str(hf_dir / "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _convert_error(hf_dir, save, capsys):
    assert main(["--from-hf", str(hf_dir), "--save", str(save)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpfuse-convert: error:")
    assert not os.path.exists(save)                                  # nothing written
    assert not [n for n in os.listdir(os.path.dirname(save)) if n.startswith(".")]
    return err[0]


def test_unknown_architecture(hf_dir, tmp_path, capsys):
    _rewrite_config(hf_dir, model_type="bert", architectures=["BertForMaskedLM"])
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert "unknown architecture model_type='bert'" in message


def test_missing_tensor(hf_dir, tmp_path, capsys):
    _rewrite_tensors(hf_dir, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    assert "missing tensor 'transformer.h.1.mlp.c_fc.bias'" in _convert_error(hf_dir,
                                                                           tmp_path / "o", capsys)


def test_shape_mismatch(hf_dir, tmp_path, capsys):
    _rewrite_config(hf_dir, n_inner=64)
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert "tensor 'transformer.h.0.mlp.c_fc.weight' has shape (32, 128)" in message
    assert "the config implies (32, 64)" in message


def test_another_models_checkpoint(hf_dir, tmp_path, capsys):
    """GPT-2 weights under a Llama config.json: the first Llama tensor is missing."""
    _rewrite_config(hf_dir, model_type="llama", hidden_size=32, num_attention_heads=4,
                    num_hidden_layers=2, intermediate_size=48, max_position_embeddings=16)
    assert "missing tensor 'model.embed_tokens.weight'" in _convert_error(hf_dir, tmp_path / "o",
                                                                          capsys)


def test_extra_layer_tensors_are_refused(hf_dir, tmp_path, capsys):
    _rewrite_config(hf_dir, n_layer=1)
    assert "unexpected tensors" in _convert_error(hf_dir, tmp_path / "o", capsys)


def test_unsupported_settings_are_named(hf_dir, tmp_path, capsys):
    _rewrite_config(hf_dir, activation_function="relu")
    assert "activation_function='relu' is not supported" in _convert_error(hf_dir,
                                                                          tmp_path / "o", capsys)


def test_rope_scaling_llama3_is_read_and_other_kinds_are_refused():
    """Llama 3's scaling (with its constants) maps to Megatron's flags; other kinds or other
    constants are refused by name (a silent fallback would change every rotary angle)."""
    from tpfuse.convert.llama import rope_scaling, rope_theta

    assert rope_theta({"rope_theta": 500000.0}) == 500000
    assert rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == 10000
    assert rope_scaling({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == {
        "use_rope_scaling": True, "rope_scaling_factor": 8.0}
    assert rope_scaling({"rope_parameters": {"rope_type": "default"}}) == {}
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        rope_scaling({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}})
    with pytest.raises(ValueError, match="high_freq_factor=2.0 is not supported"):
        rope_scaling({"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                          "high_freq_factor": 2.0}})


def test_wrong_directory_kinds_and_existing_output(hf_dir, tmp_path, capsys):
    root, _ = _tpfuse_checkpoint(tmp_path, GPT2, name="tp")
    assert "it looks like a tpfuse checkpoint" in _convert_error(root, tmp_path / "o", capsys)
    assert main(["--to-hf", "--load", str(hf_dir), "--save", str(tmp_path / "o")]) == 2
    assert "is a HuggingFace model directory" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert main(["--from-hf", str(hf_dir), "--save", str(tmp_path / "full")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path / "full") == ["keep.txt"]


def test_a_model_without_hf_counterpart_is_named(tmp_path, capsys):
    shape = dict(GPT2, position_embedding_type="rope")                # GPT-2 blocks with rope
    root, _ = _tpfuse_checkpoint(tmp_path, shape)
    assert main(["--to-hf", "--load", root, "--save", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "gpt2: position_embedding_type=rope (needs learned_absolute)" in err
    assert "llama: normalization=LayerNorm (needs RMSNorm)" in err
    assert not os.path.exists(tmp_path / "o")


# -------------------------------------------------------------------- training from a conversion
FINETUNE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--openai-gelu",
            "--mock-data", "--vocab-size", "49", "--make-vocab-size-divisible-by", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "0.0", "--eval-iters", "0", "--no-progress-bar", "--no-layout-table",
            "--tensor-model-parallel-size", "2"]


def test_finetune_starts_training_from_a_converted_checkpoint(run_distributed, tmp_path):
    """--finetune takes the weights (here at tp 2 from a tp 1 file); at lr 0 one step saves them
    back unchanged. Without --finetune the weights-only checkpoint is refused by name."""
    from tpfuse.checkpoint.reading import checkpoint_folder
    from tpfuse.checkpoint.reshard import assemble_global_state

    root, _ = _tpfuse_checkpoint(tmp_path, dict(GPT2, vocab_size=50))   # NullTokenizer(49): 50
    out = str(tmp_path / "finetuned")
    assert run_distributed(2, pretrain_error, FINETUNE + ["--load", root, "--finetune",
                                                          "--save", out]) == [None, None]
    before = assemble_global_state(*checkpoint_folder(root), optimizer=False)
    after = assemble_global_state(*checkpoint_folder(out), optimizer=False)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[n]["param"], before[n]["param"]) for n in before)
    errors = run_distributed(2, pretrain_error, FINETUNE + ["--load", root])
    assert all("holds model weights only" in e and "--finetune" in e for e in errors)


# ---------------------------------------------------------------- only files inside the folder
def test_export_never_copies_a_tokenizer_outside_the_checkpoint(tmp_path):
    from tpfuse.convert.tpfuse_io import write_checkpoint

    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    config = TransformerConfig(**GPT2, make_vocab_size_divisible_by=16, seed=5)
    model = GPTModel(config)
    params = {model.global_parameter_names()[n]: p.detach() for n, p in model.named_parameters()}
    for name, spec in (("abs", str(secret)), ("dotdot", "../secret.txt")):
        write_checkpoint(str(tmp_path / name), config, params, {"tokenizer": spec})
        export_hf(str(tmp_path / name), str(tmp_path / f"hf-{name}"))
        assert sorted(os.listdir(tmp_path / f"hf-{name}")) == ["config.json", "model.safetensors"]


def test_a_tokenizer_json_symlink_out_of_the_model_folder_is_refused(hf_dir, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    os.symlink(secret, hf_dir / "tokenizer.json")
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert "tokenizer" in message and "symlink leading out of" in message


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE"])
def test_index_entries_outside_the_model_folder_are_refused(hf_dir, tmp_path, capsys, entry):
    outside = tmp_path / "outside.safetensors"
    os.replace(hf_dir / "model.safetensors", outside)
    names = load_file(str(outside))
    entry = str(outside) if entry == "ABSOLUTE" else entry
    (hf_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: entry for name in names}}))
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert "is not a file name inside" in message and "'..' are refused" in message


def test_non_finite_and_twice_named_tensors_are_refused(hf_dir, tmp_path, capsys):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    name = "transformer.h.0.mlp.c_fc.weight"
    save_file({name: tensors[name].clone()}, str(hf_dir / "second.safetensors"),
              metadata={"format": "pt"})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model.safetensors" for n in tensors}, name: "second.safetensors"}}))
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert f"tensor {name!r} is in both" in message
    os.remove(hf_dir / "model.safetensors.index.json")
    _rewrite_tensors(hf_dir, lambda t: t[name].view(-1).__setitem__(3, float("nan")))
    message = _convert_error(hf_dir, tmp_path / "o2", capsys)
    assert name in message and "non-finite" in message


@pytest.mark.parametrize("field, value, need", [
    ("n_embd", "32", "a positive integer"), ("n_layer", 0, "a positive integer"),
    ("n_head", 2.5, "a positive integer"), ("layer_norm_epsilon", "tiny", "a positive finite"),
    ("resid_pdrop", 1.5, "in [0, 1)"), ("vocab_size", None, None)])
def test_malformed_config_fields_are_named(hf_dir, tmp_path, capsys, field, value, need):
    if value is None:
        config = _config(hf_dir)
        config.pop(field)
        (hf_dir / "config.json").write_text(json.dumps(config))
        assert f"lacks {field!r}" in _convert_error(hf_dir, tmp_path / "o", capsys)
        return
    _rewrite_config(hf_dir, **{field: value})
    message = _convert_error(hf_dir, tmp_path / "o", capsys)
    assert f"field {field!r}" in message and need in message


def test_a_fractional_rope_theta_converts(tmp_path):
    root, _ = _tpfuse_checkpoint(tmp_path, LLAMA)
    export_hf(root, str(tmp_path / "hf"))
    _rewrite_config(tmp_path / "hf", rope_theta=10000.5)
    config = import_hf(str(tmp_path / "hf"), str(tmp_path / "again"),
                       make_vocab_size_divisible_by=16)
    assert config.rotary_base == 10000.5
    (loaded,) = load_model(str(tmp_path / "again"))
    assert loaded.config.rotary_base == 10000.5


def test_a_qk_layernorm_model_has_no_hf_counterpart_yet():
    """The families tpfuse converts have no q / k norms: a qk-layernorm model is refused by
    each, naming the field (exporting it would drop the norms)."""
    from tpfuse.convert import gpt2, llama, mistral, qwen2
    from tpfuse.models import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                               ffn_hidden_size=32, seq_length=8, vocab_size=32,
                               normalization="RMSNorm", activation="swiglu",
                               position_embedding_type="rope", qk_layernorm=True)
    for family in (gpt2, llama, mistral, qwen2):
        assert "qk_layernorm=True (needs False: no q / k norms)" in family.mismatches(config)
