"""Variable sequence lengths through the pipeline API (``config.variable_seq_lengths``, Megatron's
``--variable-seq-lengths``): micro-batches of three lengths through 1F1B, the interleaved
schedule and ZB-H1 on gloo equal one process over the same micro-batches, and every tensor's
shape sent ahead of it is that micro-batch's ``(length, b, h)``.

The toy stages are ``test_pipeline_executor``'s ``tanh(Linear(h, h))`` chain (length-agnostic);
the reference runs every stage in one process, scaling each loss by 1/m before backward. Same
tolerance and reason as there: the same fp32 ops in the same order, only BLAS threading may
differ (rtol 1e-5 / atol 1e-6, a few ulps of these O(1) values).
"""
import pytest
import torch

from test_pipeline_executor import HIDDEN, MICRO_BATCH, ToyStage

from tpfuse.pipeline.p2p import PipelineP2P, recv_ahead_for
from tpfuse.pipeline.plan import rank_plan

LENGTHS = (5, 2, 7, 2, 7, 5)    # per micro-batch: three lengths, each twice, unsorted


def _microbatches():
    generator = torch.Generator().manual_seed(11)
    return [{"x": torch.randn(length, MICRO_BATCH, HIDDEN, generator=generator),
             "y": torch.randn(length, MICRO_BATCH, HIDDEN, generator=generator)}
            for length in LENGTHS]


def _forward_step(data_iterator, chunk):
    batch = next(data_iterator)

    def loss_func(output_tensor):
        loss = ((output_tensor - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return chunk(batch["x"]), loss_func


def _reference(num_stages):
    stages = [ToyStage(s, num_stages, 1) for s in range(num_stages)]
    losses = []
    for batch in _microbatches():
        hidden = batch["x"]
        for stage in stages:
            stage.set_input_tensor(hidden)
            hidden = stage(batch["x"])
        loss = ((hidden - batch["y"]) ** 2).mean()
        losses.append(loss.detach())
        (loss / len(LENGTHS)).backward()
    return losses, {s: {n: p.grad for n, p in stage.named_parameters()}
                    for s, stage in enumerate(stages)}


def _variable_body(pp, vpp, schedule):
    """One step with variable lengths; the losses, local gradients and every shape sent ahead
    of a tensor as (message, shape)."""
    from tpfuse.parallel.state import ParallelState
    from tpfuse.pipeline import get_forward_backward_func

    state = ParallelState.initialize(pp=pp, vpp=vpp if vpp > 1 else None)
    sent_shapes, original = [], PipelineP2P._send_shape

    def recording_send_shape(comm, index, tensor):
        sent_shapes.append((comm._order[index], tuple(tensor.shape)))
        original(comm, index, tensor)

    PipelineP2P._send_shape = recording_send_shape
    try:
        chunks = [ToyStage(c * pp + state.pp_rank, pp * vpp, pp) for c in range(vpp)]
        for chunk in chunks:
            chunk.config.variable_seq_lengths = True
        batches = _microbatches()
        func = get_forward_backward_func(state, schedule)
        # seq_length is ignored with variable lengths (Megatron's semantics): pass a wrong one
        losses = func(_forward_step, [iter(batches) for _ in chunks], chunks, len(LENGTHS),
                      seq_length=1, micro_batch_size=MICRO_BATCH)
        return {"pp_rank": state.pp_rank, "losses": [d["loss"] for d in losses],
                "grads": {chunk.stage: {n: p.grad for n, p in chunk.named_parameters()}
                          for chunk in chunks},
                "sent_shapes": sent_shapes}
    finally:
        PipelineP2P._send_shape = original
        state.destroy()


@pytest.mark.parametrize("vpp,schedule", [(1, "1f1b"), (2, "interleaved"), (1, "zb-h1")])
def test_variable_lengths_match_one_process_and_send_each_shape(run_distributed, vpp, schedule):
    pp = 2
    results = run_distributed(pp, _variable_body, pp, vpp, schedule)
    ref_losses, ref_grads = _reference(pp * vpp)
    for result in results:
        if result["pp_rank"] == pp - 1:
            torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        for stage, grads in result["grads"].items():
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[stage][name], rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage} {name}")
    sent = [entry for result in results for entry in result["sent_shapes"]]
    # every activation (stage s -> s + 1) and gradient (s + 1 -> s) of every micro-batch, once
    assert len(sent) == 2 * (pp * vpp - 1) * len(LENGTHS)
    assert len({message for message, _ in sent}) == len(sent)
    for message, shape in sent:
        assert shape == (LENGTHS[message.microbatch], MICRO_BATCH, HIDDEN), message


def test_without_the_flag_another_length_is_refused_before_it_is_sent():
    """A fixed-shape pipeline refuses a tensor of another sequence length, naming the flag,
    before any communication (the group is never touched: None here)."""
    plan = rank_plan("1f1b", 2, 2, pp_rank=0)
    comm = PipelineP2P(plan.messages, plan.position, 0, [0, 1], None, (8, MICRO_BATCH, HIDDEN))
    message = plan.messages[0]
    with pytest.raises(ValueError, match=r"sequence length 6 differs from the pipeline's 8 .*"
                                         r"need --variable-seq-lengths"):
        comm.send(message, torch.zeros(6, MICRO_BATCH, HIDDEN))
    with pytest.raises(ValueError, match=r"^Message.*tensor shape \(8, 2, 4\) differs from the "
                                         r"pipeline tensor_shape \(8, 2, 8\)$"):
        comm.send(message, torch.zeros(8, MICRO_BATCH, 4))   # another mismatch: as before
    variable = PipelineP2P(plan.messages, plan.position, 0, [0, 1], None, None,
                           variable_seq_lengths=True)
    with pytest.raises(ValueError, match=r"tensor shape \(6, 16\) is not \(sequence, micro-batch"):
        variable.send(message, torch.zeros(6, 16))


def test_variable_lengths_keep_receives_in_strict_order():
    """Receives cannot be posted past a pending send with variable lengths (each needs its shape
    first): an explicit depth is refused by name, the default is 0 on every backend."""
    assert recv_ahead_for(None, "gloo", variable_seq_lengths=True) == 0
    assert recv_ahead_for(0, "nccl", variable_seq_lengths=True) == 0
    with pytest.raises(ValueError, match="p2p_recv_ahead=2 with variable_seq_lengths=True"):
        recv_ahead_for(2, "gloo", variable_seq_lengths=True)
    from tpfuse.models import TransformerConfig

    shape = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8)
    with pytest.raises(ValueError, match="p2p_recv_ahead=2 with variable_seq_lengths=True"):
        TransformerConfig(**shape, variable_seq_lengths=True, p2p_recv_ahead=2)
