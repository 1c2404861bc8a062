"""The invariance test: any parallel layout reproduces the single-process loss curve.

In fp32 on CPU with dropout off, the same model, seed and data give the same per-iteration loss
(within 1e-5 relative) for 10 iterations under every layout below, whatever the vocabulary padding
(which grows with tp), with the real ``pretrain`` loop
(pipeline schedule, DP gradient sync, tied-embedding sync, global-norm clipping, AdamW). Only the
order of floating-point sums differs between layouts (TP splits GEMM reductions, DP averages
partial gradients, pipelines accumulate micro-batches in another order, context parallelism merges
partial softmaxes by their logsumexp and sums dK/dV round the ring), which moves fp32 results
by ~1e-7 relative per step; 1e-5 leaves room for 10 AdamW steps to amplify that, while a wrong
gradient (a missed all-reduce, a dropped layer, a swapped micro-batch) moves the loss by far more.
"""
import os

import pytest

from support.pretrain_run import train_losses

TINY_MODEL = [
    # 4 layers hold every layout below but pp 4 × vpp 2 (8 virtual stages); that case, the
    # first-k-dense pattern and the q / k layernorm section (its mutation measured at 8) add
    # "--num-layers", "8" (argparse keeps the last value)
    "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
    "--ffn-hidden-size", "32", "--seq-length", "8", "--max-position-embeddings", "8",
    # 64 token ids, padded Megatron's way to 128 rows at tp=1 and 256 at tp=2: the padded rows
    # are masked out of the loss, so every layout below trains the same model
    "--vocab-size", "63",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "7",
    "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "10", "--lr-decay-iters", "10", "--lr", "3e-3", "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000",
    "--no-progress-bar", "--no-layout-table",
]


def _losses(run_distributed, world_size, argv, model=None):
    return train_losses(run_distributed, world_size,
                        (TINY_MODEL if model is None else model) + list(argv))


@pytest.fixture(scope="module")
def reference(run_distributed):
    losses = _losses(run_distributed, 1, [])
    assert len(losses) == 10
    assert losses[-1] < losses[0]  # it trains at all
    return losses


def _parallel(tp=1, pp=1, vpp_layers=None, sp=False, cp=1, cp_comm_type="p2p"):
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if vpp_layers:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers)]
    if sp:
        argv += ["--sequence-parallel"]
    if cp > 1:  # the sequence of 8 in 2·cp chunks (of 1 token per tp rank with tp2 × cp2 + SP)
        argv += ["--context-parallel-size", str(cp), "--cp-comm-type", cp_comm_type]
    return argv


DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                         "--ddp-bucket-size", "2000"]

FSDP_ZERO2 = ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads"]
FSDP_ZERO3 = ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", "optim_grads_params"]

