"""Activation memory one TransformerLayer keeps for backward, per rank, next to Korthikanti et al.
(2022, Table 2, flash attention: no 5as/h term), at tp = 1, 2, 4 with and without sequence
parallelism (gloo processes on CPU; the count does not depend on the device).

    python -m tpfuse.tp_layers.activation_memory [--hidden 256 --heads 8 --seq 256 --batch 2]

Counted with ``torch.autograd.graph.saved_tensors_hooks`` during one forward: each saved tensor's
storage once, parameters excluded. The paper's count, in activation elements without dropout masks
(p = 0): 16·sbh/t with SP, 4·sbh + 12·sbh/t without (layer-norm inputs and outputs replicated);
plus the fp32 norm statistics and attention log-sum-exp (see tests/tp_layers/test_activation_memory.py, which
asserts the equality at a tiny shape; the attention output is already in the projection's layout).
"""
from __future__ import annotations

import argparse

import torch

MIB = 2.0 ** 20


def saved_activation_bytes(layer, x) -> int:
    """Bytes of the distinct storages ``layer(x)`` saves for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()                    # the saved tensors were all usable
    return sum(storages.values())


def paper_bytes(s, b, h, heads, tp, sequence_parallel, element_size=4, layout_copies=0):
    """Korthikanti et al.'s per-layer count for this layer (see the module docstring)."""
    sbh = s * b * h
    elements = 16 * sbh / tp if sequence_parallel else 4 * sbh + 12 * sbh / tp
    elements += layout_copies * sbh / tp
    stats_rows = s * b / (tp if sequence_parallel else 1)
    elements += 2 * 2 * stats_rows + b * (heads // tp) * s          # norm mean/rstd, attention lse
    return element_size * elements


def measure(tp, sequence_parallel, s, b, h, heads):
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers import TransformerLayer

    state = ParallelState.initialize(tp=tp) if tp > 1 else None
    torch.manual_seed(0)
    layer = TransformerLayer(h, heads, 4 * h, sequence_parallel=sequence_parallel, state=state)
    x = torch.randn(s // tp if sequence_parallel else s, b, h, requires_grad=True)
    try:
        return saved_activation_bytes(layer, x)
    finally:
        if state is not None:
            state.destroy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    from tpfuse.parallel.launch import spawn

    shape = (args.seq, args.batch, args.hidden, args.heads)
    print(f"TransformerLayer h={args.hidden} heads={args.heads} s={args.seq} b={args.batch} fp32, "
          f"gelu MLP 4h, no dropout: saved activations per rank")
    print(f"{'layout':12s} {'measured MiB':>12s} {'paper MiB':>10s}")
    for tp, sp in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        measured = measure(1, False, *shape) if tp == 1 else spawn(measure, tp, tp, sp, *shape)[0]
        expected = paper_bytes(*shape, tp, sp)
        print(f"{f'tp={tp}' + (' + SP' if sp else ''):12s} {measured / MIB:12.3f} {expected / MIB:10.3f}")


if __name__ == "__main__":
    main()
