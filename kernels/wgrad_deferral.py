"""Weight-gradient GEMMs held back from a backward pass until a pipeline schedule's W action.

Zero-bubble schedules split a stage's backward into I (the gradient w.r.t. the stage input, which
the previous stage waits for) and W (the weight gradients, which nobody waits for). The I action
opens a :class:`WeightGradQueue` on the model chunk it runs (:func:`deferring_weight_grads`):
every parameter of the chunk holds the queue in ``param.wgrad_queue`` for the duration of that
backward pass. The weight-gradient helper of the TP linear layers (``kernels/wgrad.weight_grad``,
also reached by the ring comm-GEMMs' backward) and the MoE experts' grouped GEMM
(``kernels/grouped_gemm``) ask the weight they compute the gradient of
(:func:`weight_grads_deferred`, :func:`defer_grad_of`); a weight with an open queue gets a
closure that computes and accumulates the gradient queued instead of run. The W action later
runs the queue of that I pass (:meth:`WeightGradQueue.run`), in the order the closures were
queued.

Everything autograd computes itself (norm weights, biases, embeddings) still happens in I; only
code that asks to be deferred moves to W, so a model without such layers runs correctly with an
empty W. The queue travels with the weights, explicitly: nothing outside the chunk an I pass
runs is deferred, and the autograd engine's worker threads see it as the weights do.
"""
from __future__ import annotations

import contextlib

import torch

class WeightGradQueue:
    """The deferred weight-gradient closures of one I pass, run by its W action."""

    def __init__(self):
        self._closures: list = []

    def append(self, closure) -> None:
        self._closures.append(closure)

    def __len__(self) -> int:
        return len(self._closures)

    def run(self) -> int:
        """Run every queued closure once, oldest first, without building a graph (as the
        autograd engine runs backward); returns how many ran."""
        closures, self._closures = self._closures, []
        with torch.no_grad():
            for closure in closures:
                closure()
        return len(closures)


def _parameters(chunk) -> list:
    """The tensors a queue is opened on: a module's parameters, or the given tensors."""
    if isinstance(chunk, torch.nn.Module):
        return list(chunk.parameters())
    return list(chunk)


@contextlib.contextmanager
def deferring_weight_grads(queue: WeightGradQueue, chunk):
    """Queue the weight gradients of the enclosed backward pass in ``queue``: opened on the
    model chunk ``chunk`` (an ``nn.Module``, or an iterable of its weights) for the duration."""
    weights = _parameters(chunk)
    if any(getattr(w, "wgrad_queue", None) is not None for w in weights):
        raise RuntimeError("deferring_weight_grads is already open on this chunk "
                           "(I passes do not nest)")
    for w in weights:
        w.wgrad_queue = queue
    try:
        yield queue
    finally:
        for w in weights:
            w.wgrad_queue = None


def weight_grads_deferred(weight: torch.Tensor) -> bool:
    """True inside an I pass opened on ``weight`` (its gradient asked for now will be queued)."""
    return getattr(weight, "wgrad_queue", None) is not None


def defer_weight_grad(weight: torch.Tensor, closure) -> bool:
    """Queue ``closure`` when an I pass defers ``weight``'s gradient (returns True), else return
    False and leave it to the caller to compute the gradient now."""
    queue = getattr(weight, "wgrad_queue", None)
    if queue is None:
        return False
    queue.append(closure)
    return True


# ----------------------------------------------------------------------------- per weight

def defer_grad_of(weight: torch.Tensor, closure) -> None:
    """Queue ``closure`` (W's part of ``weight``'s gradient; it ends with
    :func:`deferred_grad_done`) and count it in ``weight.deferred_wgrads``: the data-parallel
    hooks take the weight's contribution for complete only when W has run every such closure.
    Only inside an I pass opened on ``weight`` (``weight_grads_deferred(weight)``)."""
    if not defer_weight_grad(weight, closure):
        raise RuntimeError("defer_grad_of outside an I pass: compute the weight gradient now")
    weight.deferred_wgrads = getattr(weight, "deferred_wgrads", 0) + 1


def add_deferred_grad(weight: torch.Tensor, dw: torch.Tensor) -> None:
    """Where W puts a weight gradient autograd did not get in I, as the undeferred backward would
    have: added to ``weight.main_grad`` (what the data-parallel hook does with autograd's
    gradient), else to ``weight.grad`` (set when absent, as ``AccumulateGrad`` does)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(dw)
    elif weight.grad is None:
        weight.grad = dw
    else:
        weight.grad.add_(dw)


def deferred_grad_done(weight: torch.Tensor) -> None:
    """One deferred closure of ``weight`` has run; after the last one,
    ``weight.after_deferred_wgrads()`` (set by the data-parallel buffers) counts this backward's
    contribution."""
    weight.deferred_wgrads -= 1
    done = getattr(weight, "after_deferred_wgrads", None)
    if weight.deferred_wgrads == 0 and done is not None:
        done()