LAYOUTS = {
    # name: (world size, flags)
    "tp2": (2, _parallel(tp=2)),
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "pp2": (2, _parallel(pp=2)),
    "pp2-vpp2": (2, _parallel(pp=2, vpp_layers=1)),
    "dp2": (2, _parallel()),
    "tp2-pp2-zb-h1-sp": (4, _parallel(tp=2, pp=2, sp=True) + ["--pipeline-schedule", "zb-h1"]),
    "tp2-full-recompute-distributed": (2, _parallel(tp=2) + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "2", "--distribute-saved-activations"]),
    "pp2-selective-recompute-sp": (4, _parallel(tp=2, pp=2, sp=True) + [
        "--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp"]),
    "tp2-pp2-dp2-vpp2-sp": (8, _parallel(tp=2, pp=2, vpp_layers=1, sp=True)),
    # the distributed optimizer (ZeRO-1): small buckets so gradients are reduce-scattered bucket
    # by bucket during backward and parameters all-gathered during the next forward
    "dp4-distopt": (4, _parallel() + DISTRIBUTED_OPTIMIZER),
    # ... and with ZB-H1, whose W actions accumulate deferred weight gradients into main_grad
    # after the backward pass that started them: a bucket waits for them
    "tp2-pp2-dp2-zb-h1-distopt": (8, _parallel(tp=2, pp=2) + DISTRIBUTED_OPTIMIZER
                                  + ["--overlap-param-gather", "--pipeline-schedule", "zb-h1"]),
    # context parallelism, one comm type each (tp2 × cp2 + SP with the ring: the corpus test)
    "cp2": (2, _parallel(cp=2)),
    "pp2-cp2-allgather": (4, _parallel(pp=2, cp=2, cp_comm_type="all_gather")),
    "dp2-cp2-a2a": (4, _parallel(cp=2, cp_comm_type="a2a")),
    # FSDP2 (fully_shard over dp x cp): ZeRO-2 keeps gathered parameters over the step, ZeRO-3
    # gathers them again; both accumulate unsharded and reduce-scatter in the last backward
    "dp2-fsdp-zero2": (2, _parallel() + FSDP_ZERO2),
    "dp2-fsdp-zero3": (2, _parallel() + FSDP_ZERO3),
    "dp4-fsdp-zero3": (4, _parallel() + FSDP_ZERO3),
    # TP shards are FSDP's local tensors; SP's replicated norm weights are counted on tp rank 0
    "tp2-sp-dp2-fsdp-zero2": (4, _parallel(tp=2, sp=True) + FSDP_ZERO2),
    # every virtual chunk its own FSDP root; the tied embedding's shards summed first <-> last
    "pp2-vpp2-dp2-fsdp-zero3": (4, _parallel(pp=2, vpp_layers=1) + FSDP_ZERO3),
    # sharded over dp x cp: the context-parallel ranks are FSDP ranks too
    "cp2-dp2-fsdp-zero3": (4, _parallel(cp=2) + FSDP_ZERO3),
    # zero bubble: W adds deferred weight gradients after the I passes, the reduce-scatter after
    # the schedule; ZeRO-3's W computes on weights re-sharded since their I pass
    "pp2-dp2-zb-h1-fsdp-zero2": (4, _parallel(pp=2) + ["--pipeline-schedule", "zb-h1"]
                                 + FSDP_ZERO2),
    "pp2-dp2-zb-h1-fsdp-zero3": (4, _parallel(pp=2) + ["--pipeline-schedule", "zb-h1"]
                                 + FSDP_ZERO3),
    # recompute re-runs units' forwards inside backward (FSDP neither re-shards nor re-records)
    "dp2-full-recompute-fsdp-zero3": (2, _parallel() + FSDP_ZERO3 + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]),
    "dp2-selective-recompute-fsdp-zero2": (2, _parallel() + FSDP_ZERO2 + [
        "--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_reproduces_single_process_losses(run_distributed, reference, name):
    world_size, argv = LAYOUTS[name]
    losses = _losses(run_distributed, world_size, argv)
    assert losses == pytest.approx(reference, rel=FSDP_REL if "fsdp" in name else 1e-5)


EIGHT_LAYERS = ["--num-layers", "8"]


def test_four_interleaved_stages_reproduce_single_process_losses(run_distributed):
    """pp 4 × vpp 2 needs 8 layers (one per virtual stage): the model above with 8, against its
    own single process."""
    single = _losses(run_distributed, 1, EIGHT_LAYERS)
    losses = _losses(run_distributed, 4, EIGHT_LAYERS + _parallel(pp=4, vpp_layers=1))
    assert single[-1] < single[0]
    assert losses == pytest.approx(single, rel=1e-5)


# FSDP reorders only fp32 sums (autograd adds each micro-batch's weight gradient to the
# accumulated one where the buffers' GEMM accumulates in place; a reduce-scatter's block order):
# measured 1.2e-7 relative in every FSDP layout above, as plain dp2; 1e-6 keeps a factor 8
FSDP_REL = 1e-6


MIXED_PRECISION = {
    # name: (world size, flags, unit roundoff u of the 16-bit format)
    "bf16-tp2-sp": (2, ["--bf16"] + _parallel(tp=2, sp=True), 2.0**-8),
    "fp16-pp2": (2, ["--fp16", "--initial-loss-scale", "65536"] + _parallel(pp=2), 2.0**-11),
    # bf16 gradient buffers, reduced in bf16 over dp, upcast per shard: each accumulated gradient
    # is rounded (≤ u relative), which moves each Adam update by ~u relative, i.e. the loss by ~u
    # of the run's 3.7 % decrease, far below the forward's 0.1u (measured 6.4e-5 ≈ u/61)
    "bf16-dp2-grad-reduce-in-bf16-distopt": (2, ["--bf16", "--grad-reduce-in-bf16"] + _parallel()
                                             + DISTRIBUTED_OPTIMIZER, 2.0**-8),
    # dynamic loss scaling over the distributed optimizer's shards (unscale, norm, skip per shard)
    "fp16-dp2-distopt": (2, ["--fp16", "--initial-loss-scale", "65536"] + _parallel()
                         + DISTRIBUTED_OPTIMIZER, 2.0**-11),
    # FSDP's mixed precision: bf16 compute, fp32 reduce-scatter and fp32 sharded masters
    "bf16-dp2-fsdp-zero3": (2, ["--bf16"] + _parallel() + FSDP_ZERO3, 2.0**-8),
    # the loss scaler over FSDP's shards (unscale, norm, skip per shard)
    "fp16-dp2-fsdp-zero2": (2, ["--fp16", "--initial-loss-scale", "65536"] + _parallel()
                            + FSDP_ZERO2, 2.0**-11),
}


@pytest.mark.parametrize("name", sorted(MIXED_PRECISION))
def test_mixed_precision_tracks_fp32(run_distributed, reference, name):
    """A bf16 / fp16 run follows the fp32 curve within u/4 relative.

    Where the 16-bit run differs: every stored activation and weight is rounded (relative error
    ≤ u). The per-token loss logsumexp(z) − z_y moves by at most 2‖δz‖∞; independent roundings
    along the logit's path (two residual-branch outputs per layer, embedding, final norm, logits:
    2L + 3 = 11) add up to ‖δz‖ ≈ √11·u·|z|, with |z| ≤ 0.5 for this model's logits (tied
    embedding of std 0.02 against a LayerNorm output over h = 16), and the step's loss averages
    N = 64 independent tokens: |δloss| ≈ 2·√11·u·0.5/√64 ≈ 0.41u, i.e. ≈ 0.1u relative to the
    loss ≈ ln 64 ≈ 4.2; u/4 leaves a factor 2.5. (Measured: bf16 ≤ 6.4e-5 ≈ u/61, fp16 ≤ 8.1e-6
    ≈ u/60.) Lost updates or a wrong loss scale move the curve by a share of the run's 3.7 %
    loss decrease, 38× above u/4 for bf16 (9.8e-4); the tiny-lr test (test_mixed_precision.py)
    isolates lost updates.
    """
    world_size, argv, unit_roundoff = MIXED_PRECISION[name]
    losses = _losses(run_distributed, world_size, argv)
    assert losses == pytest.approx(reference, rel=unit_roundoff / 4)


@pytest.fixture(scope="module")
def bf16_reference(run_distributed):
    return _losses(run_distributed, 1, ["--bf16"])


BF16_LAYOUTS = {
    # name: (world size, flags besides --bf16, relative tolerance against one bf16 process)
    # Data parallelism only: every micro-batch runs the same bf16 operations on the same bf16
    # weights as in the single process; only the order of the fp32 gradient sums (micro-batches,
    # then ranks) differs, exactly as in the fp32 layouts above, and a bf16 weight differs only
    # where its fp32 main copy lies within that ~1e-7 of a bf16 rounding midpoint (a few weights,
    # by one bf16 ulp). So the fp32 invariance bound holds. (Measured: 2.3e-7.)
    "dp4-distopt": (4, _parallel() + DISTRIBUTED_OPTIMIZER, 1e-5),
    # Tensor parallelism rounds partial GEMM sums to bf16 in another place: each run's curve is
    # off the exact one by ≈ 0.13u (test_mixed_precision_tracks_fp32's derivation), independently,
    # so the two differ by ≈ √2 · 0.1u ≈ 0.14u < u/4. (Measured: 4.2e-5 ≈ u/93.) A shard whose
    # main copy is not copied back or gathered, or moments on the wrong elements, move the curve by
    # a share of its 3.7 % decrease, ≥ 38× more.
    "tp2-dp2-distopt-param-gather": (4, _parallel(tp=2) + DISTRIBUTED_OPTIMIZER
                                     + ["--overlap-param-gather"], 2.0**-8 / 4),
}


@pytest.mark.parametrize("name", sorted(BF16_LAYOUTS))
def test_bf16_layout_reproduces_single_process_bf16(run_distributed, bf16_reference, name):
    """bf16 with the distributed optimizer at dp > 1 against one bf16 process (fp32 main
    parameters, fp32 gradient buffers reduced over dp, sharded Adam)."""
    world_size, argv, tolerance = BF16_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, ["--bf16"] + argv)
    assert losses == pytest.approx(bf16_reference, rel=tolerance)


def test_rampup_batch_sizes_match_single_process(run_distributed):
    rampup = ["--rampup-batch-size", "4", "4", "16"]
    single = _losses(run_distributed, 1, rampup)
    layout = _losses(run_distributed, 8, rampup + _parallel(tp=2, pp=2))
    assert layout == pytest.approx(single, rel=1e-5)


def test_checkpoint_resume_reproduces_uninterrupted_run(run_distributed, reference, tmp_path):
    layout = _parallel(tp=2, pp=2, vpp_layers=1, sp=True)
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    first = _losses(run_distributed, 4, layout + save + ["--train-iters", "4"])
    resumed = _losses(run_distributed, 4,
                      layout + save + ["--load", str(tmp_path / "ckpt")])
    assert os.path.exists(tmp_path / "ckpt" / "iter_0000010")
    assert first + resumed == pytest.approx(reference, rel=1e-5)


def test_distributed_optimizer_resumes_exactly_and_reshards_dp4_to_dp2(run_distributed, reference,
                                                                        tmp_path):
    """4 iterations at dp=4 with the distributed optimizer (each rank saves its quarter of the
    fp32 state), 3 more resumed at dp=4 from the 4-iteration checkpoint (each rank restores its
    own shard), then the last 3 at dp=2 from the 7-iteration one (the shards are reassembled and
    cut in halves): the 10 losses are the single-process curve."""
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 4, DISTRIBUTED_OPTIMIZER + save + ["--train-iters", "4"])
    same = _losses(run_distributed, 4, DISTRIBUTED_OPTIMIZER + save + ["--train-iters", "7"])
    halved = _losses(run_distributed, 2, DISTRIBUTED_OPTIMIZER + save)
    assert (len(first), len(same), len(halved)) == (4, 3, 3)
    assert first + same + halved == pytest.approx(reference, rel=1e-5)


def test_fsdp_resumes_exactly_and_reshards_dp4_to_dp2_to_no_fsdp(run_distributed, reference,
                                                                  tmp_path):
    """FSDP checkpoints hold whole TP shards (gathered) and the optimizer's row-block pieces:
    4 iterations at dp 4 with ZeRO-3, 2 more resumed at the same layout (each rank its own file),
    2 at dp 2 with ZeRO-2 (resharded), the last 2 at dp 2 without FSDP (plain data parallelism,
    whole-parameter state rebuilt from the pieces): the 10 losses are the single-process curve."""
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 4, FSDP_ZERO3 + save + ["--train-iters", "4"])
    same = _losses(run_distributed, 4, FSDP_ZERO3 + save + ["--train-iters", "6"])
    halved = _losses(run_distributed, 2, FSDP_ZERO2 + save + ["--train-iters", "8"])
    plain = _losses(run_distributed, 2, save)
    assert (len(first), len(same), len(halved), len(plain)) == (4, 2, 2, 2)
    assert first + same + halved + plain == pytest.approx(reference, rel=1e-5)


CORPUS_WORDS = ("def", "x", "return a + b", "class Model:", "pass", "import torch", "for i in r",
                "yield", "if not ok:", "self.w = w", "print(s)", "a")


def _byte_corpus(directory):
    """EOD-separated documents of 1..12 bytes (ByteTokenizer ids, EOD 256, the last id): packed
    samples of 8 tokens hold several documents, which cross the context-parallel chunks (2 tokens
    each at cp = 2)."""
    from tpfuse.data import ByteTokenizer, write_indexed_dataset

    tokenizer, prefix = ByteTokenizer(), str(directory / "corpus")
    docs = [tokenizer.tokenize(CORPUS_WORDS[i % len(CORPUS_WORDS)]) + [tokenizer.eod]
            for i in range(400)]
    write_indexed_dataset(prefix, docs, tokenizer.vocab_size)
    return ["--data-path", prefix, "--tokenizer-type", "ByteTokenizer"]


