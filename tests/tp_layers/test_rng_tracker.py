"""The model-parallel RNG tracker and where each dropout draws its randomness.

Rules (tp_layers/random.py): the caller seeds the default generator (``torch.manual_seed``;
``model_parallel_seed`` leaves it alone), the tracker's model-parallel stream is
``seed + 2718 + tp_rank``. Dropout on replicated activations (hidden dropout
without sequence parallelism) draws from the default generator, so its masks agree over TP ranks;
attention dropout (this rank's heads) and hidden dropout under sequence parallelism (this rank's
tokens) draw from the tracker stream, so masks differ over TP ranks. Expected values are computed
with fresh ``torch.Generator``s seeded by hand.
"""
import pytest
import torch

from support.tp_testing import gather_tp, seeded_randn, tp_layouts
from tpfuse.tp_layers import TransformerLayer, get_rng_tracker, model_parallel_seed
from tpfuse.tp_layers.random import RNGStatesTracker

S, B, H, P = 8, 2, 16, 0.5


def _stream(seed, n_draws, size=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(size, generator=gen) for _ in range(n_draws)]


def _seed_all(seed, state):
    torch.manual_seed(seed)
    model_parallel_seed(seed, state)


def _stream_values():
    for tp, state in tp_layouts((2, 4)):
        torch.manual_seed(99)
        model_parallel_seed(1234, state)          # must not re-seed the default generator
        tracked = _stream(1234 + 2718 + state.tp_rank, 2)
        default = _stream(99, 2)
        assert torch.equal(torch.rand(5), default[0])
        with get_rng_tracker().fork():
            first = torch.rand(5)
        with get_rng_tracker().fork():  # the stream continues where it stopped
            second = torch.rand(5)
        assert torch.equal(first, tracked[0]) and torch.equal(second, tracked[1])
        assert torch.equal(torch.rand(5), default[1]), "fork disturbed the default stream"
        firsts = gather_tp(first, state)
        assert all(not torch.equal(firsts[0], f) for f in firsts[1:]), "TP streams agree"
    return True


def _probe_layer(state, sp):
    """Zero weights, output biases 1: out − x = (mask_attn + mask_mlp) / (1 − p) exposes the masks."""
    layer = TransformerLayer(H, 4, 32, hidden_dropout=P, sequence_parallel=sp, state=state)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" not in name:
                param.fill_(1.0 if name.endswith(("linear_proj.bias", "linear_fc2.bias")) else 0.0)
    return layer.train()


def _masks(layer, state, sp, seed):
    _seed_all(seed, state)
    x = seeded_randn(1, S, B, H)
    x = torch.chunk(x, state.tp_size)[state.tp_rank] if sp else x
    with torch.no_grad():
        return torch.round((layer(x) - x) * (1 - P)).to(torch.int64)   # entries in {0, 1, 2}


def _streams_untouched(state, seed):
    """(default untouched, tracker untouched) after a forward that followed model_parallel_seed."""
    default_next = torch.equal(torch.rand(5), _stream(seed, 1)[0])
    with get_rng_tracker().fork():
        tracked_next = torch.equal(torch.rand(5), _stream(seed + 2718 + state.tp_rank, 1)[0])
    return default_next, tracked_next


def _hidden_dropout_placement():
    for tp, state in tp_layouts((2, 4)):
        for sp in (False, True):
            layer = _probe_layer(state, sp)
            masks = _masks(layer, state, sp, seed=7)
            default_untouched, tracker_untouched = _streams_untouched(state, 7)
            assert set(masks.unique().tolist()) == {0, 1, 2}, "both dropouts must be active"
            assert torch.equal(masks, _masks(layer, state, sp, seed=7)), "not reproducible"
            assert not torch.equal(masks, _masks(layer, state, sp, seed=8)), "seed ignored"
            per_rank = gather_tp(masks, state)
            if sp:   # this rank's tokens: tracker stream, masks differ over TP ranks
                assert all(not torch.equal(per_rank[0], m) for m in per_rank[1:])
                assert default_untouched and not tracker_untouched
            else:    # replicated activations: default stream, masks agree over TP ranks
                assert all(torch.equal(per_rank[0], m) for m in per_rank[1:])
                assert tracker_untouched and not default_untouched
    return True


