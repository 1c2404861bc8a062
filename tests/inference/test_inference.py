"""Inference: the KV cache against full recomputation, load_model at any layout, generate.

References: the training forward of the same model (no cache, no padding) for logits; per-prompt
full recomputation for greedy continuations; the checkpoint's own single-process tensors
(``assemble_global_state``) for loaded weights.

Tolerances: cached and recomputed logits come from the same fp32 weights through different but
equivalent computations (an explicit softmax over the cache vs the training attention path, other
GEMM shapes), so they differ only by fp32 rounding: ~1e-7 relative per operation over a few
layers of width ≤ 64, far below 1e-5; a cache written at the wrong position, a missed mask or a
wrong rotary angle moves logits by ~1e-2 or more. Greedy tokens are compared exactly: the trained
model's top-two logit gaps are many orders of magnitude above that rounding.
"""
import pytest
import torch

from support.pretrain_run import run_pretrain
from tpfuse.inference import InferenceContext, generate, load_model
from tpfuse.models import GPTModel, TransformerConfig

PROMPTS = [[10, 20, 30, 40, 50], [7], [99, 3, 42]]       # different lengths: left padding
STEPS = 6

TRAIN = [  # a GQA / rope / RMSNorm / SwiGLU / untied model, trained 3 steps at tp2 pp2 vpp2 + SP
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--ffn-hidden-size", "64", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--seq-length", "16", "--tokenizer-type",
    "ByteTokenizer",
    "--make-vocab-size-divisible-by", "8", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-2", "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000",
    "--no-progress-bar", "--no-layout-table", "--tensor-model-parallel-size", "2",
    "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
    "--sequence-parallel", "--sample-prompt", "def ", "--sample-max-new-tokens", "6",
    "--sample-temperature", "0.8", "--sample-top-k", "5", "--sample-seed", "7",
]


def _pretrain(argv):
    return run_pretrain(argv, with_sampling=True).sample


@pytest.fixture(scope="module")
def trained_run(run_distributed, tmp_path_factory):
    """(checkpoint dir, the end-of-training sample of every rank)."""
    root = str(tmp_path_factory.mktemp("inference") / "ckpt")
    samples = run_distributed(4, _pretrain, TRAIN + ["--save", root])
    return root, samples


@pytest.fixture(scope="module")
def trained(trained_run):
    return trained_run[0]


def _config(**overrides):
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24,
                  vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0, seed=3)
    return TransformerConfig(**{**values, **overrides})


SHAPES = {
    "gpt": {},
    "llama-gqa": dict(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True),
    # the cache holds the normalised, rotated keys
    "qwen3-qk-layernorm": dict(num_query_groups=2, position_embedding_type="rope",
                               normalization="RMSNorm", activation="swiglu",
                               add_bias_linear=False, qk_layernorm=True,
                               untie_embeddings_and_output_weights=True),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_prefill_and_decode_steps_equal_the_full_forward(shape):
    model = GPTModel(_config(**SHAPES[shape])).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)                                           # (b, s, V)
        context = InferenceContext(2, 9, materialize_only_last_token_logits=False)
        steps = []
        for start, end in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9)):
            steps.append(model(ids[:, start:end], inference_context=context))
            context.increment_sequence_len_offset(end - start)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_left_padding_does_not_change_a_sequence(shape):
    """A prompt padded on the left inside a batch gives the logits it gives alone."""
    model = GPTModel(_config(**SHAPES[shape])).eval()
    short, long = [5, 6, 7], [1, 2, 3, 4, 8, 9]
    with torch.no_grad():
        alone = model(torch.tensor([short]))[0, -1]
        context = InferenceContext(2, 8)
        context.set_left_padding([3, 0])
        batch = torch.tensor([[0, 0, 0] + short, long])
        positions = torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
        padded = model(batch, positions, inference_context=context)[0, -1]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_bad_generation_input_is_a_clear_error():
    model = GPTModel(_config()).eval()
    with pytest.raises(ValueError, match=r"ids \[100\] are outside the vocabulary \[0, 100\)"):
        generate(model, [[1, 100]], 2)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=24"):
        generate(model, [[1] * 20], 5)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match="greedy=True cannot be combined"):
        generate(model, [[1]], 2, greedy=True, top_k=3)
    with pytest.raises(ValueError, match="temperature=0"):
        generate(model, [[1]], 2, temperature=0)