def _huggingface_corpus(directory):
    """The same documents through a Hugging Face word-level tokenizer.json whose EOD
    ``<|endoftext|>`` is id 0 (not the last id, as in GPT-2's file it is not the first): 1..4
    tokens per document, so a sample of 8 holds 2..8 documents."""
    tokenizers = pytest.importorskip("tokenizers")   # the optional extra of HF tokenizers
    from tpfuse.data import HFTokenizer, write_indexed_dataset

    words = sorted({w for text in CORPUS_WORDS for w in text.split()})
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.save(str(directory / "tokenizer.json"))
    tokenizer, prefix = HFTokenizer(str(directory / "tokenizer.json")), str(directory / "corpus")
    assert tokenizer.eod == 0
    docs = [tokenizer.tokenize(CORPUS_WORDS[i % len(CORPUS_WORDS)]) + [tokenizer.eod]
            for i in range(400)]
    write_indexed_dataset(prefix, docs, tokenizer.vocab_size)
    return ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(directory)]


CORPUS_LAYOUTS = {
    # name: (corpus, world size, layout): tp2 x cp2 + SP with the ring (each rank holds one token
    # of each of its two chunks) on byte ids; cp2 Ulysses on the Hugging Face tokenizer's ids
    "byte-tp2-cp2-sp-p2p": (_byte_corpus, 4, _parallel(tp=2, sp=True, cp=2)),
    "hf-cp2-a2a": (_huggingface_corpus, 2, _parallel(cp=2, cp_comm_type="a2a")),
}


@pytest.mark.parametrize("name", sorted(CORPUS_LAYOUTS))
def test_document_masked_corpus_with_context_parallelism(run_distributed, tmp_path, name):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss, a sliding window and grouped-
    query attention (4 heads, 2 kv groups) on a real indexed corpus, documents cut at the
    tokenizer's EOD: the context-parallel layout equals one process."""
    corpus, world_size, layout = CORPUS_LAYOUTS[name]
    model = [a for a in TINY_MODEL if a not in ("--mock-data", "--vocab-size", "63")]
    flags = corpus(tmp_path) + [
        "--split", "100,0,0", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
        "--window-size", "4,0", "--num-query-groups", "2"]
    single = _losses(run_distributed, 1, flags, model)
    losses = _losses(run_distributed, world_size, flags + layout, model)
    assert single[-1] < single[0]
    assert losses == pytest.approx(single, rel=1e-5)


def test_context_parallel_checkpoint_resumes_at_another_layout(run_distributed, reference,
                                                               tmp_path):
    """4 iterations at cp2 with the distributed optimizer (its fp32 state sharded over the
    data+context-parallel group), saved; the last 6 resumed in one process (weights from the cp
    rank 0 file, the optimizer shards reassembled): the 10 losses are the single-process curve."""
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 2, _parallel(cp=2) + DISTRIBUTED_OPTIMIZER + save
                    + ["--train-iters", "4"])
    resumed = _losses(run_distributed, 1, DISTRIBUTED_OPTIMIZER + save)
    assert (len(first), len(resumed)) == (4, 6)
    assert first + resumed == pytest.approx(reference, rel=1e-5)


# ---------------------------------------------------------------- mixture of experts
# Every other layer an MoE layer (4 experts, top-2) with the load-balancing and z losses on: the
# expert-parallel layouts must reproduce the single-process MoE curve (same 1e-5 band; the router
# sees the same logits up to fp32 rounding, so it picks the same experts).
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


@pytest.fixture(scope="module")
def moe_reference(run_distributed):
    losses = _losses(run_distributed, 1, MOE)
    assert len(losses) == 10 and losses[-1] < losses[0]
    return losses


MOE_LAYOUTS = {
    "ep2-alltoall-grouped": (2, ["--expert-model-parallel-size", "2",
                                 "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]),
    "tp2-ep2-sp": (4, _parallel(tp=2, sp=True) + ["--expert-model-parallel-size", "2"]),
    # interleaved 1F1B: the router losses' gradient injected wherever the schedule runs backward
    "pp2-vpp2-ep2": (4, _parallel(pp=2, vpp_layers=1) + ["--expert-model-parallel-size", "2"]),
    # the router losses see the micro-batch's tokens over both context-parallel ranks
    "cp2-ep2": (2, _parallel(cp=2) + ["--expert-model-parallel-size", "2"]),
    # dense state sharded over dp 4, the experts' over their edp 2
    "dp4-ep2-distopt": (4, DISTRIBUTED_OPTIMIZER + ["--expert-model-parallel-size", "2"]),
    # zero-bubble: the grouped experts' weight gradients run in W, and their expert-dp buckets
    # (overlapped) wait for it
    "pp2-dp2-ep2-grouped-zb-h1": (4, _parallel(pp=2) + [
        "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--pipeline-schedule",
        "zb-h1", "--overlap-grad-reduce", "--ddp-bucket-size", "2000"]),
    # FSDP: the experts their own units over edp 2 (gradients divided by dp 4, not edp) ...
    "dp4-ep2-fsdp-zero3": (4, FSDP_ZERO3 + ["--expert-model-parallel-size", "2"]),
    # ... and unsharded at edp 1 (FSDP ignores them; scaled by 1/dp after backward)
    "ep2-fsdp-zero2": (2, FSDP_ZERO2 + ["--expert-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("name", sorted(MOE_LAYOUTS))
def test_moe_layout_reproduces_single_process_losses(run_distributed, moe_reference, name):
    world_size, argv = MOE_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, MOE + argv)
    assert losses == pytest.approx(moe_reference, rel=1e-5)


def test_moe_bf16_tracks_fp32(run_distributed, moe_reference):
    """bf16 at ep 2 (all-to-all, grouped GEMM) follows the fp32 MoE curve within u/4 relative, the
    bound test_mixed_precision_tracks_fp32 derives: each of the 2 MoE layers adds about 4 roundings
    on the logit's path (router logits, dispatched rows, expert output, combine), √(11 + 8) vs √11
    on the 0.1u estimate there gives ≈ 0.13u; a token whose two best experts' scores lie within a
    rounding of each other may switch expert, moving its output by about that same gap. (Measured:
    1.7e-4 ≈ u/23.) It guards the 16-bit path of the MoE layer (bf16 router, permutation and
    grouped GEMM; expert main_grad and fp32 main parameters); the fp32 layouts above are the exact
    (1e-5) checks of the parallel algebra."""
    argv = MOE + ["--bf16", "--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                  "--moe-token-dispatcher-type", "alltoall"]
    losses = _losses(run_distributed, 2, argv)
    assert losses == pytest.approx(moe_reference, rel=2.0**-8 / 4)


def test_moe_checkpoint_reshards_across_expert_layouts(run_distributed, moe_reference, tmp_path):
    """4 steps at ep = 2 (experts 0-1 | 2-3 on two ranks, dp 2), resumed at tp 2 + SP with every
    expert split over etp = 2 instead: the experts and their Adam moments are re-cut (whole
    experts → column / row shards), the curve continues."""
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "4"]
    first = _losses(run_distributed, 2, MOE + save + ["--train-iters", "4",
                                                     "--expert-model-parallel-size", "2"])
    resumed = _losses(run_distributed, 2, MOE + save + _parallel(tp=2, sp=True) + [
        "--load", str(tmp_path / "ckpt")])
    assert first + resumed == pytest.approx(moe_reference, rel=1e-5)


# ---------------------------------------------------------------- dropout on
# Megatron's default dropouts (hidden and attention 0.1): every mask is a function of (seed,
# layer, global sample, global position, hidden index or head and key position), so each
# layout draws the single process's masks and the curve is the same within the same 1e-5
# (4 iterations keep the run short; a mask drawn per rank would move the loss by ~1e-3).
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
           "--train-iters", "4", "--lr-decay-iters", "4"]


@pytest.fixture(scope="module")
def dropout_reference(run_distributed, reference):
    losses = _losses(run_distributed, 1, DROPOUT)
    assert len(losses) == 4
    assert losses != pytest.approx(reference[:4], rel=1e-4)   # the dropout is on
    return losses


DROPOUT_LAYOUTS = {
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "pp2": (2, _parallel(pp=2)),
    "pp2-vpp2": (2, _parallel(pp=2, vpp_layers=1)),
    "dp2": (2, _parallel()),
    # recompute regenerates the masks: full (uniform groups) and selective (attention, norms, MLP)
    "tp2-full-recompute": (2, _parallel(tp=2) + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "2"]),
    "tp2-selective-recompute-sp": (2, _parallel(tp=2, sp=True) + [
        "--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp"]),
    # context parallelism, each comm type: every attention block draws the single-process mask
    # of its global (query, key) positions; Ulysses' heads keep their global index
    "cp2-p2p": (2, _parallel(cp=2)),
    "cp2-allgather": (2, _parallel(cp=2, cp_comm_type="all_gather")),
    "cp2-a2a": (2, _parallel(cp=2, cp_comm_type="a2a")),
}


@pytest.mark.parametrize("name", sorted(DROPOUT_LAYOUTS))
def test_dropout_layout_reproduces_single_process_losses(run_distributed, dropout_reference,
                                                         name):
    world_size, argv = DROPOUT_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, DROPOUT + argv)
    assert losses == pytest.approx(dropout_reference, rel=1e-5)


def test_dropout_moe_ep2_reproduces_single_process(run_distributed):
    """The MoE model with dropout on: ep = 2 (two data-parallel replicas each holding half the
    experts) draws the single process's masks."""
    single = _losses(run_distributed, 1, MOE + DROPOUT)
    layout = _losses(run_distributed, 2, MOE + DROPOUT + ["--expert-model-parallel-size", "2"])
    assert single[-1] < single[0]
    assert layout == pytest.approx(single, rel=1e-5)


# ================================================ MoE shared experts (begin; owned by the moe area)
# The MoE model with a gated shared expert (every token through a dense MLP of width 16, scaled
# by σ(x w_g)): tp = 2 + SP (the shared expert TP-sharded like a dense MLP, its gate replicated
# and reduced over TP) with ep = 2 (it is replicated over ep) reproduces one process (1e-5 band).
# Five iterations (the suite's time): the layouts' only difference, summation order, shows at once.
MOE_SHARED = MOE + ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
                    "--train-iters", "5", "--lr-decay-iters", "5"]
