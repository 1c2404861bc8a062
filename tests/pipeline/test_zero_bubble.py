"""Zero-bubble: the TP linear layers' and the grouped experts' weight gradients deferred to W,
and ZB-H1 against 1F1B.

1. Every TP linear path (column / row parallel; plain, sequence parallel through the ring
   comm-GEMMs and through their fallback; with and without ``main_grad``) backward inside an open
   I pass: the input gradient is the same as without deferral, the weight gradient is not there
   yet, and running the queue (W) produces exactly the gradient of the undeferred backward. The
   same GEMM on the same operands runs in both cases, so the comparison is exact, except on the
   fused ring paths: undeferred they accumulate dw chunk by chunk in the ring, deferred in one
   GEMM over the gathered operand, a different fp32 summation order: each entry sums s·b = 16
   products of O(1) values, whose reordering moves it by up to ~16 · eps(fp32) ≈ 1e-6 absolute
   (atol 2e-6; rtol 1e-5 for the larger entries).
   The MoE experts' grouped GEMM likewise (exact: the same wgrad GEMM either way).
2. A GPT training step under ZB-H1 gives the same per-micro-batch losses and gradients as the
   same model under 1F1B (pp 2 with tp 2, pp 4, and MoE at pp 2 with the expert loop, whose
   gradients stay in I, and with the grouped GEMM, whose wgrads go to W): W's queue accumulates
   the same GEMMs in the same micro-batch order, so the results are bitwise equal.
"""
import contextlib

import pytest
import torch

from support.tp_testing import chunk_of, seeded_randn

H, OUT, S, B = 8, 12, 8, 2


def _one_layer_step(layer, x, dy, deferred):
    """(dx, weight grad as the trainer would see it) after backward, optionally deferred."""
    from tpfuse.kernels.wgrad_deferral import WeightGradQueue, deferring_weight_grads

    x = x.clone().requires_grad_(True)
    out = layer(x)
    y = out[0] if isinstance(out, tuple) else out
    queue = WeightGradQueue()
    with deferring_weight_grads(queue, layer) if deferred else contextlib.nullcontext():
        y.backward(dy)
    weight = layer.weight
    held_back = None
    if deferred:
        assert len(queue) == 1
        held_back = (weight.main_grad.clone() if hasattr(weight, "main_grad")
                     else weight.grad)
        queue.run()
    grad = weight.main_grad.clone() if hasattr(weight, "main_grad") else weight.grad.clone()
    return x.grad.clone(), grad, held_back


def _linear_paths_body():
    from tpfuse.parallel.comm_options import CommOptions
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers import ColumnParallelLinear, RowParallelLinear

    state = ParallelState.initialize(tp=2)
    checked = []
    try:
        for kind in ("column", "row"):
            for sp, fused in ((False, False), (True, False), (True, True)):
                for main_grad in (False, True):
                    def build():                      # the same weights every time
                        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
                        torch.manual_seed(3)
                        layer = cls(H, OUT, sequence_parallel=sp, state=state,
                                    init_method=lambda w: w.normal_(0, H ** -0.5))
                        if main_grad:
                            layer.weight.main_grad = torch.zeros_like(layer.weight)
                        return layer

                    full_x = seeded_randn(1, S, B, H)
                    dy_full = seeded_randn(2, S, B, OUT)
                    if kind == "column":
                        x = chunk_of(full_x, state, 0) if sp else full_x
                        dy = chunk_of(dy_full, state, 2)            # (s, b, out/tp)
                    else:
                        x = chunk_of(full_x, state, 2)              # (s, b, in/tp)
                        dy = chunk_of(dy_full, state, 0) if sp else dy_full
                    state.comm_options = CommOptions(fused_min_flops=0 if fused else float("inf"))
                    dx, grad, _ = _one_layer_step(build(), x, dy, deferred=False)
                    dx_d, grad_d, held = _one_layer_step(build(), x, dy, deferred=True)
                    assert torch.equal(dx_d, dx), (kind, sp, fused, main_grad)
                    # nothing reached the gradient before W ran
                    assert held is None or not held.any(), (kind, sp, fused, main_grad)
                    if fused:
                        torch.testing.assert_close(grad_d, grad, rtol=1e-5, atol=2e-6)
                    else:
                        assert torch.equal(grad_d, grad), (kind, sp, fused, main_grad)
                    checked.append((kind, sp, fused, main_grad))
        return checked
    finally:
        state.destroy()


def test_tp_linear_weight_grads_are_deferred_to_w(run_distributed):
    results = run_distributed(2, _linear_paths_body)
    assert all(len(r) == 12 for r in results)


@pytest.mark.parametrize("backend, main_grad", [("torch", False), ("torch", True),
                                               ("triton", True)])
