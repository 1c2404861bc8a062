"""Fused all-gather+GEMM and GEMM+reduce-scatter against the unfused composition.

Each case runs on every rank of a gloo world (tp = 1, 2, 4) and checks the op's output and every
gradient (dx, dw, dbias, and the gradient through the returned gathered x) twice:
- against a dense single-process reference: every rank regenerates all ranks' tensors from seeds
  and computes the whole layer with plain torch ops and autograd, no communication at all;
- against the unfused composition through ``tpfuse.parallel.mappings`` (all-gather then GEMM;
  GEMM then reduce-scatter), which is what the ops replace.
Both the fused pipeline (threshold 0) and the fallback (threshold ∞) are run, and the path taken is
verified by making the other path's communication raise.

Tolerance (fp32; the bf16 test explains its own): the fused path sums the same products in another order (GEMMs per sequence
chunk, wgrad accumulated chunk by chunk, reduce-scatter partials added in ring order). Inputs are
N(0, 1) with reductions of length ≤ 37 (h, k) or ≤ 36·4 (wgrad over s·b rows); reordering such a
sum changes it by a few ulp of its terms' magnitude (≈ 6·2⁻²³·√len·|term| ≈ 1e-5 at
most; observed ≤ 8e-6 at tp = 2, 4), hence rtol = atol = 2e-5; a wrong chunk, rank or missing partial is off by O(1).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpfuse.kernels import ag_matmul, comm_gemm_common as common, matmul_rs
from tpfuse.kernels.ag_matmul import all_gather_matmul, all_gather_matmul_reference
from tpfuse.kernels.matmul_rs import matmul_reduce_scatter, matmul_reduce_scatter_reference
from tpfuse.parallel.comm_options import CommOptions

S, B, H, N = 12, 3, 37, 53           # sequence divisible by tp = 1, 2, 4; other dims odd
TOL = dict(rtol=2e-5, atol=2e-5)     # see the module docstring
ACTS = {None: lambda z: z, "relu": F.relu, "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what):
    assert actual is not None and expected is not None, f"{what}: missing gradient"
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, **TOL), f"{what}: max abs diff {err:.3e}"
    return err


@contextlib.contextmanager
def _forbid(module, name):
    """Make ``module.name`` raise inside the block (proves which path an op took)."""
    original = getattr(module, name)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.{name} called on the wrong path")

    setattr(module, name, refuse)
    try:
        yield
    finally:
        setattr(module, name, original)


ALWAYS_FUSED = CommOptions(fused_min_flops=0)
NEVER_FUSED = CommOptions(fused_min_flops=float("inf"))


def _path(fused, keep_gathered):
    """Options (threshold) for the path, and the functions only the other path calls."""
    if fused:
        # also without the kept x: the fused backward re-gathers it inside the dgrad ring, never
        # with a separate all-gather
        plain = [(ag_matmul, "reduce_scatter_first_dim"), (matmul_rs, "reduce_scatter_first_dim"),
                 (matmul_rs, "all_gather_first_dim"), (ag_matmul, "all_gather_first_dim")]
        return ALWAYS_FUSED, plain
    return NEVER_FUSED, [(common, "ring_all_gather"), (common, "ring_reduce_scatter")]


def _run(fn, fused, tp, keep_gathered=True):
    """``fn(options)`` with the options of the path, the other path's calls refused."""
    options, forbidden = _path(fused, keep_gathered)
    with contextlib.ExitStack() as stack:
        if tp > 1:
            for module, name in forbidden:
                stack.enter_context(_forbid(module, name))
        return fn(options)


# ----------------------------------------------------------------------------- all_gather_matmul

def _ag_tensors(q, bias, gathered_grad):
    """Rank q's weight shard, bias, output grad and (optional) grad of the gathered x."""
    w = _randn(100 + q, N, H)                                        # (n_local, h)
    b = _randn(200 + q, N) if bias else None                         # (n_local,)
    dy = _randn(300 + q, S, B, N)                                    # (s, b, n_local)
    dxf = _randn(400 + q, S, B, H) if gathered_grad else None        # (s, b, h)
    return w, b, dy, dxf