MOE_SHARED_LAYOUTS = {
    "tp2-sp-ep2": (4, _parallel(tp=2, sp=True) + ["--expert-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def moe_shared_reference(run_distributed):
    losses = _losses(run_distributed, 1, MOE_SHARED)
    assert len(losses) == 5 and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("name", sorted(MOE_SHARED_LAYOUTS))
def test_moe_shared_expert_layout_reproduces_single_process_losses(run_distributed,
                                                                   moe_shared_reference, name):
    world_size, argv = MOE_SHARED_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, MOE_SHARED + argv)
    assert losses == pytest.approx(moe_shared_reference, rel=1e-5)
# ================================================== MoE shared experts (end)


# ---------------------------------------------------------------- q / k layernorm
# --qk-layernorm (Qwen3's q_norm / k_norm) with RMSNorm, rotary and grouped-query attention: each
# head's q and k (k over the 2 KV heads) normalised over d by weights replicated on every TP
# rank, each rank seeing only its heads, so their gradients are summed over TP (with and without
# SP). tp 2 + SP (with full recompute re-running the norms in backward), cp 2 (each rank's tokens,
# reduced over dp x cp) and pp 2 reproduce one process (1e-5 band); five iterations at lr 1e-2
# without warmup, so that a q / k norm gradient left partial (each TP rank its heads' share)
# moves the curve above the band: measured 5.4e-5 with the TP all-reduce removed (at lr 3e-3
# with warmup, 1.3e-6, inside it), 1.2e-7 with it.
QK_LAYERNORM = ["--qk-layernorm", "--normalization", "RMSNorm", "--position-embedding-type",
                "rope", "--num-query-groups", "2", "--train-iters", "5", "--lr-decay-iters", "5",
                "--lr", "1e-2", "--lr-warmup-iters", "0", "--num-layers", "8"]
QK_LAYERNORM_LAYOUTS = {
    "tp2-sp-full-recompute": (2, _parallel(tp=2, sp=True) + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "2"]),
    "cp2": (2, _parallel(cp=2)),
    "pp2": (2, _parallel(pp=2)),
}


@pytest.fixture(scope="module")
def qk_layernorm_reference(run_distributed):
    losses = _losses(run_distributed, 1, QK_LAYERNORM)
    assert len(losses) == 5 and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("name", sorted(QK_LAYERNORM_LAYOUTS))
def test_qk_layernorm_layout_reproduces_single_process_losses(run_distributed,
                                                              qk_layernorm_reference, name):
    world_size, argv = QK_LAYERNORM_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, QK_LAYERNORM + argv)
    assert losses == pytest.approx(qk_layernorm_reference, rel=1e-5)


# ---------------------------------------------------------------- Muon
# --optimizer muon (training/muon.py): Newton-Schulz needs each whole matrix, so the layouts that
# cut one (tp2 + SP: column / row shards, --muon-tp-mode duplicated gathers them; the distributed
# optimizer's flat bucket shards and FSDP's row blocks over dp2: an all-reduce of zero-padded
# pieces) assemble it, orthogonalise and keep their own part; pp2 cuts none. GQA (the split QKV:
# q, k and v of every group orthogonalised apart) and swiglu (fc1's stride-2 TP shards) on.
# The NS GEMMs in fp32 (--muon-fp32-matmul-prec high; medium's bf16 would turn the layouts'
# ~1e-7 gradient differences into bf16 rounding flips of 4e-3): only fp32 sums are reordered, as
# for AdamW above, measured ≤ 1.2e-7 relative over the 6 steps, so the same 1e-5 band. Blockwise
# orthogonalisation of each TP shard (Megatron's default) is another update: 1.4e-3 away.
MUON = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "high",
        "--num-layers", "2", "--num-query-groups", "2", "--swiglu", "--train-iters", "6",
        "--lr-decay-iters", "6", "--lr", "1e-2"]
MUON_LAYOUTS = {
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "pp2": (2, _parallel(pp=2)),
    "dp2-distributed-optimizer": (2, DISTRIBUTED_OPTIMIZER),
    "dp2-fsdp-zero3": (2, FSDP_ZERO3),
}


@pytest.fixture(scope="module")
def muon_reference(run_distributed):
    losses = _losses(run_distributed, 1, MUON)
    assert len(losses) == 6 and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("name", sorted(MUON_LAYOUTS))
def test_muon_layout_reproduces_single_process_losses(run_distributed, muon_reference, name):
    world_size, argv = MUON_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, MUON + argv)
    assert losses == pytest.approx(muon_reference, rel=1e-5)


def test_muon_blockwise_tp2_is_another_update(run_distributed, muon_reference):
    losses = _losses(run_distributed, 2, MUON + _parallel(tp=2, sp=True)
                     + ["--muon-tp-mode", "blockwise"])
    assert losses[0] == pytest.approx(muon_reference[0], rel=1e-5)     # same model, same batch
    assert losses != pytest.approx(muon_reference, rel=1e-5)


def test_muon_resumes_exactly_and_reshards_distributed_optimizer_to_tp2(run_distributed,
                                                                        muon_reference, tmp_path):
    """2 iterations at dp2 with the distributed optimizer (each rank saves its shard of the
    momentum buffers and Adam moments), 2 more resumed at the same layout, the last 2 at tp2 + SP
    (resharded: the buffers reassembled and cut by columns / rows): the single-process curve."""
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 2, MUON + DISTRIBUTED_OPTIMIZER + save + ["--train-iters", "2"])
    same = _losses(run_distributed, 2, MUON + DISTRIBUTED_OPTIMIZER + save + ["--train-iters", "4"])
    resharded = _losses(run_distributed, 2, MUON + _parallel(tp=2, sp=True) + save)
    assert (len(first), len(same), len(resharded)) == (2, 2, 2)
    assert first + same + resharded == pytest.approx(muon_reference, rel=1e-5)


# ======================================================== variable sequence lengths (begin)
# --variable-seq-lengths: micro-batches of three lengths (12, 4, 8 tokens, --seq-length 12) from
# DocumentDataset (one document per sample, each micro-batch padded only to its longest sample:
# here none, both samples of a micro-batch have its length) through pretrain. Every pipeline
# message carries its shape; the pp layouts (1F1B, interleaved, ZB-H1 with tp2 + SP, cp2) give
# the single-process losses and global gradient norms within the section's 1e-5 band (only the
# order of fp32 sums differs, as above). Four iterations of a 4-layer model keep it short.
VARLEN_LENGTHS = (12, 4, 8)        # micro-batch k holds samples 2k, 2k + 1 of length [k % 3]
VARLEN_MODEL = [
    "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4",
    "--ffn-hidden-size", "32", "--seq-length", "12", "--max-position-embeddings", "12",
    "--vocab-size", "63", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "7",
    "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "4", "--lr-decay-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
    "--clip-grad", "1.0", "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000",
    "--no-progress-bar", "--no-layout-table",
]


