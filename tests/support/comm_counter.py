"""Counts the bytes passed to torch.distributed collectives, by group kind, during one call.

``count_collectives(state, fn)`` runs ``fn()`` with the collectives the library calls wrapped
(``torch.distributed``'s functions, FSDP's ``all_gather_single`` / ``reduce_scatter_single``
included, and the module-level aliases of ``parallel/mappings.py``,
``parallel/reduce_scatter.py`` and ``training/data_parallel.py``) and returns
``{"<kind>_<op>": bytes}``: kind the first of ``KINDS`` whose group (of size > 1) is the call's
group (groups of the same ranks are one group: the etp group is the tp group when etp = tp), op
the collective. The byte count of a
call is its message: the input of an all-reduce, reduce-scatter or all-to-all, the gathered output
of an all-gather, the tensor of a send (receives are not counted: the sender's side counts).
Messages of at most ``SCALAR_BYTES`` (grad-norm and loss-log scalars) are left out.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch.distributed as dist

KINDS = ("tp", "dp-cp", "edp", "embedding", "cp", "tp-cp", "ep", "etp", "etp-ep", "pp",
         "intra-dp-cp", "inter-dp-cp", "intra-edp", "inter-edp")
SEND_KINDS = ("cp", "pp")
SCALAR_BYTES = 32           # norms, loss logs, flags: left out (the plan does not count them)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _kind_of(state, group, op) -> str:
    for name in SEND_KINDS if op == "send" else KINDS:
        if state.size(name) > 1 and state.group(name) is group:
            return name
    if group is None or group is dist.group.WORLD:
        return "world"
    return "other"


@contextlib.contextmanager
def counting(state):
    """Yields the ``{"<kind>_<op>": bytes}`` dict filled while the block runs."""
    from tpfuse.parallel import mappings, reduce_scatter
    from tpfuse.training import data_parallel

    counts = defaultdict(int)

    def record(op, group, nbytes):
        counts[f"{_kind_of(state, group, op)}_{op}"] += nbytes

    originals = {}

    def wrap(module, name, op, size_of):
        original = getattr(module, name)
        originals[(module, name)] = original

        def wrapper(*args, **kwargs):
            nbytes = size_of(*args, **kwargs)
            if nbytes > SCALAR_BYTES:
                record(op, kwargs.get("group"), nbytes)
            return original(*args, **kwargs)
        setattr(module, name, wrapper)

    first = lambda t, *a, **k: _nbytes(t)                        # noqa: E731
    # positional or by keyword (FSDP calls reduce_scatter_single(output=, input=))
    output = lambda *a, **k: _nbytes(a[0] if a else k["output_tensor"])       # noqa: E731
    second = lambda *a, **k: _nbytes(a[1] if len(a) > 1 else k["input"])      # noqa: E731
    wrap(dist, "all_reduce", "all_reduce", first)
    # torch's own names in torch.distributed, the private aliases in the library's modules (the
    # public reduce_scatter_tensor of parallel/reduce_scatter.py, imported into mappings, calls
    # one of these: wrapping it too would count its collective twice)
    for module, prefix in ((dist, ""), (mappings, "_"), (reduce_scatter, "_"),
                           (data_parallel, "_")):
        for name, op, size in (("all_gather_into_tensor", "all_gather", output),
                               ("reduce_scatter_tensor", "reduce_scatter", second),
                               ("all_gather_single", "all_gather", output),
                               ("reduce_scatter_single", "reduce_scatter", second)):
            name = prefix + name
            if hasattr(module, name) and (module, name) not in originals:
                wrap(module, name, op, size)
    wrap(dist, "all_to_all_single", "all_to_all", second)
    # isend: torch's P2POp accepts only torch.distributed.isend itself, so the wrapper replaces
    # it in both modules (batch_isend_irecv then calls the wrapper, group positional)
    import torch.distributed.distributed_c10d as c10d

    original_isend = dist.isend
    originals[(dist, "isend")] = originals[(c10d, "isend")] = original_isend

    def isend(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        record("send", group, _nbytes(tensor))
        return original_isend(tensor, *args, **kwargs)
    dist.isend = c10d.isend = isend
    try:
        yield counts
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