def _ag_dense_reference(tp, r, bias, act, gathered_grad):
    """Every rank's loss Σ_q <y_q, dy_q> (+ <x, dxf_q>) in one process → (y_r, dx_r, dw_r, db_r)."""
    x_full = _randn(7, S, B, H).requires_grad_(True)
    rows = S // tp
    for q in range(tp):
        w, b, dy, dxf = _ag_tensors(q, bias, gathered_grad)
        w.requires_grad_(True)
        if b is not None:
            b.requires_grad_(True)
        y = ACTS[act](F.linear(x_full, w, b))
        loss = (y * dy).sum() + ((x_full * dxf).sum() if dxf is not None else 0)
        loss.backward()
        if q == r:
            mine = (y.detach(), w.grad, b.grad if b is not None else None)
    dx_shard = x_full.grad[r * rows:(r + 1) * rows]
    return mine[0], dx_shard, mine[1], mine[2]


def _ag_case(tp, r, group, bias, act, fused, keep, gathered_grad, backend=None):
    rows = S // tp
    w, b, dy, dxf = _ag_tensors(r, bias, gathered_grad)
    leaves = [_randn(7, S, B, H)[r * rows:(r + 1) * rows].clone(), w, b]

    def grads_of(op):
        x_shard, w_, b_ = [t.clone().requires_grad_(True) if t is not None else None
                           for t in leaves]
        y, x_full = op(x_shard, w_, b_)
        loss = (y * dy).sum() + ((x_full * dxf).sum() if dxf is not None else 0)
        loss.backward()
        return y.detach(), x_shard.grad, w_.grad, (b_.grad if b_ is not None else None)

    fused_op = lambda options: lambda x, w_, b_: all_gather_matmul(   # noqa: E731
        x, w_, group, b_, act, return_gathered=True, keep_gathered=keep, backend=backend,
        options=options)
    got = _run(lambda options: grads_of(fused_op(options)), fused, tp, keep)
    expected = _ag_dense_reference(tp, r, bias, act, gathered_grad)
    name = (f"ag tp={tp} bias={bias} act={act} fused={fused} keep={keep} dxf={gathered_grad} "
            f"backend={backend}")
    errs = [_close(g, e, f"{name} {what}")
            for g, e, what in zip(got, expected, ("y", "dx", "dw", "dbias")) if e is not None]
    if bias and act == "gelu" and keep and not gathered_grad:        # the mappings composition
        comp = grads_of(lambda x, w_, b_: (all_gather_matmul_reference(x, w_, group, b_, act),
                                           torch.zeros(())))
        errs += [_close(g, c, f"{name} vs composition {what}")
                 for g, c, what in zip(got, comp, ("y", "dx", "dw", "dbias")) if c is not None]
    return max(errs)


def ag_worker(cases):
    tp, r = dist.get_world_size(), dist.get_rank()
    return max(_ag_case(tp, r, None, *case) for case in cases)


def _ag_cases():
    """(bias, activation, fused, keep_gathered, gathered x used elsewhere): every epilogue on the
    fused path; the fallback shares the epilogue code, so it gets two of them."""
    cases = [(bias, act, True, True, False) for bias in (False, True) for act in ACTS]
    cases += [(False, None, False, True, False), (True, "gelu", False, True, False)]
    cases += [(True, "gelu", fused, False, False) for fused in (True, False)]   # re-gather x
    cases += [(True, "relu", True, keep, True) for keep in (True, False)]
    cases += [(True, "relu", False, True, True)]
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_gather_matmul_matches_unfused(run_distributed, world_size):
    max_err = max(run_distributed(world_size, ag_worker, _ag_cases()))
    assert max_err < TOL["atol"]


# ----------------------------------------------------------------------------- matmul_reduce_scatter

def _rs_tensors(q):
    return _randn(500 + q, S, B, H), _randn(600 + q, N, H), _randn(700 + q, S, B, N)