class _DocumentsOfLengths:
    """Low-level corpus: document j has ``lengths[(j // 2) % len(lengths)] + 1`` tokens, ids
    counting from 7·j modulo 63."""

    def __init__(self, lengths, num_documents=64):
        self.lengths = lengths
        self.sequence_lengths = [lengths[(j // 2) % len(lengths)] + 1
                                 for j in range(num_documents)]

    def get(self, j, offset=0, length=None):
        import numpy as np

        ids = (7 * j + np.arange(self.sequence_lengths[j])) % 63
        return ids[offset:None if length is None else offset + length]


def varlen_datasets(lengths, pad_to_multiple_of, train_valid_test_num_samples, *, config,
                    declared=True):
    """pretrain's datasets provider: DocumentDataset over ``_DocumentsOfLengths(lengths)``;
    ``declared=False``: as a dataset that does not say its lengths vary."""
    from tpfuse.data import DocumentDataset

    train = DocumentDataset(_DocumentsOfLengths(lengths), config.seq_length, pad_to_multiple_of,
                            num_samples=train_valid_test_num_samples[0])
    train.variable_seq_lengths = declared
    return train, None, None


def _varlen_run(run_distributed, world_size, argv, lengths=VARLEN_LENGTHS, multiple=4):
    """(losses, grad norms) of the logging rank."""
    import functools

    from support.pretrain_run import run_pretrain

    results = run_distributed(world_size, run_pretrain, VARLEN_MODEL + list(argv),
                              datasets_provider=functools.partial(varlen_datasets, lengths,
                                                                  multiple))
    logged = [r for r in results if r.is_logger]
    assert len(logged) == 1
    return logged[0].train_losses, logged[0].grad_norms


VARLEN_LAYOUTS = {
    "pp2": (2, _parallel(pp=2)),
    "pp2-vpp2": (2, _parallel(pp=2, vpp_layers=1)),
    "tp2-pp2-sp-zb-h1": (4, _parallel(tp=2, pp=2, sp=True) + ["--pipeline-schedule", "zb-h1"]),
    "pp2-cp2": (4, _parallel(pp=2, cp=2)),
}


@pytest.fixture(scope="module")
def varlen_reference(run_distributed):
    losses, norms = _varlen_run(run_distributed, 1, ["--variable-seq-lengths"])
    assert len(losses) == len(norms) == 4 and losses[-1] < losses[0]
    return losses, norms


@pytest.mark.parametrize("name", sorted(VARLEN_LAYOUTS))
def test_variable_seq_lengths_layout_reproduces_single_process(run_distributed,
                                                               varlen_reference, name):
    world_size, argv = VARLEN_LAYOUTS[name]
    losses, norms = _varlen_run(run_distributed, world_size, argv + ["--variable-seq-lengths"])
    assert losses == pytest.approx(varlen_reference[0], rel=1e-5)
    assert norms == pytest.approx(varlen_reference[1], rel=1e-5)


VARLEN_ERRORS = {
    # name: (world size, flags, micro-batch lengths, padding multiple, what the message names)
    "no-flag-pp2": (2, _parallel(pp=2), VARLEN_LENGTHS, 4,
                    ["DocumentDataset", "--variable-seq-lengths"]),
    # a dataset that does not declare it: its second micro-batch (4 tokens) is refused when read
    "no-flag-undeclared": (1, [], (12, 4), 4,
                           ["sequence length 4 with --seq-length 12", "--variable-seq-lengths"]),
    "cp2-length-6": (2, _parallel(cp=2) + ["--variable-seq-lengths"], (12, 6), 1,
                     ["sequence length 6", "2 × --context-parallel-size 2 = 4"]),
    "tp2-sp-length-5": (2, _parallel(tp=2, sp=True) + ["--variable-seq-lengths"], (12, 5), 1,
                        ["sequence length 5", "--tensor-model-parallel-size 2 "
                         "(--sequence-parallel) = 2"]),
}


@pytest.mark.parametrize("name", sorted(VARLEN_ERRORS))
def test_variable_seq_lengths_errors_name_the_length_and_flags(run_distributed, name):
    """Every rank raises the ValueError before the micro-batch's first collective (the
    undeclared dataset runs in one process: a pipeline peer of the reading rank would wait)."""
    import functools

    from support.pretrain_run import pretrain_error

    world_size, argv, lengths, multiple, names = VARLEN_ERRORS[name]
    provider = functools.partial(varlen_datasets, lengths, multiple,
                                 declared=name != "no-flag-undeclared")
    errors = run_distributed(world_size, pretrain_error, VARLEN_MODEL + argv,
                             datasets_provider=provider)
    assert all(error is not None and all(n in error for n in names) for error in errors), errors
# ========================================================== variable sequence lengths (end)


# ================================================ multi-token prediction (begin; owned by mtp)
# --mtp-num-layers 1 (DeepSeek-V3's MTP, the rope model its pipeline layout needs) on 4 layers:
# the MTP layer and its loss (scaled 0.1) live on the last stage, which embeds the shifted tokens
# with the first stage's embedding (tied: the output layer's copy, untied: its own copy, both
# summed with the first stage's after backward). tp 2 + SP and pp 2 (tied and untied) reproduce
# one process in the same 1e-5 band, on the lm loss and on the logged "mtp_1 loss" alike; the MTP
# gradient moves the lm curve far outside that band (checked), so a lost MTP gradient shows.
# (Measured: 2.3e-7 relative at most, tp 2 + SP's mtp_1 loss and the resharded resume; pp 2:
# equal. Two fp32 ulps, so this section keeps the 1e-5 band.)
MTP_BASE = list(TINY_MODEL) + ["--position-embedding-type", "rope", "--train-iters", "5",
                              "--lr-decay-iters", "5"]
MTP_BASE[MTP_BASE.index("--num-layers") + 1] = "4"
MTP = ["--mtp-num-layers", "1"]
UNTIED = ["--untie-embeddings-and-output-weights"]
MTP_LAYOUTS = {
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "pp2": (2, _parallel(pp=2)),
    "pp2-untied": (2, _parallel(pp=2) + UNTIED),
}


def _mtp_curves(run_distributed, world_size, argv, metrics_file):
    """(lm losses, logged mtp_1 losses) of one MTP run, the latter read from its metrics file."""
    import json

    losses = _losses(run_distributed, world_size,
                     MTP + ["--metrics-file", str(metrics_file)] + list(argv), model=MTP_BASE)
    with open(metrics_file) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return losses, [r["mtp_1 loss"] for r in records if "mtp_1 loss" in r]


@pytest.fixture(scope="module")
def mtp_reference(run_distributed, tmp_path_factory):
    """{untied?: (lm losses, mtp_1 losses)} of one process."""
    folder = tmp_path_factory.mktemp("mtp")
    curves = {untied: _mtp_curves(run_distributed, 1, UNTIED if untied else [],
                                  folder / f"untied-{untied}.jsonl") for untied in (False, True)}
    for losses, mtp_losses in curves.values():
        assert len(losses) == len(mtp_losses) == 5 and mtp_losses[-1] < mtp_losses[0]
    without_mtp = _losses(run_distributed, 1, [], model=MTP_BASE)
    assert without_mtp[0] == pytest.approx(curves[False][0][0], rel=1e-6)   # same first step
    assert without_mtp != pytest.approx(curves[False][0], rel=1e-4)         # MTP's gradient
    return curves


@pytest.mark.parametrize("name", sorted(MTP_LAYOUTS))
def test_mtp_layout_reproduces_single_process(run_distributed, mtp_reference, tmp_path, name):
    world_size, argv = MTP_LAYOUTS[name]
    losses, mtp_losses = _mtp_curves(run_distributed, world_size, argv, tmp_path / "m.jsonl")
    reference_losses, reference_mtp = mtp_reference[UNTIED[0] in argv]
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert mtp_losses == pytest.approx(reference_mtp, rel=1e-5)


def test_mtp_checkpoint_reshards_pp2_untied_to_tp2_sp(run_distributed, mtp_reference, tmp_path):
    """2 steps at pp 2 (the last stage's untied embedding copy), resumed at tp 2 + SP: the MTP
    weights and the embedding (one tensor again) carry over, both curves continue."""
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"] + UNTIED
    first, first_mtp = _mtp_curves(run_distributed, 2, save + _parallel(pp=2) + [
        "--train-iters", "2"], tmp_path / "first.jsonl")
    resumed, resumed_mtp = _mtp_curves(run_distributed, 2, save + _parallel(tp=2, sp=True) + [
        "--load", str(tmp_path / "ckpt")], tmp_path / "resumed.jsonl")
    reference_losses, reference_mtp = mtp_reference[True]
    assert first + resumed == pytest.approx(reference_losses, rel=1e-5)
    assert first_mtp + resumed_mtp == pytest.approx(reference_mtp, rel=1e-5)
# ================================================== multi-token prediction (end)


# ---------------------------------------------------------------- kv_channels != h / heads
# --kv-channels 8 with 4 heads of a hidden 16 (Qwen3's explicit head_dim, here twice h / heads):
# the fused QKV has (4 + 2·2)·8 rows and the output projection 4·8 inputs, split over TP by whole
# groups / heads. tp 2 + SP reproduces one process (the 1e-5 band of the layouts above); a head
# dim taken as h / heads on some rank would not even build the same parameter shapes.
KV_CHANNELS = QK_LAYERNORM + ["--kv-channels", "8"]


@pytest.fixture(scope="module")
def kv_channels_reference(run_distributed):
    losses = _losses(run_distributed, 1, KV_CHANNELS)
    assert len(losses) == 5 and losses[-1] < losses[0]
    return losses


def test_kv_channels_tp2_sp_reproduces_single_process_losses(run_distributed,
                                                             kv_channels_reference):
    losses = _losses(run_distributed, 2, KV_CHANNELS + _parallel(tp=2, sp=True))
    assert losses == pytest.approx(kv_channels_reference, rel=1e-5)


# ================================================ hybrid sharding (begin; owned by the hsdp area)
# --num-distributed-optimizer-instances 2 at dp 4: two replicas of a 2-rank shard group. The
# distributed optimizer reduce-scatters each bucket over its instance and all-reduces the shard
# across the instances; FSDP2 shards over a (replicate 2, shard 2) mesh. Both sum the same
# gradients as dp 4 in another order (two partial sums of two, then their sum), so the curve is
# the single process's within the bands above (1e-5, FSDP_REL for FSDP: the same fp32 reorderings
# of a reduce-scatter's blocks). Composed: tp 2 + SP (world 8, FSDP: the TP shards are the mesh's
# local tensors), ep 2 (the experts' edp 2 = 2 instances of 1 rank: their shards are only
# all-reduced across the instances), pp 2 and cp 2.
HSDP2 = ["--num-distributed-optimizer-instances", "2"]
HSDP_LAYOUTS = {
    # name: (world size, model flags, layout flags, relative tolerance)
    "dp4-distopt-hsdp2": (4, [], DISTRIBUTED_OPTIMIZER + HSDP2, 1e-5),
    "dp4-fsdp-zero3-hsdp2": (4, [], FSDP_ZERO3 + HSDP2, FSDP_REL),
    "tp2-sp-dp4-fsdp-zero2-hsdp2": (8, [], _parallel(tp=2, sp=True) + FSDP_ZERO2 + HSDP2,
                                    FSDP_REL),
    "dp4-ep2-distopt-hsdp2": (4, MOE, DISTRIBUTED_OPTIMIZER + HSDP2
                              + ["--expert-model-parallel-size", "2"], 1e-5),
    # beside a pipeline (per stage its own dp-cp instances) and context parallelism (the
    # instances split the dp·cp group of 4: cp 2 × dp 2)
    "pp2-dp4-distopt-hsdp2": (8, [], _parallel(pp=2) + DISTRIBUTED_OPTIMIZER + HSDP2, 1e-5),
    "cp2-dp2-fsdp-zero3-hsdp2": (4, [], _parallel(cp=2) + FSDP_ZERO3 + HSDP2, FSDP_REL),
}


@pytest.mark.parametrize("name", sorted(HSDP_LAYOUTS))
def test_hybrid_sharding_reproduces_single_process_losses(run_distributed, reference,
                                                          moe_reference, name):
    world_size, model, argv, tolerance = HSDP_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, model + argv)
    assert losses == pytest.approx(moe_reference if model else reference, rel=tolerance)


def test_hybrid_sharding_checkpoint_resumes_as_plain_data_parallel_and_back(run_distributed,
                                                                            reference, tmp_path):
    """4 iterations at dp 4 = 2 instances x 2 shards with the distributed optimizer (each rank
    saves its half of the fp32 state, the two instances the same halves), 3 more at dp 2 as plain
    data parallelism (the halves reassembled into whole-parameter state), the last 3 back at
    hybrid sharding, FSDP2 ZeRO-3 over a (2, 2) mesh (the state cut into row blocks of each
    instance): the 10 losses are the single-process curve."""
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 4, DISTRIBUTED_OPTIMIZER + HSDP2 + save
                    + ["--train-iters", "4"])
    plain = _losses(run_distributed, 2, save + ["--train-iters", "7"])
    back = _losses(run_distributed, 4, FSDP_ZERO3 + HSDP2 + save)
    assert (len(first), len(plain), len(back)) == (4, 3, 3)
    assert first + plain + back == pytest.approx(reference, rel=1e-5)
