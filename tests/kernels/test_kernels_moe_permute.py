"""permute_tokens / unpermute_tokens: the Triton kernels (interpreter) and the torch path against
a Python loop over the slots, forward and every gradient, fp32 and bf16; and the round trip.

Tolerances: permute only moves values, so it must be exact. unpermute sums k ≤ 3 products in fp32
and rounds once to the output dtype: |err| ≤ k·u32·Σ|p·r| + u_out·|y| (u32 = 2⁻²⁴, u_bf16 = 2⁻⁸);
the probability gradient is an H-term dot product: H·u32·Σ|dy·r| (plus u_fp32 of the result).
We allow twice these. A slot routed to a wrong row or a missed unused-slot mask is off by O(1).
"""
import pytest
import torch

from tpfuse.kernels.moe_permute import permute_tokens, unpermute_tokens

T, K, H, R = 7, 3, 37, 24     # 21 slots, 3 of them unused, into 24 rows (6 rows stay empty)


def _row_map(seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(R, generator=gen)[:T * K].view(T, K).clone()
    rows[1, 2] = rows[4, 0] = rows[6, 1] = -1        # dropped slots
    return rows


def _loop_permute(x, row_map):
    rows = torch.zeros(R, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            if row_map[t, j] >= 0:
                rows[row_map[t, j]] = x[t].double()
    return rows


def _loop_unpermute(rows, row_map, probs):
    y = torch.zeros(T, rows.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            if row_map[t, j] >= 0:
                p = 1.0 if probs is None else probs[t, j].double()
                y[t] = y[t] + p * rows[row_map[t, j]].double()
    return y


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_moves_rows_exactly_and_its_gradient_gathers(backend, dtype, poisoned_outputs):
    gen = torch.Generator().manual_seed(1)
    row_map = _row_map()
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    drows = torch.randn(R, H, generator=gen).to(dtype)
    rows = permute_tokens(x, row_map, R, backend=backend)
    assert torch.equal(rows.double(), _loop_permute(x.detach(), row_map))
    (dx,) = torch.autograd.grad(rows, [x], drows)
    expected = _loop_unpermute(drows, row_map, None)         # Σ_j drows[row_map[t, j]]
    terms_abs = _loop_unpermute(drows.abs(), row_map, None)
    bound = 2 * (K * 2.0**-24 * terms_abs + (2.0**-8 if dtype != torch.float32 else 0)
                 * expected.abs())
    assert ((dx.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_and_its_gradients_match_the_loop(backend, dtype, poisoned_outputs):
    gen = torch.Generator().manual_seed(2)
    row_map = _row_map(3)
    rows = torch.randn(R, H, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(T, K, generator=gen).requires_grad_()           # fp32, as the router's
    dy = torch.randn(T, H, generator=gen).to(dtype)
    y = unpermute_tokens(rows, row_map, probs, backend=backend)
    drows, dprobs = torch.autograd.grad(y, [rows, probs], dy)

    rows64, probs64 = (t.detach().double().requires_grad_() for t in (rows, probs))
    y_ref = _loop_unpermute(rows64, row_map, probs64)
    drows_ref, dprobs_ref = torch.autograd.grad(y_ref, [rows64, probs64], dy.double())
    u_out = 2.0**-8 if dtype != torch.float32 else 0.0
    y_abs = _loop_unpermute(rows.detach().abs(), row_map, probs.detach())
    assert y.dtype == dtype and dprobs.dtype == torch.float32
    assert ((y.double() - y_ref).abs() <= 2 * (K * 2.0**-24 * y_abs + u_out * y_ref.abs())).all()
    # one fp32 product p·dy, then one rounding to the rows' dtype
    assert ((drows.double() - drows_ref).abs() <= 2 * (2.0**-24 + u_out) * drows_ref.abs()).all()
    unused = sorted(set(range(R)) - set(row_map[row_map >= 0].tolist()))
    assert (drows[unused] == 0).all(), "rows nobody reads get a zero gradient"
    dot_abs = (dy.double().abs()[:, None, :] * rows.detach().double().abs()[
        row_map.clamp(min=0)]).sum(-1)
    assert ((dprobs.double() - dprobs_ref).abs() <= 2 * H * 2.0**-24 * dot_abs + 1e-12).all()
    assert (dprobs[row_map < 0] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_round_trip_with_normalised_probs_is_the_identity(backend):
    """Scatter every token to its k rows, gather back with weights summing to 1: x again."""
    gen = torch.Generator().manual_seed(4)
    row_map = torch.randperm(R, generator=gen)[:T * K].view(T, K)      # every slot used
    probs = torch.rand(T, K, generator=gen)
    probs = probs / probs.sum(1, keepdim=True)
    x = torch.randn(T, H, generator=gen)
    y = unpermute_tokens(permute_tokens(x, row_map, R, backend=backend), row_map, probs,
                         backend=backend)
    torch.testing.assert_close(y, x, rtol=4 * 2.0**-24, atol=4 * 2.0**-24 * x.abs().max().item())


def test_row_map_checks():
    x = torch.randn(T, H)
    with pytest.raises(ValueError, match="int32 or int64"):
        permute_tokens(x, _row_map().float(), R)
    with pytest.raises(ValueError, match="row_map has 6 tokens"):
        permute_tokens(x, _row_map()[:6], R)
    with pytest.raises(ValueError, match="must match row_map"):
        unpermute_tokens(torch.randn(R, H), _row_map(), torch.rand(T, 2))