def _rs_dense_reference(tp, r):
    """y_full = Σ_q x_q @ w_qᵀ in one process; rank q's grad is dy_full[q rows] = its dy rows."""
    rows = S // tp
    xs, ws = [], []
    for q in range(tp):
        x, w, _ = _rs_tensors(q)
        xs.append(x.requires_grad_(True))
        ws.append(w.requires_grad_(True))
    y_full = sum(F.linear(x, w) for x, w in zip(xs, ws))            # (s, b, n)
    dy_full = torch.cat([_rs_tensors(q)[2][q * rows:(q + 1) * rows] for q in range(tp)])
    (y_full * dy_full).sum().backward()
    return y_full.detach()[r * rows:(r + 1) * rows], xs[r].grad, ws[r].grad


def _rs_case(tp, r, fused, backend=None):
    rows = S // tp
    x, w, dy = _rs_tensors(r)
    dy_shard = dy[r * rows:(r + 1) * rows]

    def grads_of(op):
        x_, w_ = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = op(x_, w_)
        (y * dy_shard).sum().backward()
        return y.detach(), x_.grad, w_.grad

    got = _run(lambda options: grads_of(lambda x_, w_: matmul_reduce_scatter(
        x_, w_, None, backend=backend, options=options)), fused, tp)
    comp = grads_of(lambda x_, w_: matmul_reduce_scatter_reference(x_, w_, None))
    expected = _rs_dense_reference(tp, r)
    name = f"rs tp={tp} fused={fused} backend={backend}"
    return max([_close(g, e, f"{name} {what}") for g, e, what in zip(got, expected, "y dx dw".split())]
               + [_close(g, c, f"{name} vs composition {what}")
                  for g, c, what in zip(got, comp, "y dx dw".split())])


def rs_worker():
    tp, r = dist.get_world_size(), dist.get_rank()
    errs = [_rs_case(tp, r, fused) for fused in (True, False)]
    if tp > 1:
        with pytest.raises(ValueError, match=r"sequence dim 0 of size 13.*group size"):
            matmul_reduce_scatter(torch.zeros(13, B, H), torch.zeros(N, H), None)
    return max(errs)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matmul_reduce_scatter_matches_unfused(run_distributed, world_size):
    max_err = max(run_distributed(world_size, rs_worker))
    assert max_err < TOL["atol"]


# ----------------------------------------------------------------------------- Triton GEMMs

def triton_worker():
    """The fused pipelines around tpfuse.kernels.matmul's Triton kernel (interpreter on CPU)."""
    tp, r = dist.get_world_size(), dist.get_rank()
    return max(_ag_case(tp, r, None, True, "gelu", True, True, True, backend="triton"),
               _rs_case(tp, r, True, backend="triton"))


def test_fused_ops_with_triton_gemm(run_distributed):
    assert max(run_distributed(2, triton_worker)) < TOL["atol"]


# ----------------------------------------------------------------------------- bf16