# ================================================== hybrid sharding (end)


# ---------------------------------------------------------------- multi-latent attention
# --multi-latent-attention (DeepSeek-V2/V3 MLA, tp_layers/mla.py) on a 4-layer model: q
# compression, q / kv latent norms, YaRN (factor 4, mscale_all_dim 1: softmax scale and tables
# scaled) and a value head dim (6) unlike the q/k one (4 + 4). The replicated down projections'
# gradients are all-reduced over TP under SP, and the shared rope key's gradient is summed over
# the ranks' heads with and without SP; tp 2 + SP, tp 2 with every selective recompute module
# (mla_up_proj included), pp 2 + vpp 2 with full recompute and cp 2 reproduce one process; five
# iterations at lr 1e-2 without warmup, as the q / k layernorm section. Only fp32 sums are
# reordered: measured ≤ 1.2e-7 relative (one fp32 ulp at these losses) in every layout; 1e-6 keeps
# a factor 8 (FSDP_REL's reasoning).
MLA = ["--num-layers", "4", "--multi-latent-attention", "--q-lora-rank", "8", "--kv-lora-rank",
       "8", "--qk-head-dim", "4", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--qk-layernorm", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--rotary-scaling-factor", "4", "--mscale-all-dim", "1.0",
       "--original-max-position-embeddings", "4", "--train-iters", "5", "--lr-decay-iters", "5",
       "--lr", "1e-2", "--lr-warmup-iters", "0"]
MLA_LAYOUTS = {
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "tp2-selective-recompute": (2, _parallel(tp=2) + [
        "--recompute-activations", "--recompute-modules", "core_attn", "mla_up_proj",
        "layernorm", "mlp"]),
    "pp2-vpp2-full-recompute": (2, _parallel(pp=2, vpp_layers=1) + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]),
    "cp2": (2, _parallel(cp=2)),
}


@pytest.fixture(scope="module")
def mla_reference(run_distributed):
    losses = _losses(run_distributed, 1, MLA)
    assert len(losses) == 5 and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("name", sorted(MLA_LAYOUTS))
def test_mla_layout_reproduces_single_process_losses(run_distributed, mla_reference, name):
    world_size, argv = MLA_LAYOUTS[name]
    losses = _losses(run_distributed, world_size, MLA + argv)
    assert losses == pytest.approx(mla_reference, rel=1e-6)


# ================================================ MoE expert bias (begin; owned by the moe area)
# Aux-loss-free balancing (DeepSeek-V3): sigmoid routing whose top-k choice adds a per-expert bias,
# moved after every step by rate·sign(mean(n) − n) with n the tokens each expert got over the whole
# global batch (counts all-reduced over the stage's tp-dp-cp ranks). Rate 1e-2 so that the bias
# (±1e-2 per step) reaches the size of the routers' score gaps within the run. ep 2 (alltoall,
# grouped GEMM; two data-parallel replicas) and tp 2 + SP with ep 2 reproduce one process (1e-5
# band) and end with the same bias, exactly (counts are integers, every step ±rate or 0, so any
# difference in what was counted shows); a checkpoint written at ep 2 resumed at tp 2 + SP (experts
# re-cut over etp) keeps the bias: the losses and the final bias are the uninterrupted run's.
# DeepSeek's first-k-dense pattern as Megatron writes it, 5 dense layers then 3 MoE layers: at pp 2
# (with ep 2) the first stage holds no MoE layer (no bias update, no collective there).
MOE_BIAS = MOE + ["--moe-layer-freq", "([0]*5+[1]*3)", "--moe-router-score-function", "sigmoid",
                  "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
                  "--train-iters", "5", "--lr-decay-iters", "5", "--num-layers", "8"]
