"""cross_entropy and its vocab-shard pieces: Triton (interpreter) and torch paths vs the plain-torch
reference, and the reference vs float64 F.cross_entropy.

The Triton tests poison every output allocation with NaN (``poisoned_outputs``), so an element a
kernel fails to write stays NaN and fails ``assert_close`` (which treats NaN as unequal).
"""
import pytest
import torch
import torch.nn.functional as F

from tpfuse.kernels.cross_entropy import (TargetOutOfRangeError, cross_entropy, cross_entropy_reference,
                                          cross_entropy_shard_grad, cross_entropy_shard_stats)

N, V = 37, 203  # odd sizes: several 64-wide interpreter vocab blocks with a ragged tail
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of an fp32 value to the output dtype: relative error up to half an ulp; two paths that
# differ by fp32 noise (~1e-6) can round to neighbouring values, so allow one ulp (2^-10 fp16 with an
# 11-bit significand, 2^-7 bf16 with 8 bits). fp32 values themselves differ only by summation order.
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _batch(dtype, ignore_index=-100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    target[[0, 5, 36]] = ignore_index
    grad_loss = torch.rand(N, generator=gen) + 0.5
    return logits, target, grad_loss


def _loss_and_grad(fn, logits, target, grad_loss, **kwargs):
    x = logits.clone().requires_grad_()
    loss = fn(x, target, **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), x.grad


def test_reference_matches_float64():
    logits, target, grad_loss = _batch(torch.float32)
    ref_loss, ref_grad = _loss_and_grad(cross_entropy_reference, logits, target, grad_loss)
    exact_loss, exact_grad = _loss_and_grad(
        lambda x, t: F.cross_entropy(x, t, reduction="none"), logits.double(), target, grad_loss.double())
    # fp32 log-sum-exp over 203 terms of magnitude ~10: relative error a few fp32 ulps (~1e-6).
    torch.testing.assert_close(ref_loss.double(), exact_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_grad.double(), exact_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(ref_loss[[0, 5, 36]] == 0) and torch.all(ref_grad[[0, 5, 36]] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_cross_entropy_matches_reference(path, dtype, poisoned_outputs):
    logits, target, grad_loss = _batch(dtype)
    loss, grad = _loss_and_grad(cross_entropy, logits, target, grad_loss, backend=path)
    ref_loss, ref_grad = _loss_and_grad(cross_entropy_reference, logits, target, grad_loss)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # Both compute in fp32 from the same (already rounded) logits: only summation order differs.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=GRAD_RTOL[dtype], atol=1e-6)
    assert torch.all(loss[[0, 5, 36]] == 0) and torch.all(grad[[0, 5, 36]] == 0)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("padded", [False, True])
def test_shard_stats_of_three_shards_combine_to_full_vocab_loss(path, padded, poisoned_outputs):
    """Fake vocab parallelism on one process: 3 uneven shards combined as docs/interfaces.md says.
    ``padded``: the last shard is vocabulary padding masked to −inf (an all −inf shard must give
    sum_exp 0 and gradient 0, never NaN); the reference is then the loss over the first 140 ids."""
    logits, target, grad_loss = _batch(torch.float32, seed=1)
    target[1:4] = torch.tensor([0, 69, 202])  # targets at shard edges (shards: 0..69, 70..139, 140..202)
    if padded:
        logits[:, 140:] = float("-inf")
        target = torch.where(target >= 140, target - 140, target)
    bounds = [(0, 70), (70, 140), (140, V)]
    stats = [cross_entropy_shard_stats(logits[:, a:b], target, a, backend=path) for a, b in bounds]
    row_max = torch.stack([m for m, _, _ in stats]).amax(dim=0)                     # all-reduce MAX
    rescaled = [torch.stack([s * torch.exp(m - row_max), t]) for m, s, t in stats]
    sum_exp, target_logit = torch.stack(rescaled).sum(dim=0)                        # all-reduce SUM
    loss = torch.where(target == -100, 0.0, torch.log(sum_exp) + row_max - target_logit)

    real = 140 if padded else V
    ref_loss, ref_grad = _loss_and_grad(cross_entropy_reference, logits[:, :real], target, grad_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)  # fp32 summation order only
    grads = [cross_entropy_shard_grad(logits[:, a:b], target, a, row_max, sum_exp, grad_loss, backend=path)
             for a, b in bounds]
    expected_grad = torch.cat([ref_grad, torch.zeros(N, V - real)], dim=1)
    torch.testing.assert_close(torch.cat(grads, dim=1), expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_shard_stats_match_reference_and_zero_target_logit_outside_shard(path):
    logits, target, _ = _batch(torch.bfloat16, seed=2)
    shard = logits[:, 61:140]  # a strided (non-contiguous) view
    row_max, sum_exp, target_logit = cross_entropy_shard_stats(shard, target, 61, backend=path)
    x = shard.double()
    torch.testing.assert_close(row_max.double(), x.amax(dim=1), rtol=0, atol=0)  # max is exact
    torch.testing.assert_close(sum_exp.double(), torch.exp(x - x.amax(dim=1, keepdim=True)).sum(dim=1),
                               rtol=1e-5, atol=0)  # fp32 sum of <= 79 terms in [0, 1]
    inside = (target >= 61) & (target < 140)
    expected = torch.where(inside, logits.double().gather(1, target.clamp(min=0)[:, None]).squeeze(1), 0.0)
    assert inside.any() and (~inside).any()
    torch.testing.assert_close(target_logit.double(), expected, rtol=0, atol=0)  # a copied value


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_custom_ignore_index_and_leading_dims(path):
    logits, target, grad_loss = _batch(torch.float32, ignore_index=7, seed=3)
    logits3, target3 = logits[:36].reshape(4, 9, V), target[:36].reshape(4, 9)
    grad3 = grad_loss[:36].reshape(4, 9)
    loss, grad = _loss_and_grad(cross_entropy, logits3, target3, grad3, ignore_index=7, backend=path)
    ref_loss, ref_grad = _loss_and_grad(cross_entropy_reference, logits3, target3, grad3, ignore_index=7)
    assert loss.shape == (4, 9) and grad.shape == (4, 9, V)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.all(loss[target3 == 7] == 0) and torch.all(grad[target3 == 7] == 0)


def test_bad_input_raises_value_error():
    logits = torch.randn(5, 11)
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer class ids"):
        cross_entropy(logits, torch.zeros(5))
    with pytest.raises(ValueError, match="float64"):
        cross_entropy(logits.double(), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("bad", [V, -1, 10 * V])
def test_out_of_range_target_raises_like_torch(path, bad):
    """torch's F.cross_entropy raises IndexError for a target outside [0, V); both paths do too
    (with a ValueError subclass naming the id), instead of returning a finite loss."""
    logits, target, _ = _batch(torch.float32, seed=4)
    target[3] = bad
    with pytest.raises(IndexError):
        F.cross_entropy(logits, target, reduction="none")
    with pytest.raises(TargetOutOfRangeError, match=f"target {bad} is out of bounds"):
        cross_entropy(logits, target, backend=path)
    assert issubclass(TargetOutOfRangeError, ValueError)


@pytest.mark.parametrize("bad", [None, V, -1])
def test_fused_stats_kernel_writes_loss_and_flags_bad_targets(bad, poisoned_outputs):
    """The single-device kernel's fused outputs (interpreter): the loss equals the reference and the
    device-side flag (what CUDA asserts on instead of a host read) is 1 exactly when a target that
    is not ignore_index lies outside [0, V)."""
    from tpfuse.kernels.cross_entropy import _stats_triton
    logits, target, _ = _batch(torch.bfloat16, seed=5)
    if bad is not None:
        target[7] = bad
    *_, loss, flag = _stats_triton(logits, target, 0, -100)
    assert flag.tolist() == [0 if bad is None else 1]
    keep = torch.arange(N) != 7
    valid_target = torch.where(keep, target, 0)
    # fp32 log-sum-exp of the same bf16 logits, different summation order: a few fp32 ulps
    torch.testing.assert_close(loss[keep], cross_entropy_reference(logits, valid_target)[keep],
                               rtol=1e-5, atol=1e-5)


def test_grad_of_an_all_minus_inf_row_is_zero_not_nan(poisoned_outputs):
    """A row whose every logit is −inf (S = 0): the kernel's p = exp(x − lse) with lse = +inf is 0,
    as the torch piece's; no NaN from exp(−inf − (−inf)) or 0/0."""
    logits, target, grad_loss = _batch(torch.float32, seed=6)
    logits[2] = float("-inf")
    row_max, sum_exp, _ = cross_entropy_shard_stats(logits, target, 0, backend="torch")
    assert sum_exp[2] == 0
    grads = [cross_entropy_shard_grad(logits, target, 0, row_max, sum_exp, grad_loss, backend=path)
             for path in ("triton", "torch")]
    assert torch.isfinite(grads[0]).all()
    assert torch.all(grads[0][2] == -grad_loss[2] * (torch.arange(V) == target[2]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [64, 128, 130])
def test_shard_stats_with_and_without_a_ragged_tail_block(width, poisoned_outputs):
    """The statistics kernel reads full vocab blocks unmasked and a ragged tail block masked: widths
    that are whole interpreter blocks (64, 128: no tail) and one with a 2-column tail agree with
    the torch piece (fp32 sums in another order: a few ulps)."""
    gen = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(N, width, generator=gen)).bfloat16()
    target = torch.randint(0, 2 * width, (N,), generator=gen)          # half the targets in the shard
    for got, want in zip(cross_entropy_shard_stats(logits, target, 0, backend="triton"),
                         cross_entropy_shard_stats(logits, target, 0, backend="torch")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
