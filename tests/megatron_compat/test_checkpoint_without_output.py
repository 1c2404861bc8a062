"""tensor_parallel.CheckpointWithoutOutput against the same function run without checkpointing.

The recomputation repeats the forward's arithmetic on the same inputs with the same RNG states
(dropout from the default generator and from a tracker stream), so the gradients are compared
exactly; random draws between forward and backward move every generator, so a recomputation
that did not restore them would draw other masks.
"""
import pytest
import torch
import torch.nn.functional as F

from tpfuse.megatron_compat.tensor_parallel import (CheckpointWithoutOutput,
                                                    get_cuda_rng_tracker,
                                                    model_parallel_cuda_manual_seed)
from tpfuse.megatron_compat.tensor_parallel.random import CheckpointWithoutOutput as in_random


@pytest.fixture
def seeded():
    def seed():
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    yield seed
    get_cuda_rng_tracker().reset()


def _leaves():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen).requires_grad_()
    w1 = torch.randn(8, 16, generator=gen).requires_grad_()
    w2 = torch.randn(16, 4, generator=gen).requires_grad_()
    return x, w1, w2


def _block(w1):
    """x @ w1, dropout from the default generator, gelu, dropout from the tracker stream;
    returns (h, gelu output) so tuple outputs are covered too."""
    def run(x):
        h = F.dropout(x @ w1, 0.3)
        with get_cuda_rng_tracker().fork():
            g = F.dropout(F.gelu(h), 0.4)
        return h, g
    return run


def _draw_between():
    torch.rand(100)
    with get_cuda_rng_tracker().fork():
        torch.rand(100)


def _rng_snapshot():
    return torch.get_rng_state(), get_cuda_rng_tracker().get_states()


def _same_rng(a, b):
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and \
        all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _reference(seeded):
    seeded()
    x, w1, w2 = _leaves()
    h, g = _block(w1)(x)
    y = (h + g) @ w2
    _draw_between()
    (y ** 2).sum().backward()
    return (h.detach(), g.detach()), [t.grad for t in (x, w1, w2)]


def test_same_gradients_as_without_checkpointing_and_storage_freed(seeded):
    (h_ref, g_ref), grads_ref = _reference(seeded)
    seeded()
    x, w1, w2 = _leaves()
    ckpt = CheckpointWithoutOutput()
    h, g = ckpt.checkpoint(_block(w1), x)
    assert torch.equal(h, h_ref) and torch.equal(g, g_ref)       # the forward's values
    y = (h + g) @ w2                                             # (h + g) saved by the matmul
    summed_input = y.grad_fn                                     # keeps the graph alive
    ckpt.discard_output_and_register_recompute(y)
    assert h.untyped_storage().size() == 0 and g.untyped_storage().size() == 0
    assert h.shape == h_ref.shape                                # metadata kept
    _draw_between()
    before_backward = _rng_snapshot()
    (y ** 2).sum().backward()
    assert summed_input is not None
    assert _same_rng(_rng_snapshot(), before_backward)           # the caller's streams kept
    assert torch.equal(h, h_ref) and torch.equal(g, g_ref)       # refilled in place
    for grad, grad_ref in zip([t.grad for t in (x, w1, w2)], grads_ref):
        assert torch.equal(grad, grad_ref)
    assert ckpt.ctx is None and ckpt.outputs is None             # nothing left to recompute


def test_megatron_home_and_backward_without_discard(seeded):
    assert in_random is CheckpointWithoutOutput
    _, grads_ref = _reference(seeded)
    seeded()
    x, w1, w2 = _leaves()
    h, g = CheckpointWithoutOutput().checkpoint(_block(w1), x)
    y = (h + g) @ w2
    _draw_between()
    (y ** 2).sum().backward()                                    # recomputed in backward
    for grad, grad_ref in zip([t.grad for t in (x, w1, w2)], grads_ref):
        assert torch.equal(grad, grad_ref)


def test_autograd_grad_and_fp8_are_refused(seeded):
    seeded()
    x, w1, w2 = _leaves()
    ckpt = CheckpointWithoutOutput(fp8=None)
    h, g = ckpt.checkpoint(_block(w1), x)
    y = (h + g) @ w2
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        torch.autograd.grad(y.sum(), [w2])
    with pytest.raises(ValueError, match="fp8"):
        CheckpointWithoutOutput(fp8="e4m3")