def bf16_worker():
    """bf16 through both fused pipelines vs an fp32 dense reference on the same (bf16-valued)
    inputs. Outputs and grads are rounded to bf16 (8-bit mantissa: relative step 2⁻⁸ ≈ 4e-3) and
    the torch path's bf16 GEMM may round its products too, hence rtol = 3e-2 with atol = 3e-2 · the
    tensor's max magnitude; a wrong chunk or a missing partial is off by O(1)."""
    tp, r = dist.get_world_size(), dist.get_rank()
    rows = S // tp
    bf = lambda t: t.to(torch.bfloat16)                               # noqa: E731
    check = lambda got, want, what: _close_scaled(got.float(), want, what)   # noqa: E731
    x_full, w, b, dy = bf(_randn(7, S, B, H)), bf(_randn(100 + r, N, H)), bf(_randn(200 + r, N)), \
        bf(_randn(300 + r, S, B, N))
    x_shard = x_full[r * rows:(r + 1) * rows].clone().requires_grad_(True)
    w_, b_ = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = all_gather_matmul(x_shard, w_, None, b_, "gelu", options=ALWAYS_FUSED)
    y.backward(dy)
    ref_x = x_full.float().requires_grad_(True)                  # every rank's loss
    for q in range(tp):
        ref_w = bf(_randn(100 + q, N, H)).float().requires_grad_(True)
        ref_b = bf(_randn(200 + q, N)).float().requires_grad_(True)
        ref_y = F.gelu(F.linear(ref_x, ref_w, ref_b))
        ref_y.backward(bf(_randn(300 + q, S, B, N)).float())
        if q == r:
            check(y, ref_y.detach(), "bf16 ag y")
            check(w_.grad, ref_w.grad, "bf16 ag dw")
            check(b_.grad, ref_b.grad, "bf16 ag dbias")
    check(x_shard.grad, ref_x.grad[r * rows:(r + 1) * rows], "bf16 ag dx")
    x, w2, dy2 = (bf(t) for t in _rs_tensors(r))
    x_ = x.clone().requires_grad_(True)
    y2 = matmul_reduce_scatter(x_, w2, None, options=ALWAYS_FUSED)
    y2.backward(dy2[r * rows:(r + 1) * rows])
    y_full = sum(F.linear(*(t.to(torch.bfloat16).float() for t in _rs_tensors(q)[:2]))
                 for q in range(tp))
    check(y2, y_full[r * rows:(r + 1) * rows], "bf16 rs y")
    dy_full = torch.cat([bf(_rs_tensors(q)[2])[q * rows:(q + 1) * rows] for q in range(tp)])
    check(x_.grad, dy_full.float() @ w2.float(), "bf16 rs dx")
    return y.dtype == y2.dtype == torch.bfloat16


def _close_scaled(actual, expected, what):
    atol = 3e-2 * expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, rtol=3e-2, atol=atol), f"{what}: max abs diff {err:.3e}"


def test_fused_ops_in_bf16(run_distributed):
    assert all(run_distributed(2, bf16_worker))


# ----------------------------------------------------------------------------- sub-groups

