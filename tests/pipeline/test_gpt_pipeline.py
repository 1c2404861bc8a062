"""GPT under pipeline parallelism (1F1B and interleaved, with and without TP) vs one process.

Every layout runs one training step over the same m micro-batches with tpfuse's executor; the
reference is the single-process GPTModel (itself checked against a dense torch GPT in
test_gpt_model.py) with gradient accumulation of loss/m over the same micro-batches. Compared:
the per-micro-batch losses on the last stage, every gradient of every rank (TP shards reassembled,
layer names mapped to global indices, the tied output weight after allreduce_embedding_grads), and
the weights after an optimizer step: the two copies of the tied embedding must stay identical.

Tolerances: fp32 throughout, layouts differ only in summation order (~1e-6 relative): rtol 1e-5,
atol 2e-6, as in test_gpt_model.py. The tied copies after the step are compared exactly: they
receive the same gradient and run the same optimizer arithmetic.
"""
import pytest
import torch

from tpfuse.models import GPTModel, TransformerConfig
from tpfuse.tp_layers.init import unshard

TOL = dict(rtol=1e-5, atol=2e-6)
B, S, VOCAB, M = 2, 8, 61, 4
WORD = "embedding.word_embeddings.weight"

# padded vocab 64 at tp=1 and tp=2 alike (see test_gpt_model.py)
BASE = dict(hidden_size=32, num_attention_heads=2, seq_length=S, vocab_size=VOCAB,
            make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0, seed=21)


def make_config(**overrides):
    return TransformerConfig(**{**BASE, **overrides})


def micro_batches(seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(S).expand(B, S)
    return [(torch.randint(0, VOCAB, (B, S), generator=gen), positions,
             torch.randint(0, VOCAB, (B, S), generator=gen)) for _ in range(M)]


def loss_func(output_tensor):
    loss = output_tensor.mean()                          # per-token loss (b, s) -> mean
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    ids, positions, labels = next(data_iterator)
    return model(ids, positions, labels=labels), loss_func


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------- the single-process reference
LAYOUT_ONLY = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "sequence_parallel")


def reference_step(model_kwargs, batches, optimizer_name):
    """Losses per micro-batch, gradients (of the mean loss) and updated weights, one process."""
    model = GPTModel(make_config(**{k: v for k, v in model_kwargs.items()
                                    if k not in LAYOUT_ONLY}))
    losses = []
    for ids, positions, labels in batches:
        loss = model(ids, positions, labels=labels).mean()
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    make_optimizer(optimizer_name, list(model.parameters())).step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return torch.stack(losses), grads, weights


# ---------------------------------------------------------------- one rank of the pipelined run
def _describe(param):
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    return dim, getattr(param, "partition_stride", 1)


def _pipeline_body(layout, model_kwargs, batches, optimizer_name):
    from tpfuse.models import allreduce_embedding_grads, build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func

    tp, pp, vpp = layout
    state = ParallelState.initialize(tp=tp, pp=pp, vpp=vpp)
    try:
        config = make_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp, **model_kwargs)
        chunks = build_model(make_gpt_model_provider(config), config, state=state)
        forward_backward = get_forward_backward_func(state)
        loss_dicts = forward_backward(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
            model=chunks, num_microbatches=len(batches), seq_length=S, micro_batch_size=B)
        allreduce_embedding_grads(chunks, state)
        grads, weights = {}, {}
        for chunk in chunks:
            names = chunk.global_parameter_names()
            for name, param in chunk.named_parameters():
                grads[names[name]] = (param.grad.clone(), *_describe(param))
        make_optimizer(optimizer_name, [p for c in chunks for p in c.parameters()]).step()
        for chunk in chunks:
            names = chunk.global_parameter_names()
            for name, param in chunk.named_parameters():
                weights[names[name]] = (param.detach().clone(), *_describe(param))
        losses = [d["lm loss"] for d in loss_dicts]
        return dict(tp_rank=state.tp_rank, pp_rank=state.pp_rank, losses=losses, grads=grads,
                    weights=weights, chunk_flags=[(c.pre_process, c.post_process) for c in chunks])
    finally:
        state.destroy()


def _gather(results, key, pp, tied):
    """Reassemble {global name: full tensor} per holder; returns name -> list of full tensors."""
    full = {}
    for pp_rank in range(pp):
        ranks = sorted((r for r in results if r["pp_rank"] == pp_rank), key=lambda r: r["tp_rank"])
        for name in ranks[0][key]:
            _, dim, stride = ranks[0][key][name]
            shards = [r[key][name][0] for r in ranks]
            if dim is None:                # replicated: every TP rank must hold the same values
                for shard in shards[1:]:
                    torch.testing.assert_close(shard, shards[0], **TOL, msg=name)
                tensor = shards[0]
            else:
                tensor = unshard(shards, dim, stride)
            target = WORD if (tied and name == "output_layer.weight") else name
            full.setdefault(target, []).append(tensor)
    return full


