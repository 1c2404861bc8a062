"""The pipeline executor on gloo against a single-process model with gradient accumulation.

The toy pipelined model is a chain of p·v stages, each ``tanh(Linear(h, h))`` with weights drawn
from a per-stage seed, so any layout builds the same stages; virtual stage s lives on pp rank
s mod p as chunk s // p. The loss is the MSE against a target; the reference runs all stages in
one process over the same micro-batches, scaling each loss by 1/m before backward.

Tolerance: every stage does the same fp32 ops in the same order in both runs and gradients
accumulate over micro-batches in the same (ascending) order on each chunk, so results agree to
rounding; only BLAS kernels may differ between the main process (several threads) and the
1-thread workers. rtol 1e-5 / atol 1e-6 is a few ulps of these O(1) values.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tpfuse.kernels.wgrad_deferral import defer_weight_grad
from tpfuse.pipeline.executor import (
    forward_backward_pipelining_with_interleaving, forward_backward_pipelining_zb_h1,
    forward_backward_pipelining_without_interleaving, get_forward_backward_func)

HIDDEN, SEQ, MICRO_BATCH = 8, 3, 2
_ACTIVE_STATE = None   # the ParallelState of the running job (checked by forward_step)


class _DeferringLinear(torch.autograd.Function):
    """x Wᵀ + b whose weight gradient asks to be deferred (what the TP linears do under ZB)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stage):
        ctx.save_for_backward(x, weight)
        ctx.stage = stage
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, dy):                                   # dy (s, b, h)
        x, weight = ctx.saved_tensors

        def weight_grad():                                   # dW = dyᵀ x over all tokens
            grad = dy.reshape(-1, HIDDEN).t() @ x.reshape(-1, HIDDEN)
            weight.grad = grad if weight.grad is None else weight.grad + grad
            ctx.stage.deferred_ran += 1

        if not defer_weight_grad(weight, weight_grad):
            weight_grad()
        return dy @ weight, None, dy.sum((0, 1)), None


class ToyStage(nn.Module):
    """Virtual stage ``stage`` of ``num_stages``: tanh(x Wᵀ + b); stage 0 reads the data.
    ``deferring``: the weight gradient goes through ``defer_weight_grad``."""

    def __init__(self, stage: int, num_stages: int, pp_size: int, deferring: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(1234 + stage)
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.5)
            self.linear.bias.copy_(torch.randn(HIDDEN, generator=generator) * 0.1)
        self.stage, self.vp_stage = stage, stage // pp_size
        self.pre_process, self.post_process = stage == 0, stage == num_stages - 1
        self.config = SimpleNamespace(hidden_size=HIDDEN, sequence_parallel=False,
                                      params_dtype=torch.float32)
        self.input_tensor = None
        self.outputs = []   # every forward output, to check the executor freed them
        self.deferring, self.deferred_ran = deferring, 0

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, tokens):
        hidden = tokens if self.pre_process else self.input_tensor   # (s, b, h)
        if self.deferring:
            output = torch.tanh(_DeferringLinear.apply(hidden, self.linear.weight,
                                                       self.linear.bias, self))
        else:
            output = torch.tanh(self.linear(hidden))
        self.outputs.append(output)
        return output


def make_microbatches(num_microbatches):
    generator = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator),
             "y": torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator)}
            for _ in range(num_microbatches)]