MOE_BIAS_LAYOUTS = {
    "pp2-ep2": (4, _parallel(pp=2) + ["--expert-model-parallel-size", "2"]),
    "ep2-alltoall-grouped": (2, ["--expert-model-parallel-size", "2",
                                 "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]),
    "tp2-sp-ep2": (4, _parallel(tp=2, sp=True) + ["--expert-model-parallel-size", "2"]),
}


def _saved_expert_biases(root):
    """{global buffer name: bias} of the newest checkpoint under ``root``; every rank's copy of a
    bias must be the same."""
    import glob

    import torch

    from tpfuse.checkpoint import format as ckpt

    folder = ckpt.iteration_dir(root, ckpt.latest_iteration(root))
    biases = {}
    for path in sorted(glob.glob(os.path.join(folder, "rank_*.pt"))):
        payload = torch.load(path, weights_only=True)
        for chunk_state, names in zip(payload["model"], payload["reshard"].get("buffers", [])):
            for local, name in names.items():
                bias = biases.setdefault(name, chunk_state[local])
                assert torch.equal(bias, chunk_state[local]), f"{path}: {name} differs"
    return biases


def _bias_run(run_distributed, world_size, argv, root):
    save = ["--save", str(root), "--save-interval", "5"]
    return _losses(run_distributed, world_size, MOE_BIAS + argv + save), _saved_expert_biases(root)


@pytest.fixture(scope="module")
def moe_bias_reference(run_distributed, tmp_path_factory):
    losses, biases = _bias_run(run_distributed, 1, [], tmp_path_factory.mktemp("bias") / "ckpt")
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert sorted(biases) == [f"layers.{i}.mlp.router.expert_bias" for i in (5, 6, 7)]
    assert all(b.abs().max() > 0 for b in biases.values())
    return losses, biases


def _assert_same_biases(biases, reference):
    import torch

    assert sorted(biases) == sorted(reference)
    for name, bias in biases.items():
        assert torch.equal(bias, reference[name]), name


@pytest.mark.parametrize("name", sorted(MOE_BIAS_LAYOUTS))
def test_moe_expert_bias_layout_reproduces_single_process(run_distributed, moe_bias_reference,
                                                          tmp_path, name):
    world_size, argv = MOE_BIAS_LAYOUTS[name]
    losses, biases = _bias_run(run_distributed, world_size, argv, tmp_path / "ckpt")
    assert losses == pytest.approx(moe_bias_reference[0], rel=1e-5)
    _assert_same_biases(biases, moe_bias_reference[1])


def test_moe_expert_bias_survives_resume_at_another_expert_layout(run_distributed,
                                                                  moe_bias_reference, tmp_path):
    root = tmp_path / "ckpt"
    save = ["--save", str(root), "--save-interval", "5"]
    first = _losses(run_distributed, 2, MOE_BIAS + save + [
        "--expert-model-parallel-size", "2", "--train-iters", "3"])
    resumed = _losses(run_distributed, 2, MOE_BIAS + save + _parallel(tp=2, sp=True)
                      + ["--load", str(root)])
    assert (len(first), len(resumed)) == (3, 2)
    assert first + resumed == pytest.approx(moe_bias_reference[0], rel=1e-5)
    _assert_same_biases(_saved_expert_biases(root), moe_bias_reference[1])
# ================================================== MoE expert bias (end)


# ======================================== torch_dist checkpoints (begin; owned by the checkpoint area)
# --ckpt-format torch_dist stores Megatron's layout-independent tensors (checkpoint/
# torch_dist_format.py): a save at one layout resumes at another with the uninterrupted run's
# losses (rel 1e-5, the bound of this file: only the order of fp32 sums differs).
TORCH_DIST = ["--ckpt-format", "torch_dist"]


def test_torch_dist_tp2_save_resumes_at_pp2(run_distributed, reference, tmp_path):
    """4 iterations at tp 2 (vocabulary padded to 256 rows), saved in torch_dist; the last 6
    resumed at pp 2 (128 rows, the tied embedding split over the first and last stage)."""
    save = TORCH_DIST + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 2, _parallel(tp=2) + save + ["--train-iters", "4"])
    resumed = _losses(run_distributed, 2, _parallel(pp=2) + save)
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000004" / "metadata.json")
    assert (len(first), len(resumed)) == (4, 6)
    assert first + resumed == pytest.approx(reference, rel=1e-5)


def test_torch_dist_fsdp_dp4_resumes_at_dp2(run_distributed, reference, tmp_path):
    """FSDP ZeRO-3 at dp 4 saved asynchronously (the row-block pieces gathered into whole
    tensors), 3 iterations at dp 2 with ZeRO-2, the last 3 at dp 2 with the distributed
    optimizer (its flat pieces cut from the same tensors)."""
    save = TORCH_DIST + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 4, FSDP_ZERO3 + save + ["--train-iters", "4",
                                                             "--async-save", "--save-interval", "2"])
    halved = _losses(run_distributed, 2, FSDP_ZERO2 + save + ["--train-iters", "7"])
    distributed = _losses(run_distributed, 2, DISTRIBUTED_OPTIMIZER + save)
    assert (len(first), len(halved), len(distributed)) == (4, 3, 3)
    assert first + halved + distributed == pytest.approx(reference, rel=1e-5)
# ========================================== torch_dist checkpoints (end)


# ---------------------------------------------------------------- MLA + multi-token prediction
# The DeepSeek-V3 attention and MTP together: the MTP layer's attention is an MLA block too (its
# latents, its decoupled rope), on the last stage. tp 2 + SP, pp 2 and pp 2 × vpp 2 reproduce one
# process, the lm loss and the logged mtp_1 loss both: measured ≤ 1.2e-7 relative (tp 2 + SP;
# pp 2 and pp 2 × vpp 2: equal),
# so 1e-6 keeps a factor 8 (FSDP_REL's reasoning).
MLA_MTP_LAYOUTS = {"tp2-sp": (2, _parallel(tp=2, sp=True)), "pp2": (2, _parallel(pp=2)),
                   # the MTP layer on the last stage's last virtual chunk
                   "pp2-vpp2": (2, _parallel(pp=2, vpp_layers=1))}


def _mla_mtp_curves(run_distributed, world_size, argv, metrics_file):
    import json

    losses = _losses(run_distributed, world_size, MLA + MTP + ["--metrics-file",
                                                               str(metrics_file)] + list(argv))
    with open(metrics_file) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return losses, [r["mtp_1 loss"] for r in records if "mtp_1 loss" in r]


@pytest.fixture(scope="module")
def mla_mtp_reference(run_distributed, tmp_path_factory, mla_reference):
    losses, mtp_losses = _mla_mtp_curves(run_distributed, 1, [],
                                         tmp_path_factory.mktemp("mla-mtp") / "m.jsonl")
    assert len(losses) == len(mtp_losses) == 5 and mtp_losses[-1] < mtp_losses[0]
    assert losses[0] == pytest.approx(mla_reference[0], rel=1e-6)   # the same model and batch
    assert losses != pytest.approx(mla_reference, rel=1e-4)         # and MTP's gradient in it
    return losses, mtp_losses


@pytest.mark.parametrize("name", sorted(MLA_MTP_LAYOUTS))
def test_mla_with_mtp_reproduces_single_process(run_distributed, mla_mtp_reference, tmp_path,
                                                name):
    world_size, argv = MLA_MTP_LAYOUTS[name]
    losses, mtp_losses = _mla_mtp_curves(run_distributed, world_size, argv, tmp_path / "m.jsonl")
    assert losses == pytest.approx(mla_mtp_reference[0], rel=1e-6)
    assert mtp_losses == pytest.approx(mla_mtp_reference[1], rel=1e-6)


# ---------------------------------------------------------------- MoE + multi-token prediction
# DeepSeek-V3's MTP layer is an MoE layer (the last decoder layer's kind): its router takes part in
# the aux-loss-free balancing (its tokens counted with the step's, its bias moved and saved). At
# ep 2 and pp 2 × ep 2 the lm losses and every saved expert bias, the MTP layer's included, are
# one process's (the expert-bias section's exactness; the losses measured ≤ 1.2e-7 relative in
# both layouts, so a 1e-6 band: a factor 8, FSDP_REL's reasoning).
MOE_MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
MOE_MTP_LAYOUTS = {"ep2": (2, ["--expert-model-parallel-size", "2"]),
                   "pp2-ep2": (4, _parallel(pp=2) + ["--expert-model-parallel-size", "2"])}