def test_padded_vocabulary_ids_are_never_generated():
    """Padded rows hold the largest logits here; greedy and sampling must still skip them."""
    model = GPTModel(_config(vocab_size=90, make_vocab_size_divisible_by=128)).eval()
    with torch.no_grad():
        model.embedding.word_embeddings.weight[90:] = 5.0      # tied: padded logits dominate
    for kwargs in (dict(greedy=True), dict(temperature=2.0, seed=1)):
        tokens = generate(model, [[10, 20, 30], [7]], STEPS, **kwargs)
        assert all(0 <= t < 90 for seq in tokens for t in seq), tokens


def test_eos_stops_a_sequence():
    model = GPTModel(_config()).eval()
    free = generate(model, PROMPTS, STEPS, greedy=True)
    eos = free[0][2]
    stopped = generate(model, PROMPTS, STEPS, greedy=True, eos_id=eos)
    for tokens, reference in zip(stopped, free):
        cut = reference.index(eos) + 1 if eos in reference else len(reference)
        assert tokens == reference[:cut]


# -------------------------------------------------------------------- a trained checkpoint
def test_load_model_holds_the_checkpoint_weights(trained):
    """Single process from a tp2 pp2 vpp2 checkpoint: every tensor equal (resharding moves
    values)."""
    from tpfuse.checkpoint.reading import checkpoint_folder
    from tpfuse.checkpoint.reshard import assemble_global_state

    (model,) = load_model(trained)
    saved = assemble_global_state(*checkpoint_folder(trained))
    names = model.global_parameter_names()
    loaded = dict(model.named_parameters())
    assert sorted(names[n] for n in loaded) == sorted(saved)
    for local, param in loaded.items():
        assert torch.equal(param, saved[names[local]]["param"]), local
    assert model.config.sequence_parallel is False and model.config.padded_vocab_size == 272


def _generate_at(root, tp, pp, vpp, sp=False):
    from tpfuse.parallel import parallel_state

    state = parallel_state.initialize_model_parallel(tp, pp, vpp)
    chunks = load_model(root, state, sequence_parallel=sp)
    assert all(chunk.config.sequence_parallel == sp for chunk in chunks)
    cached = generate(chunks, PROMPTS, STEPS, greedy=True, state=state)
    recomputed = [generate(chunks, [p], STEPS, greedy=True, use_cache=False, state=state)[0]
                  for p in PROMPTS]
    sampled = generate(chunks, PROMPTS, STEPS, temperature=0.9, top_k=50, top_p=0.95, seed=11,
                       state=state)
    return cached, recomputed, sampled


LAYOUTS = {"tp2": (2, 2, 1, None), "pp2-vpp2": (2, 1, 2, 2), "tp2-pp2": (4, 2, 2, None),
           # sequence parallelism: the prefill (prompts left-padded to a multiple of tp) split
           # over TP — across the pipeline the stages exchange (s/tp, b, h) — the decode steps
           # and the odd-length recomputations without it
           "tp2-pp2-sp": (4, 2, 2, None, True)}


@pytest.fixture(scope="module")
def single_process(trained):
    return _generate_at_single(trained)


def _generate_at_single(root):
    (model,) = load_model(root)
    cached = generate(model, PROMPTS, STEPS, greedy=True)
    recomputed = [generate(model, [p], STEPS, greedy=True, use_cache=False)[0] for p in PROMPTS]
    return cached, recomputed


def test_single_process_kv_cache_equals_recomputation(single_process):
    cached, recomputed = single_process
    assert cached == recomputed
    assert all(len(tokens) == STEPS for tokens in cached)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kv_cache_generation_equals_recomputation(run_distributed, trained, single_process,
                                                  layout):
    world, *sizes = LAYOUTS[layout]
    per_rank = run_distributed(world, _generate_at, trained, *sizes)
    cached, recomputed, sampled = per_rank[0]
    assert cached == recomputed == single_process[0]
    for other in per_rank[1:]:                 # every rank returns the same tokens
        assert other == per_rank[0]
    assert all(0 <= t < 257 for seq in sampled for t in seq)


