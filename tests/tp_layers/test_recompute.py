"""Activation recomputation: every mode keeps less for backward and gives the same gradients.

One or two TransformerLayers, fp32, dropout on (hidden and attention: the replayed random state
must reproduce the masks; the explicit attention path then materialises the probabilities, the
5as/h term of Korthikanti et al.) and off (the flash path). What autograd keeps is counted with
``SavedActivationBytes`` (saved_tensors_hooks; parameters excluded; an output freed by the
output-discarding checkpoint counts 0). Reference: the same layers, same seed, no recompute.

Gradients are compared exactly: a recomputed region re-runs the same ops on the same inputs with
the same random state, and every parameter receives one contribution, so nothing is reordered.
"""
import pytest
import torch

from tpfuse.tp_layers.checkpointing import SavedActivationBytes

S, B, H, HEADS = 16, 2, 64, 4


def _config(**overrides):
    from tpfuse.models import TransformerConfig

    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                vocab_size=64, seed=3)
    return TransformerConfig(**{**base, **overrides})


def _step(recompute, dropout, state=None, tp=1, sp=False):
    """(saved bytes of the two layers' forward, input grad, parameter grads)."""
    from tpfuse.models.recompute import run_layers
    from tpfuse.tp_layers import TransformerLayer
    from tpfuse.tp_layers.random import get_rng_tracker, model_parallel_seed

    config = _config(hidden_dropout=dropout, attention_dropout=dropout,
                     tensor_model_parallel_size=tp, sequence_parallel=sp, **recompute)
    modules = tuple(config.recompute_modules or ()) \
        if config.recompute_granularity == "selective" else ()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        TransformerLayer(H, HEADS, 4 * H, hidden_dropout=dropout, attention_dropout=dropout,
                         sequence_parallel=sp, recompute_modules=modules, state=state)
        for _ in range(2))
    get_rng_tracker().reset()
    model_parallel_seed(11, state=state)
    x = torch.randn(S // tp if sp else S, B, H, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)
    with SavedActivationBytes(exclude=list(layers.parameters())) as saved:
        out = run_layers(layers, x, None, config, training=True)
    nbytes = saved.nbytes
    out.backward(torch.ones_like(out))
    return nbytes, x.grad, {n: p.grad for n, p in layers.named_parameters()}


MODES = {
    "core_attn": dict(recompute_granularity="selective"),
    "layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "all-selective": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "layernorm", "mlp"]),
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_mode_keeps_less_and_gives_the_same_gradients(dropout):
    reference_bytes, reference_dx, reference_grads = _step({}, dropout)
    kept = {}
    for name, recompute in MODES.items():
        nbytes, dx, grads = _step(recompute, dropout)
        kept[name] = nbytes
        assert nbytes < reference_bytes, (name, nbytes, reference_bytes)
        assert torch.equal(dx, reference_dx), name
        for param, grad in grads.items():
            assert torch.equal(grad, reference_grads[param]), (name, param)
    # full recompute of both layers keeps only the input (s·b·h fp32) and nothing else
    assert kept["full-uniform"] == 4 * S * B * H
    assert kept["all-selective"] < min(kept[m] for m in ("core_attn", "layernorm", "mlp"))


def _distributed_body():
    from tpfuse.parallel.state import ParallelState

    state = ParallelState.initialize(tp=2)
    try:
        full = dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=2)
        plain = _step({}, 0.1, state, tp=2)
        kept = _step(full, 0.1, state, tp=2)
        spread = _step(dict(full, distribute_saved_activations=True), 0.1, state, tp=2)
        return plain, kept, spread
    finally:
        state.destroy()


def test_distribute_saved_activations_keeps_1_over_tp(run_distributed):
    for plain, kept, spread in run_distributed(2, _distributed_body):
        assert kept[0] == 4 * S * B * H            # the replicated input, whole
        assert spread[0] == 4 * S * B * H // 2     # this rank's half of it
        for result in (kept, spread):
            assert torch.equal(result[1], plain[1])
            for param, grad in result[2].items():
                assert torch.equal(grad, plain[2][param]), param
