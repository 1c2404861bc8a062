"""Mixture-of-experts checkpoints through generation: trained at tp2 + SP with ep2, loaded at any
tp × pp (× ep), with or without sequence parallelism, and the trainer's ``--sample-prompt`` on
every rank of an ep run.

Reference: the single-process model loaded from the same checkpoint (its experts re-joined from
the ep / etp shards). Greedy tokens are compared exactly: every layout runs the same fp32 weights
through the same operations up to summation order (TP partial sums, the expert-tensor-parallel
reduce-scatter), ~1e-7 relative, while the trained tiny model's top-two logit gaps are ≥ 1e-4
(checked below), so a routing or weight-cutting error changes tokens and rounding does not.
The same checkpoint exported with ``tpfuse-convert --to-hf`` gives transformers' Mixtral the
same greedy tokens.
"""
import pytest
import torch

from support.pretrain_run import run_pretrain
from tpfuse.inference import generate, load_model

PROMPTS = [[10, 20, 30, 40, 50], [7], [99, 3, 42]]
STEPS = 5

TRAIN = [  # 4 experts top-2 (all-gather dispatcher), tp2 + SP, ep2: world 4
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--ffn-hidden-size", "32", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
    "--seq-length", "16", "--tokenizer-type", "ByteTokenizer", "--make-vocab-size-divisible-by",
    "8", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--mock-data",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
    "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000", "--no-progress-bar",
    "--no-layout-table", "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--expert-model-parallel-size", "2", "--sample-prompt", "def ", "--sample-max-new-tokens", "4",
]


def _pretrain(argv):
    return run_pretrain(argv, with_sampling=True).sample


@pytest.fixture(scope="module")
def trained_run(run_distributed, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_inference") / "ckpt")
    return root, run_distributed(4, _pretrain, TRAIN + ["--save", root])


@pytest.fixture(scope="module")
def single(trained_run):
    (model,) = load_model(trained_run[0])
    return model, generate(model, PROMPTS, STEPS, greedy=True)


def _generate_at(root, tp, pp, ep, sp=False):
    from tpfuse.parallel import parallel_state

    state = parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    chunks = load_model(root, state, sequence_parallel=sp)
    assert all(chunk.config.sequence_parallel == sp for chunk in chunks)
    return generate(chunks, PROMPTS, STEPS, greedy=True, state=state)


def test_single_process_load_joins_the_expert_shards(trained_run, single):
    from tpfuse.checkpoint.reading import checkpoint_folder
    from tpfuse.checkpoint.reshard import assemble_global_state

    model, tokens = single
    saved = assemble_global_state(*checkpoint_folder(trained_run[0]), optimizer=False)
    names = model.global_parameter_names()
    experts = [local for local in names if "experts" in local]
    assert experts
    for local, param in model.named_parameters():
        assert torch.equal(param, saved[names[local]]["param"]), local
    assert all(len(t) == STEPS for t in tokens)
    with torch.no_grad():                   # the greedy choices are well separated (see top)
        logits = model(torch.tensor([PROMPTS[0]]), torch.arange(5)[None])[0, -1]
    top2 = logits[:257].topk(2).values
    assert float(top2[0] - top2[1]) > 1e-4


LAYOUTS = {"tp2": (2, 2, 1, 1), "pp2": (2, 1, 2, 1), "ep2": (2, 1, 1, 2),
           "tp2-ep2": (4, 2, 1, 2),
           # the prefill split over TP (the MoE layers route each rank's s/2 tokens), decode
           # steps without SP
           "tp2-sp": (2, 2, 1, 1, True), "tp2-ep2-sp": (4, 2, 1, 2, True)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_generation_is_the_same_at_every_layout(run_distributed, trained_run, single,
                                                    layout):
    world, *sizes = LAYOUTS[layout]
    per_rank = run_distributed(world, _generate_at, trained_run[0], *sizes)
    assert per_rank == [single[1]] * world


def test_sample_prompt_after_an_expert_parallel_run_joins_every_rank(trained_run, single):
    """Every rank of the ep2 run decoded the sample together (no replica skipped the experts'
    collectives) and got the continuation the saved model gives."""
    from tpfuse.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    (tokens,) = generate(single[0], [tokenizer.tokenize("def ")], 4, greedy=True,
                         eos_id=tokenizer.eod)
    assert trained_run[1] == ["def " + tokenizer.detokenize(tokens)] * 4


def test_generate_cli_checks_the_expert_parallel_size_before_any_group(trained_run, tmp_path,
                                                                      monkeypatch, capsys):
    from tpfuse.inference.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--prompt-ids", "1", "--max-new-tokens", "1", "--expert-model-parallel-size", "3"]
    assert main(["--load", trained_run[0]] + base) == 2
    assert "does not divide the checkpoint's 4 experts" in capsys.readouterr().err
    assert main(["--load", trained_run[0]] + base + ["--nproc-per-node", "2"]) == 2
    assert "--expert-model-parallel-size = 3" in capsys.readouterr().err


def test_expert_parallel_checkpoint_exported_to_hf_generates_the_same_tokens(trained_run, single,
                                                                            tmp_path):
    """tpfuse-convert --to-hf of the tp2 + SP, ep2 checkpoint: transformers' Mixtral greedy
    tokens equal tpfuse's (tolerance argument: tests/convert/test_hf_mixtral.py)."""
    transformers = pytest.importorskip("transformers")
    from tpfuse.convert.cli import main

    assert main(["--to-hf", "--load", trained_run[0], "--save", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                                eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    assert expected == single[1]
