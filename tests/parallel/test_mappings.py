"""parallel/mappings.py: every primitive's forward and backward against hand-written expectations.

Rank q's input is ``x_q = (q + 1) * base + q`` (``base`` an arange), so each rank can write down
what an all-reduce (``Σ_q x_q``), a gather (``cat_q x_q``) or a split of any rank's tensor must be
without running a collective. Values are small integers stored in fp32, so every sum is exact and
the comparisons use ``torch.equal``.
"""
import pytest
import torch
import torch.distributed as dist

from tpfuse.parallel import mappings as M
from tpfuse.parallel.comm_options import CommOptions

S, B, H = 12, 3, 8          # sequence and hidden divide by 1, 2, 4; b odd


def _rank_tensor(q, shape, offset=0.0):
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return (q + 1) * base + q + offset


def _grad_of(fn, x, dy):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def _cat(fn, ranks, dim):
    return torch.cat([fn(q) for q in ranks], dim=dim)


def _check_all(group, ranks, options=None):
    """Run every primitive on ``group`` (whose members are global ``ranks``, in order); those
    that reduce-scatter with ``options``."""
    tp, r = len(ranks), ranks.index(dist.get_rank())
    xs = lambda q, shape=(S, B, H): _rank_tensor(q, shape)           # noqa: E731
    dys = lambda q, shape=(S, B, H): _rank_tensor(q, shape, 0.5)     # noqa: E731
    total = lambda f: sum(f(q) for q in range(tp))                    # noqa: E731
    rows, cols = S // tp, H // tp
    seq = slice(r * rows, (r + 1) * rows)
    hid = slice(r * cols, (r + 1) * cols)

    y, dx = _grad_of(lambda t: M.copy_to_region(t, group), xs(r), dys(r))
    assert torch.equal(y, xs(r)) and torch.equal(dx, total(dys)), "copy_to_region"

    # a vector and a matrix through one all-reduce: each grad is its own rank sum, unmixed
    inputs = [xs(r, (H,)).requires_grad_(True), xs(r, (S, H)).requires_grad_(True)]
    outputs = M.copy_many_to_region(inputs, group)
    torch.autograd.backward(outputs, [dys(r, (H,)), dys(r, (S, H))])
    assert all(torch.equal(y, x) for y, x in zip(outputs, inputs)), "copy_many_to_region"
    assert torch.equal(inputs[0].grad, total(lambda q: dys(q, (H,)))), "copy_many_to_region"
    assert torch.equal(inputs[1].grad, total(lambda q: dys(q, (S, H)))), "copy_many_to_region"

    y, dx = _grad_of(lambda t: M.reduce_from_region(t, group), xs(r), dys(r))
    assert torch.equal(y, total(xs)) and torch.equal(dx, dys(r)), "reduce_from_region"

    y, dx = _grad_of(lambda t: M.scatter_to_region(t, group), xs(r), dys(r, (S, B, cols)))
    assert torch.equal(y, xs(r)[..., hid]), "scatter_to_region forward"
    assert torch.equal(dx, _cat(lambda q: dys(q, (S, B, cols)), range(tp), -1)), \
        "scatter_to_region backward"

    y, dx = _grad_of(lambda t: M.gather_from_region(t, group), xs(r, (S, B, cols)), dys(r))
    assert torch.equal(y, _cat(lambda q: xs(q, (S, B, cols)), range(tp), -1)), "gather_from_region"
    assert torch.equal(dx, dys(r)[..., hid]), "gather_from_region backward"

    y, dx = _grad_of(lambda t: M.scatter_to_sequence_parallel_region(t, group), xs(r),
                     dys(r, (rows, B, H)))
    assert torch.equal(y, xs(r)[seq]), "scatter_to_sequence_parallel_region forward"
    assert torch.equal(dx, _cat(lambda q: dys(q, (rows, B, H)), range(tp), 0)), \
        "scatter_to_sequence_parallel_region backward"

    for tp_grad in (True, False):
        y, dx = _grad_of(
            lambda t: M.gather_from_sequence_parallel_region(t, group, tp_grad, options=options),
            xs(r, (rows, B, H)), dys(r))
        assert torch.equal(y, _cat(lambda q: xs(q, (rows, B, H)), range(tp), 0)), \
            "gather_from_sequence_parallel_region forward"
        expected = total(dys)[seq] if tp_grad else dys(r)[seq]
        assert torch.equal(dx, expected), f"gather_from_sequence_parallel_region backward {tp_grad}"

    y, dx = _grad_of(lambda t: M.reduce_scatter_to_sequence_parallel_region(
        t, group, options=options), xs(r), dys(r, (rows, B, H)))
    assert torch.equal(y, total(xs)[seq]), "reduce_scatter_to_sequence_parallel_region forward"
    assert torch.equal(dx, _cat(lambda q: dys(q, (rows, B, H)), range(tp), 0)), \
        "reduce_scatter_to_sequence_parallel_region backward"

    y, dx = _grad_of(lambda t: M.all_gather_last_dim_region(t, group, options=options),
                     xs(r, (S, B, cols)), dys(r))
    assert torch.equal(y, _cat(lambda q: xs(q, (S, B, cols)), range(tp), -1)), \
        "all_gather_last_dim_region forward"
    assert torch.equal(dx, total(dys)[..., hid]), "all_gather_last_dim_region backward"

    y, dx = _grad_of(lambda t: M.reduce_scatter_last_dim_region(t, group, options=options),
                     xs(r), dys(r, (S, B, cols)))
    assert torch.equal(y, total(xs)[..., hid]), "reduce_scatter_last_dim_region forward"
    assert torch.equal(dx, _cat(lambda q: dys(q, (S, B, cols)), range(tp), -1)), \
        "reduce_scatter_last_dim_region backward"

    # all-to-all: rank r receives block r of every rank's rows, in rank order
    y, dx = _grad_of(lambda t: M.all_to_all_region(t, group), xs(r), dys(r))
    assert torch.equal(y, _cat(lambda q: xs(q)[seq], range(tp), 0)), "all_to_all_region forward"
    assert torch.equal(dx, _cat(lambda q: dys(q)[seq], range(tp), 0)), "all_to_all_region backward"