def test_grouped_expert_weight_grads_are_deferred_to_w(backend, main_grad):
    """The MoE experts' grouped GEMM: inside an I pass dx is the undeferred one, w's gradient is
    held back (one closure queued, counted in ``deferred_wgrads``), and W gives exactly the
    undeferred gradient (the same wgrad GEMM, added where autograd's gradient would go)."""
    from tpfuse.kernels.grouped_gemm import grouped_gemm
    from tpfuse.kernels.wgrad_deferral import WeightGradQueue, deferring_weight_grads

    sizes = [3, 0, 5]                                         # an empty group included
    x0, dy = seeded_randn(4, 8, H), seeded_randn(5, 8, OUT)   # (M, K), (M, N)
    done, outcomes = [], []
    for deferred in (False, True):
        w = torch.nn.Parameter(seeded_randn(6, 3, H, OUT))    # (G, K, N)
        if main_grad:
            w.main_grad = torch.zeros_like(w)
        w.after_deferred_wgrads = lambda: done.append(True)
        x = x0.clone().requires_grad_(True)
        queue = WeightGradQueue()
        with deferring_weight_grads(queue, [w]) if deferred else contextlib.nullcontext():
            grouped_gemm(x, w, sizes, backend=backend).backward(dy)
        if deferred:
            assert len(queue) == 1 and w.deferred_wgrads == 1 and w.grad is None
            assert not main_grad or not w.main_grad.any()     # nothing arrived before W
            queue.run()
            assert w.deferred_wgrads == 0 and done == [True]
        elif main_grad:                                       # the trainer's hook, by hand
            w.main_grad.add_(w.grad)
        outcomes.append((x.grad.clone(), (w.main_grad if main_grad else w.grad).clone()))
    (dx, dw), (dx_d, dw_d) = outcomes
    assert torch.equal(dx_d, dx) and torch.equal(dw_d, dw)


# ------------------------------------------------------------------ ZB-H1 vs 1F1B on a GPT

BASE = dict(hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=61,
            make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0,
            seed=11, num_layers=4)
M, MICRO = 4, 2


def _batches():
    gen = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 61, (MICRO, 8), generator=gen),
             torch.randint(0, 61, (MICRO, 8), generator=gen)) for _ in range(M)]


def _loss_func(output):
    loss = output.mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    ids, labels = next(data_iterator)
    return model(ids, labels=labels), _loss_func


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def _zb_vs_1f1b_body(tp, pp, sp, extra):
    from tpfuse.models import TransformerConfig, build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline.executor import (forward_backward_pipelining_without_interleaving,
                                          forward_backward_pipelining_zb_h1)

    state = ParallelState.initialize(tp=tp, pp=pp)
    try:
        config = TransformerConfig(**BASE, **extra, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, sequence_parallel=sp)
        chunk, = build_model(make_gpt_model_provider(config), config, state=state)
        runs = {}
        for name, func in (("1f1b", forward_backward_pipelining_without_interleaving),
                           ("zb-h1", forward_backward_pipelining_zb_h1)):
            chunk.zero_grad(set_to_none=True)
            losses = func(_forward_step, iter(_batches()), chunk, M, 8, MICRO, state=state)
            runs[name] = ([d["lm loss"] for d in losses],
                          {n: p.grad.clone() for n, p in chunk.named_parameters()})
        return runs
    finally:
        state.destroy()


@pytest.mark.parametrize("tp, pp, sp, extra", [(2, 2, True, {}), (1, 4, False, {}),
                                               (1, 2, False, MOE),     # expert loop: in I
                                               (1, 2, False, dict(MOE, moe_grouped_gemm=True))])
def test_zb_h1_losses_and_grads_equal_1f1b(run_distributed, tp, pp, sp, extra):
    results = run_distributed(tp * pp, _zb_vs_1f1b_body, tp, pp, sp, extra)
    for runs in results:
        reference_losses, reference_grads = runs["1f1b"]
        losses, grads = runs["zb-h1"]
        assert len(losses) == (M if losses else 0)
        assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
        assert grads.keys() == reference_grads.keys()
        assert not extra or any("experts" in name for name in grads)      # MoE layers built
        for name, grad in grads.items():
            assert torch.equal(grad, reference_grads[name]), name
    assert sum(len(runs["zb-h1"][0]) > 0 for runs in results) == tp   # last stage's TP ranks


# ------------------------------------------------------------------ choosing the schedule

@pytest.mark.parametrize("overrides, words", [
    (dict(pipeline_schedule="zb-h1"), ["pipeline_schedule='zb-h1'", "pipeline_model_parallel"]),
    (dict(pipeline_schedule="zb-h1", pipeline_model_parallel_size=2,
          virtual_pipeline_model_parallel_size=2), ["one model chunk", "=2"]),
    (dict(pipeline_schedule="gpipe", pipeline_model_parallel_size=2), ["pipeline_schedule",
                                                                        "gpipe"]),
])
def test_bad_schedule_settings_are_value_errors(overrides, words):
    from tpfuse.models import TransformerConfig

    with pytest.raises(ValueError) as info:
        TransformerConfig(**{**BASE, **overrides})
    for word in words:
        assert word in str(info.value)


def test_schedule_choice_and_trainer_flags():
    from tpfuse.models import TransformerConfig
    from tpfuse.pipeline import executor
    from tpfuse.training.arguments import parse_args

    def chosen(**overrides):
        config = TransformerConfig(**{**BASE, "pipeline_model_parallel_size": 2, **overrides})
        return executor.schedule_for(config.pipeline_model_parallel_size,
                                     config.virtual_pipeline_model_parallel_size,
                                     config.pipeline_schedule)

    assert chosen() is executor.forward_backward_pipelining_without_interleaving
    assert chosen(pipeline_schedule="zb-h1") is executor.forward_backward_pipelining_zb_h1
    assert chosen(virtual_pipeline_model_parallel_size=2) is \
        executor.forward_backward_pipelining_with_interleaving
    assert chosen(pipeline_schedule="interleaved") is \
        executor.forward_backward_pipelining_with_interleaving
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "8", "--vocab-size", "61", "--mock-data",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    config, _ = parse_args(argv)
    assert config.pipeline_schedule == "zb-h1"
    # overlapped gradient reduction waits for W's deferred weight gradients (test_invariance.py)
    assert parse_args(argv + ["--overlap-grad-reduce"])[1].data_parallel.overlap_grad_reduce