LAYOUTS = [
    # (world, (tp, pp, vpp), model kwargs, optimizer)
    pytest.param(2, (1, 2, None), dict(num_layers=3, decoder_first_pipeline_num_layers=1), "sgd",
                 id="pp2-1f1b-uneven"),
    pytest.param(2, (1, 2, 2), dict(num_layers=4), "adamw", id="pp2-vpp2"),
    pytest.param(4, (1, 4, 2), dict(num_layers=8), "sgd", id="pp4-vpp2"),
    pytest.param(4, (2, 2, 2), dict(num_layers=4, sequence_parallel=True), "adamw",
                 id="tp2-sp-pp2-vpp2"),
    pytest.param(8, (2, 4, None), dict(num_layers=4, untie_embeddings_and_output_weights=True,
                                       position_embedding_type="rope"), "adamw",
                 id="tp2-pp4-1f1b-untied-rope"),
]


@pytest.mark.parametrize("world, layout, model_kwargs, optimizer_name", LAYOUTS)
def test_pipeline_matches_single_process_gradient_accumulation(
        run_distributed, world, layout, model_kwargs, optimizer_name):
    tp, pp, vpp = layout
    tied = not model_kwargs.get("untie_embeddings_and_output_weights", False)
    batches = micro_batches()
    ref_losses, ref_grads, ref_weights = reference_step(model_kwargs, batches, optimizer_name)
    results = run_distributed(world, _pipeline_body, layout, model_kwargs, batches,
                              optimizer_name)

    # losses: only the last stage keeps them, one per micro-batch, in micro-batch order
    for result in results:
        if result["pp_rank"] == pp - 1:
            torch.testing.assert_close(torch.stack(result["losses"]), ref_losses, **TOL)
        else:
            assert result["losses"] == []
    # pre/post flags: embedding on chunk 0 of the first stage, loss on the last chunk of the last
    chunks = vpp or 1
    for result in results:
        expected = [(result["pp_rank"] == 0 and c == 0, result["pp_rank"] == pp - 1
                     and c == chunks - 1) for c in range(chunks)]
        assert result["chunk_flags"] == expected

    grads = _gather(results, "grads", pp, tied)
    assert grads.keys() == ref_grads.keys()          # every parameter is held somewhere
    for name, copies in grads.items():
        assert len(copies) == (2 if (tied and name == WORD) else 1), name
        for grad in copies:
            torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=name)

    weights = _gather(results, "weights", pp, tied)
    if optimizer_name == "sgd":
        # SGD's update is linear in the gradient, so the weights keep the gradients' tolerance.
        # (AdamW's first step is ~lr·sign(g): gradients that are 0 up to fp32 noise flip sign,
        # so only the exact equality of the tied copies below is meaningful for it.)
        for name, copies in weights.items():
            for weight in copies:
                torch.testing.assert_close(weight, ref_weights[name], **TOL, msg=name)
    if tied:                                          # the two copies took the identical step
        first, last = weights[WORD]
        assert torch.equal(first, last)


def _untied_grads_body():
    """Without allreduce_embedding_grads the tied copies' gradients differ (the test has teeth)."""
    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func

    state = ParallelState.initialize(tp=1, pp=2)
    try:
        config = make_config(num_layers=2, pipeline_model_parallel_size=2)
        chunks = build_model(make_gpt_model_provider(config), config, state=state)
        batches = micro_batches()
        get_forward_backward_func(state)(
            forward_step_func=forward_step, data_iterator=[iter(batches)], model=chunks,
            num_microbatches=M, seq_length=S, micro_batch_size=B)
        weight = chunks[0].shared_embedding_or_output_weight()
        return weight.detach().clone(), weight.grad.clone(), getattr(weight, "shared", False)
    finally:
        state.destroy()


def test_tied_copies_start_equal_and_need_the_embedding_allreduce(run_distributed):
    (w0, g0, shared0), (w1, g1, shared1) = run_distributed(2, _untied_grads_body)
    assert torch.equal(w0, w1)                        # same master weight on first and last stage
    assert not shared0 and shared1                    # only the last stage's copy is the "shared"
    assert not torch.allclose(g0, g1, atol=1e-4)      # each stage sees only its own use
