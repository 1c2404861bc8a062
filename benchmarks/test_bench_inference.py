"""CPU benchmarks of inference on one Llama-shaped model (random weights built by ``transformers``,
converted with ``tpfuse.convert.import_hf``, loaded with ``tpfuse.inference.load_model``):

- decode: ``generate`` of 64 new tokens for 4 prompts of 64 tokens, with the KV cache vs full
  recomputation every step (``use_cache=False``), and transformers' own ``generate`` (its KV cache)
  on the same weights as a peer;
- prefill: one forward over 4 × 512 tokens: tpfuse's model (all logits, and the generation prefill
  that fills a KV cache and keeps the last token's logits) vs transformers' model.

Run (pytest.ini disables benchmarks by default)::

    python3 -m pytest benchmarks/test_bench_inference.py --benchmark-enable -q -s \
        --benchmark-columns=median,min,rounds -p no:cacheprovider

pytest-benchmark prints each group's timings with the ratio to the group's fastest in parentheses;
``test_interleaved_ratios`` also times the implementations alternately (one round of each, then
the next round) and prints the median of the paired ratios, which drifting load on a shared
machine affects far less. The same tokens (decode) and logits (prefill) are checked across the
compared implementations in the same run. One intra-op thread everywhere (steadier under load).
"""
import os
import statistics
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from tpfuse.convert import import_hf  # noqa: E402
from tpfuse.inference import InferenceContext, generate, load_model  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 8, 2, 688, 2048
BATCH, PROMPT, NEW, PREFILL = 4, 64, 32, 512
ROUNDS = 5
PAIRED_ROUNDS = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("bench_inference")
    hf.save_pretrained(str(root / "hf"))
    import_hf(str(root / "hf"), str(root / "tpfuse"))
    (ours,) = load_model(str(root / "tpfuse"))
    return ours, hf


def _prompts():
    return torch.randint(1, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


DECODE = {
    "tpfuse_kv_cache": lambda ours, hf, p: generate(ours, p, NEW, greedy=True),
    "tpfuse_recompute": lambda ours, hf, p: generate(ours, p, NEW, greedy=True, use_cache=False),
    "transformers_generate": lambda ours, hf, p: hf.generate(
        p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, min_new_tokens=NEW,
        do_sample=False)[:, PROMPT:].tolist(),
}


@pytest.mark.parametrize("impl", list(DECODE))
def test_decode(benchmark, models, impl):
    benchmark.group = f"decode b{BATCH} prompt {PROMPT} +{NEW} tokens, Llama h{HIDDEN} " \
                      f"{LAYERS} layers GQA {HEADS}/{KV_HEADS}, fp32 CPU"
    ours, hf = models
    prompts = _prompts()
    with torch.no_grad():
        tokens = benchmark.pedantic(DECODE[impl], (ours, hf, prompts), rounds=ROUNDS,
                                    warmup_rounds=1)
        reference = generate(ours, prompts, NEW, greedy=True)
    assert tokens == reference                         # the same continuations everywhere
    seconds = benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = BATCH * NEW / seconds
    print(f"\n{impl}: {BATCH * NEW / seconds:.0f} new tokens/s (median {seconds * 1e3:.0f} ms)")


def _tpfuse_prefill_cache(ours, hf, ids):
    context = InferenceContext(ids.shape[0], ids.shape[1])
    return ours(ids, inference_context=context)        # (b, 1, V): the last token's logits


PREFILL_IMPLS = {
    "tpfuse_forward": lambda ours, hf, ids: ours(ids)[..., :VOCAB],
    "tpfuse_prefill_kv_cache": _tpfuse_prefill_cache,
    "transformers_forward": lambda ours, hf, ids: hf(ids).logits,
}


@pytest.mark.parametrize("impl", list(PREFILL_IMPLS))
def test_prefill(benchmark, models, impl):
    benchmark.group = f"prefill b{BATCH} s{PREFILL}, Llama h{HIDDEN} {LAYERS} layers GQA " \
                      f"{HEADS}/{KV_HEADS}, fp32 CPU"
    ours, hf = models
    ids = torch.randint(1, VOCAB, (BATCH, PREFILL), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = benchmark.pedantic(PREFILL_IMPLS[impl], (ours, hf, ids), rounds=ROUNDS,
                                    warmup_rounds=1)
        expected = hf(ids).logits
    # fp32, same weights: only the order of operations differs (see tests/convert/test_hf_conversion.py)
    torch.testing.assert_close(logits[..., :VOCAB], expected[:, -logits.shape[1]:], rtol=1e-4,
                               atol=1e-4)


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


PAIRS = {  # (numerator, denominator) of each reported time ratio, > 1: the denominator is faster
    "decode: recompute / KV cache": (DECODE, "tpfuse_recompute", "tpfuse_kv_cache", _prompts),
    "decode: transformers generate / tpfuse KV cache": (DECODE, "transformers_generate",
                                                        "tpfuse_kv_cache", _prompts),
    "prefill: transformers / tpfuse forward": (PREFILL_IMPLS, "transformers_forward",
                                               "tpfuse_forward", None),
}


def test_interleaved_ratios(benchmark, models):
    ours, hf = models
    ids = torch.randint(1, VOCAB, (BATCH, PREFILL), generator=torch.Generator().manual_seed(2))
    ratios = {name: [] for name in PAIRS}

    def alternate():
        with torch.no_grad():
            for _ in range(PAIRED_ROUNDS):
                for name, (impls, slow, fast, inputs) in PAIRS.items():
                    args = (ours, hf, inputs() if inputs else ids)
                    ratios[name].append(_timed(impls[slow], *args) / _timed(impls[fast], *args))

    benchmark.group = "interleaved (whole paired run)"
    benchmark.pedantic(alternate, rounds=1, iterations=1)
    for name, values in ratios.items():
        assert all(v > 0 for v in values)
        print(f"\n  interleaved {name} = {statistics.median(values):.2f}x "
              f"(paired ratios {min(values):.2f}-{max(values):.2f})")