@pytest.fixture(scope="module")
def moe_mtp_reference(run_distributed, tmp_path_factory):
    losses, biases = _bias_run(run_distributed, 1, MOE_MTP,
                               tmp_path_factory.mktemp("moe-mtp") / "ckpt")
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert len(biases) == 4 and all(b.abs().max() > 0 for b in biases.values())   # 3 + MTP's
    return losses, biases


@pytest.mark.parametrize("name", sorted(MOE_MTP_LAYOUTS))
def test_moe_mtp_layout_reproduces_single_process_losses_and_biases(run_distributed,
                                                                    moe_mtp_reference, tmp_path,
                                                                    name):
    world_size, argv = MOE_MTP_LAYOUTS[name]
    losses, biases = _bias_run(run_distributed, world_size, MOE_MTP + argv, tmp_path / "ckpt")
    assert losses == pytest.approx(moe_mtp_reference[0], rel=1e-6)
    _assert_same_biases(biases, moe_mtp_reference[1])


def test_torch_dist_keeps_the_moe_expert_bias_across_expert_layouts(run_distributed,
                                                                    moe_bias_reference,
                                                                    tmp_path):
    """The routers' expert bias (a persistent buffer, Megatron's ``router.expert_bias`` key)
    travels in torch_dist too: 3 steps at ep 2 and 2 resumed at tp 2 + SP give the uninterrupted
    losses (a bias restarted from zero moves them by ~5e-4)."""
    save = TORCH_DIST + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    first = _losses(run_distributed, 2, MOE_BIAS + save + [
        "--expert-model-parallel-size", "2", "--train-iters", "3"])
    resumed = _losses(run_distributed, 2, MOE_BIAS + save + _parallel(tp=2, sp=True)
                      + ["--load", str(tmp_path / "ckpt")])
    assert (len(first), len(resumed)) == (3, 2)
    assert first + resumed == pytest.approx(moe_bias_reference[0], rel=1e-5)


def test_torch_dist_hybrid_sharded_save_resumes_as_plain_data_parallel(run_distributed, reference,
                                                                       tmp_path):
    """4 iterations of FSDP ZeRO-3 at dp 4 = 2 replicas × 2 shards (each replica holds every
    shard once), saved in torch_dist; the last 6 as plain dp 2 with the distributed optimizer."""
    save = TORCH_DIST + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    first = _losses(run_distributed, 4, FSDP_ZERO3 + HSDP2 + save + ["--train-iters", "4"])
    resumed = _losses(run_distributed, 2, DISTRIBUTED_OPTIMIZER + save)
    assert (len(first), len(resumed)) == (4, 6)
    assert first + resumed == pytest.approx(reference, rel=1e-5)


# ============ MTP under context parallelism, MLA + MTP with dropout (begin; owned by mtp)
# Context parallelism: the MTP token shift crosses the cp ranks' load-balanced chunks (a chunk's
# last slot takes the next chunk's first token from its holder, the sequence's last slot 0) and
# each depth's loss is the whole sequence's token mean, as the lm loss. cp 2 (MLA + MTP, and
# the plain-attention MTP model) reproduces one process, the lm loss and the logged mtp_1 loss both; a shift kept inside each
# rank's chunks trains on other labels (checked: the mtp_1 loss 1e-3 to 6e-3 away).
# Dropout on (hidden and attention 0.1): MLA's attention-probability masks and the MTP
# embedding's and MTP layer's masks are functions of (seed, layer, global sample, global
# position, ...) like every other site's, so tp 2 + SP, pp 2 and cp 2 reproduce one process with
# dropout on; so does ep 2 for the MoE MLA + MTP model, dropout off and on (2 dense then 2 MoE
# layers, the MTP layer MoE too, aux-loss-free expert bias), ending with the same expert biases,
# exactly (the expert-bias section's argument).
# Band: only fp32 sums are reordered; measured ≤ 1.2e-7 relative (one fp32 ulp at these losses)
# over the 5 steps in every case below, lm and mtp_1 losses; 1e-6 keeps a factor 8 (FSDP_REL).
MLA_MTP_REL = 1e-6
MTP_CP_LAYOUTS = {
    "mtp-cp2": (2, _parallel(cp=2), False),
    "mla-mtp-cp2": (2, _parallel(cp=2), True),
}
MLA_MTP_DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
MLA_MTP_DROPOUT_LAYOUTS = {
    "tp2-sp": (2, _parallel(tp=2, sp=True)),
    "pp2": (2, _parallel(pp=2)),
    "cp2": (2, _parallel(cp=2)),
}
MOE_MLA_MTP = MOE_BIAS + MLA + MTP + ["--moe-layer-freq", "([0]*2+[1]*2)"]


@pytest.mark.parametrize("name", sorted(MTP_CP_LAYOUTS))
def test_mtp_context_parallel_reproduces_single_process(run_distributed, request, tmp_path,
                                                        name):
    world_size, argv, mla = MTP_CP_LAYOUTS[name]
    curves = _mla_mtp_curves if mla else _mtp_curves
    losses, mtp_losses = curves(run_distributed, world_size, argv, tmp_path / "m.jsonl")
    reference_losses, reference_mtp = (request.getfixturevalue("mla_mtp_reference") if mla
                                       else request.getfixturevalue("mtp_reference")[False])
    assert losses == pytest.approx(reference_losses, rel=MLA_MTP_REL)
    assert mtp_losses == pytest.approx(reference_mtp, rel=MLA_MTP_REL)


@pytest.fixture(scope="module")
def mla_mtp_dropout_reference(run_distributed, tmp_path_factory, mla_mtp_reference):
    losses, mtp_losses = _mla_mtp_curves(run_distributed, 1, MLA_MTP_DROPOUT,
                                         tmp_path_factory.mktemp("mla-mtp-dropout") / "m.jsonl")
    assert len(losses) == len(mtp_losses) == 5 and mtp_losses[-1] < mtp_losses[0]
    assert losses != pytest.approx(mla_mtp_reference[0], rel=1e-5)        # the dropout is on
    assert mtp_losses != pytest.approx(mla_mtp_reference[1], rel=1e-5)
    return losses, mtp_losses


@pytest.mark.parametrize("name", sorted(MLA_MTP_DROPOUT_LAYOUTS))
def test_mla_mtp_dropout_layout_reproduces_single_process(run_distributed,
                                                          mla_mtp_dropout_reference, tmp_path,
                                                          name):
    world_size, argv = MLA_MTP_DROPOUT_LAYOUTS[name]
    losses, mtp_losses = _mla_mtp_curves(run_distributed, world_size, MLA_MTP_DROPOUT + argv,
                                         tmp_path / "m.jsonl")
    assert losses == pytest.approx(mla_mtp_dropout_reference[0], rel=MLA_MTP_REL)
    assert mtp_losses == pytest.approx(mla_mtp_dropout_reference[1], rel=MLA_MTP_REL)


def _moe_mla_mtp_run(run_distributed, world_size, argv, folder):
    """(lm losses, logged mtp_1 losses, saved expert biases) of one MoE MLA + MTP run."""
    import json

    root, metrics = folder / "ckpt", folder / "m.jsonl"
    losses = _losses(run_distributed, world_size, MOE_MLA_MTP + argv + [
        "--save", str(root), "--save-interval", "5", "--metrics-file", str(metrics)])
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return losses, [r["mtp_1 loss"] for r in records if "mtp_1 loss" in r], \
        _saved_expert_biases(root)


@pytest.mark.parametrize("dropout", [False, True], ids=["dropout-off", "dropout-on"])
def test_moe_mla_mtp_ep2_reproduces_single_process(run_distributed, tmp_path, dropout):
    flags = MLA_MTP_DROPOUT if dropout else []
    single = _moe_mla_mtp_run(run_distributed, 1, flags, tmp_path / "single")
    layout = _moe_mla_mtp_run(run_distributed, 2, flags + ["--expert-model-parallel-size", "2"],
                              tmp_path / "ep2")
    assert len(single[0]) == len(single[1]) == 5 and single[0][-1] < single[0][0]
    assert len(single[2]) == 3 and all(b.abs().max() > 0 for b in single[2].values())  # 2 + MTP's
    assert layout[0] == pytest.approx(single[0], rel=MLA_MTP_REL)
    assert layout[1] == pytest.approx(single[1], rel=MLA_MTP_REL)
    _assert_same_biases(layout[2], single[2])
# ============== MTP under context parallelism, MLA + MTP with dropout (end)