def _check_sequence_parallel_switch():
    """Under tp2 + SP: ``sequence_parallel_disabled`` turns every flag the modules read off and
    back on; a cached step TP cannot split is refused by name before any collective."""
    from tpfuse.inference.sequence_parallel import _flagged, sequence_parallel_disabled
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(tp=2)
    try:
        model = GPTModel(_config(tensor_model_parallel_size=2, sequence_parallel=True),
                         state=state).eval()
        flags = _flagged([model])
        assert len(flags) > 10 and all(value for _, value in flags)
        with sequence_parallel_disabled([model]):
            assert not any(owner.sequence_parallel for owner, _ in flags)
        assert all(owner.sequence_parallel for owner, _ in flags)
        context = InferenceContext(1, 8)
        with pytest.raises(ValueError, match="inference step of 3 tokens with "
                                             "sequence_parallel=True: tp=2 must divide it"):
            model(torch.tensor([[1, 2, 3]]), inference_context=context)
    finally:
        state.destroy()


def test_sequence_parallel_is_switched_off_and_on_for_steps_tp_cannot_split(run_distributed):
    run_distributed(2, _check_sequence_parallel_switch)


# -------------------------------------------------------------------- the trainer's sample, the CLI
def _greedy_text(root, prompt, steps, **decoding):
    from tpfuse.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    (model,) = load_model(root)
    (tokens,) = generate(model, [tokenizer.tokenize(prompt)], steps, eos_id=tokenizer.eod,
                         **(decoding or {"greedy": True}))
    return tokens, tokenizer.detokenize(tokens)


def test_training_ends_with_a_sample_of_the_trained_model(trained_run):
    """--sample-prompt with --sample-temperature / -top-k / -seed: the continuation the trainer
    printed is the saved model's, sampled with the same settings and seed."""
    root, samples = trained_run
    _, text = _greedy_text(root, "def ", 6, temperature=0.8, top_k=5, seed=7)
    assert samples == ["def " + text] * 4          # every rank of the dp-0 replica returns it
    _, other_seed = _greedy_text(root, "def ", 6, temperature=0.8, top_k=5, seed=8)
    _, greedy = _greedy_text(root, "def ", 6)
    assert len({text, other_seed, greedy}) > 1     # the settings reach the decoder


def test_trainer_given_no_sample_function_refuses_sample_prompt_before_any_group():
    """The trainer imports no inference: --sample-prompt needs the function pretrain_gpt passes,
    and without it the run fails at once, before torch.distributed is touched."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="--sample-prompt 'def ' needs a sample function"):
        run_pretrain(TRAIN)
    assert not dist.is_initialized()


def test_generate_cli_in_process_and_on_two_ranks(trained, monkeypatch, capsys):
    import json
    import os
    import subprocess
    import sys

    from tpfuse.inference.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tokens, text = _greedy_text(trained, "x = ", 5)
    argv = ["--load", trained, "--prompt", "x = ", "--max-new-tokens", "5", "--greedy", "--json"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    expected = {"prompt_ids": [120, 32, 61, 32], "generated_ids": tokens, "text": text}
    assert json.loads(line) == expected
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-m", "tpfuse.inference.cli", "--load", trained, "--prompt-ids",
         "120 32 61 32", "--max-new-tokens", "5", "--greedy", "--json", "--nproc-per-node", "2",
         "--tensor-model-parallel-size", "2", "--sequence-parallel"], capture_output=True,
        text=True, timeout=300,
        env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(out) for out in done.stdout.splitlines()] == [expected]


@pytest.mark.parametrize("argv, message", [
    (["--greedy", "--top-k", "5"], "--greedy cannot be combined with --top-k"),
    (["--nproc-per-node", "3"], "--nproc-per-node 3 must equal"),
    (["--prompt-ids", "1 x"], "expected integers"),
])
def test_generate_cli_bad_input_is_one_line(trained, monkeypatch, capsys, argv, message):
    from tpfuse.inference.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--load", trained, "--max-new-tokens", "2"]
    if "--prompt-ids" not in argv:
        base += ["--prompt", "a"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpfuse-generate: error:") and message in err[0]


def test_generate_cli_names_a_missing_checkpoint(tmp_path, monkeypatch, capsys):
    from tpfuse.inference.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--load", str(tmp_path), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "holds no complete tpfuse checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_temperature_is_refused_clearly(value):
    from tpfuse.inference.sampling import SamplingParams

    with pytest.raises(ValueError, match="must be a finite number > 0"):
        SamplingParams(temperature=value)