def forward_step(data_iterator, chunk):
    batch = next(data_iterator)   # every chunk reads its own iterator once per micro-batch
    if _ACTIVE_STATE is not None and _ACTIVE_STATE.vpp_size is not None:
        assert _ACTIVE_STATE.vpp_rank == chunk.vp_stage
    output = chunk(batch["x"])

    def loss_func(output_tensor):
        loss = ((output_tensor - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def reference(num_stages, num_microbatches, forward_only=False):
    """Single process: all stages in a row, gradient accumulation of loss / m."""
    stages = [ToyStage(s, num_stages, 1) for s in range(num_stages)]
    losses = []
    for batch in make_microbatches(num_microbatches):
        hidden = batch["x"]
        for stage in stages:
            stage.set_input_tensor(hidden)
            hidden = stage(batch["x"])
        loss = ((hidden - batch["y"]) ** 2).mean()
        losses.append(loss.detach())
        if not forward_only:
            (loss / num_microbatches).backward()
    grads = {s: {n: p.grad for n, p in stage.named_parameters()} for s, stage in enumerate(stages)}
    return losses, grads


# ------------------------------------------------------------------ worker bodies

def _pipeline_body(pp, vpp, m, group_size, forward_only, explicit_shape, direct,
                   deferring=False, recv_ahead=None):
    """One step on every rank; returns losses and each local stage's gradients (receives
    posted ahead as ``config.p2p_recv_ahead``; None: gloo's default)."""
    global _ACTIVE_STATE
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(pp=pp, vpp=vpp if vpp > 1 else None)
    _ACTIVE_STATE = state
    try:
        chunks = [ToyStage(c * pp + state.pp_rank, pp * vpp, pp, deferring) for c in range(vpp)]
        for chunk in chunks:
            chunk.config.p2p_recv_ahead = recv_ahead
        batches = make_microbatches(m)
        iterators = [iter(batches) for _ in chunks]
        kwargs = dict(forward_only=forward_only,
                      tensor_shape=(SEQ, MICRO_BATCH, HIDDEN) if explicit_shape else None)
        if direct == "interleaved":
            func = forward_backward_pipelining_with_interleaving
            kwargs.update(state=state, microbatch_group_size=group_size)
        elif direct == "zb-h1":
            func = forward_backward_pipelining_zb_h1
            kwargs.update(state=state)
        else:
            func = get_forward_backward_func(state)
            if group_size is not None:
                for chunk in chunks:
                    chunk.config.microbatch_group_size_per_vp_stage = group_size
        model, data = (chunks, iterators) if vpp > 1 or direct else (chunks[0], iterators[0])
        losses = func(forward_step, data, model, m, SEQ, MICRO_BATCH, **kwargs)
        grads = {chunk.stage: {n: p.grad for n, p in chunk.named_parameters()}
                 for chunk in chunks}
        # sent outputs were deallocated (storage swapped for 1 element) unless forward_only
        freed = [out.numel() == 1 for chunk in chunks if not chunk.post_process
                 for out in chunk.outputs]
        assert len(freed) == m * (vpp - int(state.pp_rank == pp - 1))
        assert all(freed) if not forward_only else not any(freed)
        return {"pp_rank": state.pp_rank, "losses": [d["loss"] for d in losses],
                "grads": grads, "func": func.__name__,
                "deferred_ran": sum(chunk.deferred_ran for chunk in chunks)}
    finally:
        _ACTIVE_STATE = None
        state.destroy()


def _no_pipelining_body(m):
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(pp=1)
    try:
        stage = ToyStage(0, 1, 1)
        func = get_forward_backward_func(state)
        losses = func(forward_step, iter(make_microbatches(m)), [stage], m, SEQ, MICRO_BATCH)
        return {"pp_rank": 0, "losses": [d["loss"] for d in losses], "func": func.__name__,
                "grads": {0: {n: p.grad for n, p in stage.named_parameters()}}}
    finally:
        state.destroy()


def _check_against_reference(results, pp, vpp, m, forward_only=False):
    ref_losses, ref_grads = reference(pp * vpp, m, forward_only)
    for result in results:
        if result["pp_rank"] == pp - 1:   # the last stage keeps the losses of its last chunk
            torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        else:
            assert result["losses"] == []
        assert sorted(result["grads"]) == [c * pp + result["pp_rank"] for c in range(vpp)]
        for stage, grads in result["grads"].items():
            for name, grad in grads.items():
                if forward_only:
                    assert grad is None, (stage, name)
                else:
                    torch.testing.assert_close(grad, ref_grads[stage][name], rtol=1e-5,
                                               atol=1e-6, msg=f"stage {stage} {name}")


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("pp, vpp, m, group_size, forward_only, explicit_shape", [
    (2, 1, 3, None, False, False),    # 1F1B
    (2, 1, 1, None, False, True),     # fewer micro-batches than stages
    (2, 2, 4, None, False, False),    # interleaved at pp=2: one peer is both prev and next
    (2, 2, 4, 4, False, True),        # g > p: the physical link is reordered (see schedules)
    (2, 3, 6, 3, False, False),
    (2, 2, 4, None, True, False),     # forward only
])
def test_pipeline_world2_matches_single_process(run_distributed, pp, vpp, m, group_size,
                                                forward_only, explicit_shape):
    results = run_distributed(2, _pipeline_body, pp, vpp, m, group_size, forward_only,
                              explicit_shape, None)
    expected = ("forward_backward_pipelining_with_interleaving" if vpp > 1
                else "forward_backward_pipelining_without_interleaving")
    assert {r["func"] for r in results} == {expected}
    _check_against_reference(results, pp, vpp, m, forward_only)


@pytest.mark.parametrize("pp, vpp, m, group_size, forward_only", [
    (4, 1, 6, None, False),
    (4, 2, 8, None, False),
    (4, 2, 4, None, False),    # warm-up capped at m·v on early ranks: all forwards first
    (2, 2, 6, 3, False),       # pp=2 × dp=2: pipelines over ranks [0, 2] and [1, 3]
    (4, 1, 5, None, True),
])
def test_pipeline_world4_matches_single_process(run_distributed, pp, vpp, m, group_size,
                                                forward_only):
    results = run_distributed(4, _pipeline_body, pp, vpp, m, group_size, forward_only, False,
                              None)
    _check_against_reference(results, pp, vpp, m, forward_only)


@pytest.mark.parametrize("recv_ahead, world, pp, vpp, m", [
    (0, 2, 2, 2, 4),        # the strict order (what NCCL runs)
    (1000, 2, 2, 2, 4),     # every receive of the step posted at the first p2p operation
    (1, 4, 4, 2, 8)])
def test_receives_posted_ahead_match_single_process(run_distributed, recv_ahead, world, pp,
                                                    vpp, m):
    # the other tests run gloo's default depth; these the two ends and a minimal one
    results = run_distributed(world, _pipeline_body, pp, vpp, m, None, False, False, None,
                              recv_ahead=recv_ahead)
    _check_against_reference(results, pp, vpp, m)


def test_interleaved_function_with_one_chunk(run_distributed):
    # Megatron's interleaved function at v = 1 uses warm-up 2·(p − r − 1): another order than
    # 1F1B, same gradients
    results = run_distributed(2, _pipeline_body, 2, 1, 4, None, False, False, "interleaved")
    _check_against_reference(results, 2, 1, 4)


@pytest.mark.parametrize("world, m, forward_only, deferring", [
    (2, 3, False, False), (2, 3, False, True), (4, 6, False, True), (4, 4, True, True)])
def test_zb_h1_matches_single_process(run_distributed, world, m, forward_only, deferring):
    # I sends the input gradient at once; the weight gradients the stage defers run in W (up
    # to r pending on rank r): same losses and gradients as the reference
    results = run_distributed(world, _pipeline_body, world, 1, m, None, forward_only, False,
                              "zb-h1", deferring=deferring)
    _check_against_reference(results, world, 1, m, forward_only)
    for result in results:   # every micro-batch's weight gradient ran in a W action (or none)
        assert result["deferred_ran"] == (m if deferring and not forward_only else 0)


def test_no_pipelining_world1(run_distributed):
    results = run_distributed(1, _no_pipelining_body, 3)
    assert results[0]["func"] == "forward_backward_no_pipelining"
    _check_against_reference(results, 1, 1, 3)


# ------------------------------------------------------------------ bad input, no processes

def _fake_state(pp_size=2, vpp_size=2):
    return SimpleNamespace(pp_size=pp_size, pp_rank=0, vpp_size=vpp_size, vpp_rank=0, tp_size=1,
                           cp_size=1, ranks=lambda name: list(range(pp_size)), pp_group=None)


def _two_chunks():
    return [ToyStage(0, 4, 2), ToyStage(2, 4, 2)]


@pytest.mark.parametrize("call, words", [
    (lambda: forward_backward_pipelining_with_interleaving(
        forward_step, iter([]), _two_chunks(), 4, SEQ, MICRO_BATCH, state=_fake_state()),
     ["data_iterator", "list"]),
    (lambda: forward_backward_pipelining_with_interleaving(
        forward_step, [None], _two_chunks(), 4, SEQ, MICRO_BATCH, state=_fake_state()),
     ["1 iterators", "2 model chunks"]),
    (lambda: forward_backward_pipelining_with_interleaving(
        forward_step, None, _two_chunks(), 4, SEQ, MICRO_BATCH, state=_fake_state(vpp_size=3)),
     ["2 chunks", "vpp_size is 3"]),
    (lambda: forward_backward_pipelining_with_interleaving(
        forward_step, None, _two_chunks(), 3, SEQ, MICRO_BATCH, state=_fake_state()),
     ["num_microbatches=3", "mod"]),
    (lambda: forward_backward_pipelining_without_interleaving(
        forward_step, None, ToyStage(0, 2, 2), 0, SEQ, MICRO_BATCH, state=_fake_state(2, None)),
     ["num_microbatches", "0"]),
    (lambda: forward_backward_pipelining_without_interleaving(
        forward_step, None, nn.Linear(2, 2), 2, SEQ, MICRO_BATCH, state=_fake_state(2, None)),
     ["tensor_shape", "config"]),
])
def test_bad_input_raises_before_communication(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_schedule_choice_from_the_layout_sizes():
    from tpfuse.pipeline.executor import schedule_for

    assert schedule_for(1, None).__name__ == "forward_backward_no_pipelining"
    assert schedule_for(4, None) is forward_backward_pipelining_without_interleaving
    assert schedule_for(4, 2) is forward_backward_pipelining_with_interleaving


def test_weight_grad_queue_defers_only_inside_an_open_pass():
    from tpfuse.kernels.wgrad_deferral import WeightGradQueue, deferring_weight_grads

    ran = []
    chunk = nn.Linear(2, 2)
    weight = chunk.weight
    assert not defer_weight_grad(weight, lambda: ran.append("now"))   # no I pass: caller computes
    queue = WeightGradQueue()
    with deferring_weight_grads(queue, chunk):
        assert defer_weight_grad(weight, lambda: ran.append(torch.is_grad_enabled()))
        assert defer_weight_grad(weight, lambda: ran.append("second"))
        assert not defer_weight_grad(torch.zeros(2), lambda: None)   # not a weight of the chunk
        with pytest.raises(RuntimeError, match="do not nest"):
            with deferring_weight_grads(WeightGradQueue(), chunk):
                pass
    assert ran == [] and len(queue) == 2
    assert not defer_weight_grad(weight, lambda: None)                 # closed again
    assert queue.run() == 2 and ran == [False, "second"]       # in order, without a graph
    assert queue.run() == 0
