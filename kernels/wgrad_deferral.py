"""Weight-gradient GEMMs held back from a backward pass until a pipeline schedule's W action.

Zero-bubble schedules split a stage's backward into I (the gradient w.r.t. the stage input, which
the previous stage waits for) and W (the weight gradients, which nobody waits for). The executor
runs I as an ordinary autograd backward inside :func:`deferring_weight_grads`; while it is open,
the weight-gradient helper of the TP linear layers (``kernels/wgrad.weight_grad``, also reached
by the ring comm-GEMMs' backward) and the MoE experts' grouped GEMM (``kernels/grouped_gemm``)
call :func:`defer_grad_of` with a closure that computes and accumulates the gradient, and the
closure is queued instead of run. The W action later runs the queue of that I pass
(:meth:`WeightGradQueue.run`), in the order the closures were queued.

Everything autograd computes itself (norm weights, biases, embeddings) still happens in I; only
code that asks to be deferred moves to W, so a model without such layers runs correctly with an
empty W. The open queue is execution state of the running I pass (like autograd's grad mode),
visible to the autograd engine's worker threads; outside an I pass nothing is deferred.
"""
from __future__ import annotations

import contextlib

import torch

_open_queue = None     # the WeightGradQueue of the I pass now running (None: compute at once)


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


@contextlib.contextmanager
def deferring_weight_grads(queue: WeightGradQueue):
    """Queue the weight gradients of the enclosed backward pass in ``queue``."""
    global _open_queue
    if _open_queue is not None:
        raise RuntimeError("deferring_weight_grads is already open (I passes do not nest)")
    _open_queue = queue
    try:
        yield queue
    finally:
        _open_queue = None


def weight_grads_deferred() -> bool:
    """True inside an I pass (weight gradients asked for now will be queued)."""
    return _open_queue is not None


def defer_weight_grad(closure) -> bool:
    """Queue ``closure`` when an I pass defers weight gradients (returns True), else return
    False and leave it to the caller to compute the gradient now."""
    if _open_queue is None:
        return False
    _open_queue.append(closure)
    return True


# ----------------------------------------------------------------------------- per weight

def defer_grad_of(weight: torch.Tensor, closure) -> None:
    """Queue ``closure`` (W's part of ``weight``'s gradient; it ends with
    :func:`deferred_grad_done`) and count it in ``weight.deferred_wgrads``: the data-parallel
    hooks take the weight's contribution for complete only when W has run every such closure.
    Only inside an I pass (``weight_grads_deferred()``)."""
    if not defer_weight_grad(closure):
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