def _check_value_errors(group):
    tp = M.group_size(group)
    odd = torch.zeros(S + 1, B, H + 1)             # 13 and 9: divisible by neither 2 nor 4
    calls = [
        (M.scatter_to_region, "dim -1 of size 9"),
        (M.scatter_to_sequence_parallel_region, "sequence dim 0 of size 13"),
        (M.reduce_scatter_to_sequence_parallel_region, "sequence dim 0 of size 13"),
        (M.reduce_scatter_first_dim, "sequence dim 0 of size 13"),
        (M.reduce_scatter_last_dim_region, "dim -1 of size 9"),
        (M.all_to_all_region, "sequence dim 0 of size 13"),
    ]
    for fn, message in calls:
        with pytest.raises(ValueError, match=message + r".*group size " + str(tp)):
            fn(odd, group)


def mapping_worker(strategy):
    options = CommOptions(reduce_scatter=strategy)
    world = dist.get_world_size()
    _check_all(None, list(range(world)), options)
    if world > 1:
        _check_value_errors(None)
    if world == 4:                              # explicit sub-groups {0, 1} and {2, 3}
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = [0, 1] if dist.get_rank() < 2 else [2, 3]
        _check_all(pairs[dist.get_rank() // 2], mine, options)
        _check_value_errors(pairs[dist.get_rank() // 2])
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_match_hand_expectations(run_distributed, world_size):
    results = run_distributed(world_size, mapping_worker, "native")
    results += run_distributed(world_size, mapping_worker, "all_reduce")
    results += run_distributed(world_size, mapping_worker, "auto")
    assert all(results)


def test_mappings_are_identity_at_group_size_one(run_distributed):
    assert run_distributed(1, mapping_worker, "native") == [True]
    x = torch.randn(4, 3, 5)
    for fn in (M.copy_to_region, M.reduce_from_region, M.scatter_to_region,
               M.gather_from_region, M.scatter_to_sequence_parallel_region,
               M.gather_from_sequence_parallel_region,
               M.reduce_scatter_to_sequence_parallel_region, M.all_gather_last_dim_region,
               M.reduce_scatter_last_dim_region, M.all_to_all_region):
        assert fn(x, None) is x, fn.__name__     # no process group in this process: size 1
    assert all(y is x for y in M.copy_many_to_region([x, x], None))
    assert M.default_tensor_parallel_group() is None       # no default state, no processes
    with pytest.raises(TypeError, match="tensor_parallel_output_grad"):
        M.gather_from_sequence_parallel_region(x, False)   # Megatron's order, native function


def test_unknown_reduce_scatter_strategy_is_rejected():
    with pytest.raises(ValueError, match="reduce-scatter strategy.*'ring'"):
        CommOptions(reduce_scatter="ring")