def _attention_dropout_placement():
    for tp, state in tp_layouts((2, 4)):
        torch.manual_seed(0)
        layer = TransformerLayer(H, 4, 32, attention_dropout=P, init_method_std=0.5, state=state)
        x = seeded_randn(1, S, B, H)
        with torch.no_grad():
            reference = layer.eval()(x)
            _seed_all(11, state)
            out = layer.train()(x)
        default_untouched, tracker_untouched = _streams_untouched(state, 11)
        assert default_untouched and not tracker_untouched, "attention dropout must use the fork"
        assert not torch.allclose(out, reference), "attention dropout had no effect"
        outs = gather_tp(out, state)  # the output is replicated: identical on every TP rank
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    return True


def test_tracker_streams(run_distributed):
    assert run_distributed(4, _stream_values) == [True] * 4


def test_dropout_mask_placement(run_distributed):
    assert run_distributed(4, _hidden_dropout_placement) == [True] * 4
    assert run_distributed(4, _attention_dropout_placement) == [True] * 4


def test_tracker_errors_and_state_round_trip():
    tracker = RNGStatesTracker()
    with pytest.raises(RuntimeError, match="model_parallel_seed"):
        with tracker.fork():
            pass
    tracker.add("model-parallel-rng", 5)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 6)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)
    assert torch.equal(first, _stream(5, 1, size=4)[0])


def test_megatron_streams_and_state_format():
    """Megatron's three streams and seeds; states are {name: uint8 generator state}; the default
    generator is not touched; a state dict in Megatron's format restores the streams."""
    torch.manual_seed(5)
    expected_default = torch.rand(3)
    torch.manual_seed(5)
    model_parallel_seed(100)                  # single process: tp, ep, etp ranks 0
    assert torch.equal(torch.rand(3), expected_default), "model_parallel_seed re-seeded torch"
    tracker = get_rng_tracker()
    seeds = {"data-parallel-rng": 100, "model-parallel-rng": 100 + 2718,
             "expert-parallel-rng": 100 + 1024}
    states = tracker.get_states()
    assert sorted(states) == sorted(seeds) and tracker.is_initialized()
    for name, seed in seeds.items():
        assert states[name].dtype == torch.uint8
        with tracker.fork(name):
            assert torch.equal(torch.rand(4), _stream(seed, 1, size=4)[0]), name
    # a checkpoint's {name: state} (Megatron's rng_tracker_states) restores every stream
    fresh = RNGStatesTracker()
    fresh.set_states(states)
    for name, seed in seeds.items():
        with fresh.fork(name):
            assert torch.equal(torch.rand(4), _stream(seed, 1, size=4)[0]), name
    with pytest.raises(ValueError, match="uint8"):
        fresh.set_states({"model-parallel-rng": [1, 2]})
    if not torch.cuda.is_available():
        philox = torch.zeros(16, dtype=torch.uint8)            # a CUDA generator's state
        with pytest.raises(ValueError, match="CUDA"):
            tracker.set_states({**tracker.get_states(), "model-parallel-rng": philox})
    with pytest.raises(ValueError, match="seed 100 already exists"):
        tracker.add("another-rng", 100)


def test_nested_forks_continue_each_stream():
    """a inside b inside a: each stream continues where it stopped (the inner fork of a draws
    after the outer's first draw, the outer resumes after the inner's), b's draws are its own,
    and the default generator comes back unchanged."""
    tracker = RNGStatesTracker()
    tracker.add("a", 1234)
    tracker.add("b", 5678)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a_draws = [torch.rand(3)]
        with tracker.fork("b"):
            b_draws = [torch.rand(3)]
            with tracker.fork("a"):
                a_draws.append(torch.rand(3))
            b_draws.append(torch.rand(3))
        a_draws.append(torch.rand(3))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.cat(a_draws), torch.cat(_stream(1234, 3, size=3)))
    assert torch.equal(torch.cat(b_draws), torch.cat(_stream(5678, 2, size=3)))
    assert tracker.current_stream_ is None
