"""Activation memory per TransformerLayer and rank for each recompute mode, next to Korthikanti et
al. (2022, "Reducing Activation Recomputation in Large Transformer Models").

One layer, h 256, 8 heads, s 256, b 2, fp32, no dropout (the flash-attention path: the paper's
5as/h term is gone already), at tp = 1 and tp = 2 with and without sequence parallelism (gloo
processes). What autograd keeps for backward is counted by ``SavedActivationBytes`` (each saved
storage once, parameters excluded, freed outputs count 0). Modes:

- ``none``                 paper: 16·sbh (tp 1), 4·sbh + 12·sbh/t (TP), 16·sbh/t (TP + SP) elements,
                           plus what this layer keeps besides (``activation_memory.paper_bytes``:
                           norm statistics, attention log-sum-exp, one layout copy)
- ``selective core_attn``  paper's selective recompute = ``none`` minus the 5as/h term, i.e. the
                           same count with flash attention (q/k/v are kept either way; what goes
                           is the attention output kept by the kernel and its statistics)
- ``selective all``        core_attn + layernorm + mlp (Megatron's module names); no paper figure
- ``full``                 the layer input only: sbh (tp 1, TP), sbh/t (TP + SP)
- ``full distributed``     the input kept 1/t per rank (tp 2, no SP): sbh/t

Memory is a count, not a timing: the numbers do not depend on machine load.

    python3 -m pytest benchmarks/test_bench_recompute_memory.py --benchmark-enable -q -s \
        -p no:cacheprovider
"""
import pytest
import torch

from tpfuse.tp_layers.activation_memory import paper_bytes
from tpfuse.parallel.launch import WorkerPool

S, B, H, HEADS = 256, 2, 256, 8
MIB = 2.0 ** 20
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MODES = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "layernorm", "mlp"]),
    "full": FULL,
    "full distributed": dict(FULL, distribute_saved_activations=True),
}


def _expected_bytes(mode, tp, sp):
    sbh = S * B * H
    if mode in ("none", "selective core_attn"):
        return paper_bytes(S, B, H, HEADS, tp, sp)
    if mode == "full":
        return 4 * sbh / (tp if sp else 1)
    if mode == "full distributed":
        return 4 * sbh / tp
    return None


def _measure(tp, sp):
    from tpfuse.models import TransformerConfig
    from tpfuse.models.recompute import run_layers
    from tpfuse.parallel.state import ParallelState
    from tpfuse.tp_layers import TransformerLayer
    from tpfuse.tp_layers.checkpointing import SavedActivationBytes

    state = ParallelState.initialize(tp=tp)
    try:
        measured = {}
        for mode, recompute in MODES.items():
            if recompute.get("distribute_saved_activations") and (tp == 1 or sp):
                continue
            config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS,
                                       seq_length=S, vocab_size=64, hidden_dropout=0.0,
                                       attention_dropout=0.0, tensor_model_parallel_size=tp,
                                       sequence_parallel=sp, **recompute)
            modules = tuple(config.recompute_modules or ()) \
                if config.recompute_granularity == "selective" else ()
            torch.manual_seed(0)
            layer = TransformerLayer(H, HEADS, 4 * H, sequence_parallel=sp,
                                     recompute_modules=modules, state=state)
            x = torch.randn(S // tp if sp else S, B, H, requires_grad=True)
            with SavedActivationBytes(exclude=list(layer.parameters())) as saved:
                out = run_layers([layer], x, None, config, training=True)
            measured[mode] = saved.nbytes
            out.sum().backward()                  # everything kept was usable
        return measured
    finally:
        state.destroy()


@pytest.fixture(scope="module")
def results():
    found = {}
    with WorkerPool(1) as pool:
        found[(1, False)] = pool.run(_measure, 1, False)[0]
    with WorkerPool(2) as pool:
        for sp in (False, True):
            found[(2, sp)] = pool.run(_measure, 2, sp)[0]
    return found


def test_recompute_memory_per_layer(benchmark, results):
    benchmark.group = "activation memory per layer and rank, recompute modes"
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nTransformerLayer h={H} heads={HEADS} s={S} b={B} fp32, no dropout: saved activations "
          "per rank, MiB (measured | paper)")
    header = f"{'mode':22s}" + "".join(f"{name:>22s}" for name in
                                        ("tp=1", "tp=2", "tp=2 + SP"))
    print(header)
    for mode in MODES:
        cells = []
        for layout in ((1, False), (2, False), (2, True)):
            measured = results[layout].get(mode)
            expected = _expected_bytes(mode, *layout)
            if measured is None:
                cells.append(f"{'-':>22s}")
                continue
            text = f"{measured / MIB:.3f} | " + ("-" if expected is None else
                                                f"{expected / MIB:.3f}")
            cells.append(f"{text:>22s}")
            benchmark.extra_info[f"{mode} tp{layout[0]}{' sp' if layout[1] else ''}"] = measured
        print(f"{mode:22s}" + "".join(cells))
    for layout, measured in results.items():
        assert all(measured[m] < measured["none"] for m in measured if m != "none"), layout
        assert measured["full"] == _expected_bytes("full", *layout)