def subgroup_worker():
    """tp=2 sub-groups {0, 1} and {2, 3} of a 4-rank world: ring peers are global ranks."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[dist.get_rank() // 2]
    r = dist.get_rank(group)
    err = _ag_case(2, r, group, True, "gelu", True, True, True)
    x, w, dy = _rs_tensors(r)
    y = matmul_reduce_scatter(x, w, group, options=ALWAYS_FUSED)
    y_full = sum(F.linear(*_rs_tensors(q)[:2]) for q in range(2))
    return max(err, _close(y, y_full[r * 6:(r + 1) * 6], "rs sub-group y"))


def test_fused_ops_on_sub_groups(run_distributed):
    assert max(run_distributed(4, subgroup_worker)) < TOL["atol"]


# ----------------------------------------------------------------------------- settings, errors

def test_threshold_setting_and_flag_parsing():
    defaults = CommOptions(fused_min_flops=None)                     # the per-device defaults
    for options in (None, defaults):
        assert common.get_fused_min_flops("cpu", options) == common.DEFAULT_MIN_FLOPS["cpu"]
        assert common.get_fused_min_flops("cuda", options) == common.DEFAULT_MIN_FLOPS["cuda"]
        assert not common.should_fuse(common.DEFAULT_MIN_FLOPS["cpu"] / 2, 2, "cpu", options)
        assert common.should_fuse(common.DEFAULT_MIN_FLOPS["cpu"], 2, "cpu", options)
        assert not common.should_fuse(common.DEFAULT_MIN_FLOPS["cpu"], 2, "cuda", options)
        assert not common.should_fuse(1e30, 1, "cpu", options)       # nothing to overlap at tp=1
    assert common.should_fuse(0, 2, "cuda", ALWAYS_FUSED) and common.should_fuse(0, 2, "cpu",
                                                                                ALWAYS_FUSED)
    assert not common.should_fuse(1e30, 2, "cpu", NEVER_FUSED)
    from tpfuse.training.arguments import build_parser, comm_options_from_args
    parse = lambda *argv: comm_options_from_args(build_parser().parse_args(list(argv)))  # noqa: E731
    assert parse("--fused-comm-min-flops", "1.5e9").fused_min_flops == 1.5e9
    assert parse().fused_min_flops is None
    with pytest.raises(SystemExit):                                  # argparse: not a number
        parse("--fused-comm-min-flops", "lots")
    with pytest.raises(ValueError, match="--fused-comm-min-flops.*-1"):
        parse("--fused-comm-min-flops", "-1")
    with pytest.raises(ValueError, match="fused_min_flops.*-1"):
        CommOptions(fused_min_flops=-1)


def threshold_worker():
    """At the default CPU threshold the tiny test layer takes the fallback (no ring call)."""
    x, w = _randn(1, S // 2, B, H), _randn(2, N, H)
    with _forbid(common, "ring_all_gather"), _forbid(common, "ring_reduce_scatter"):
        y = all_gather_matmul(x, w, None)
        y_rs = matmul_reduce_scatter(y, _randn(3, H, N), None)
    return tuple(y_rs.shape)


def test_default_threshold_picks_fallback_for_small_layers(run_distributed):
    assert run_distributed(2, threshold_worker) == [(S // 2, B, H)] * 2


@pytest.mark.parametrize("args, message", [
    (dict(w=torch.zeros(N, H + 1)), r"w must be \(n, k\) with k = .*37"),
    (dict(bias=torch.zeros(N + 1)), r"bias must have shape \(53,\), got \(54,\)"),
    (dict(activation="swish"), r"activation must be one of .*'swish'"),
    (dict(x=torch.zeros(H)), r"x must be \(s, b, k\)"),
])
def test_bad_arguments_raise_value_errors(args, message):
    call = dict(x=torch.zeros(S, B, H), w=torch.zeros(N, H), bias=None, activation=None)
    call.update(args)
    with pytest.raises(ValueError, match=message):
        all_gather_matmul(call["x"], call["w"], None, call["bias"], call["activation"])
    if "bias" not in args and "activation" not in args:
        with pytest.raises(ValueError, match=message):
            matmul_reduce_scatter(call["x"], call["w"], None)


# ----------------------------------------------------------------------------- symmetric memory

def test_symm_mem_kernel_compiles_for_hopper():
    """The GPU-only kernel type-checks and lowers for sm_90 here: tensor-core GEMM from the locally
    staged input, and the per-shard wait is an acquire (the copy engine's data is visible after
    the signal it wrote)."""
    from tpfuse.kernels.sm90_specs import symm_mem_cases
    from tpfuse.kernels.sm90_report import compile_sm90

    for _, _, kernel, constexprs, warps, stages, dtype, types in symm_mem_cases():
        ptx, meta = compile_sm90(kernel, constexprs, warps, stages, dtype, types)
        assert "wgmma.mma_async" in ptx and ".acquire" in ptx
        assert "ld.global.sys" not in ptx            # peers are never read by the GEMM itself


def symm_mem_worker():
    from tpfuse.kernels import ag_matmul, symm_mem_ag_matmul as symm

    torch.manual_seed(dist.get_rank())
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(256, 3, 96, device=device, dtype=torch.bfloat16)     # (s/tp, b, h)
    w = torch.randn(160, 96, device=device, dtype=torch.bfloat16)        # (n_local, h)
    bias = torch.randn(160, device=device, dtype=torch.bfloat16)
    errs = []
    for activation in (None, "gelu"):
        y, _, x_full = symm.forward(x, w, bias, None, activation, save_preact=False)
        ref = symm.forward_reference(x, w, bias, None, activation)
        # bf16 output: 8 bits of mantissa, |y| ≲ 30 → one rounding step ≈ 0.125
        errs.append((y.float() - ref.float()).abs().max().item())
        assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1), activation
        assert torch.equal(x_full, ag_matmul.all_gather_first_dim(x, None))
    return max(errs)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="symmetric-memory all_gather_matmul needs >= 2 CUDA GPUs on one node")
def test_symm_mem_forward_on_gpus():
    from tpfuse.parallel.launch import spawn
    assert max(spawn(symm_mem_worker, 2, backend="nccl")) < 2e-1
