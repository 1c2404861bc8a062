"""The torch Philox4x32-10 equals Triton's ``tl.philox`` bit for bit (interpreter), and the keep
fraction of the masks built on it is 1 − p within a derived bound."""
import math

import pytest
import torch
import triton
import triton.language as tl

from tpfuse.kernels import backend
from tpfuse.kernels.philox import (RowCoordinates, attention_keep_mask, dropout_key,
                                   hidden_keep_mask, philox4x32)


@triton.jit
def _philox_words_kernel(c_ptr, out_ptr, key, N: tl.constexpr):
    i = tl.arange(0, N)
    c0 = tl.load(c_ptr + 4 * i + 0)
    c1 = tl.load(c_ptr + 4 * i + 1)
    c2 = tl.load(c_ptr + 4 * i + 2)
    c3 = tl.load(c_ptr + 4 * i + 3)
    r0, r1, r2, r3 = tl.philox(key, c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32),
                               c3.to(tl.uint32))
    tl.store(out_ptr + 4 * i + 0, r0.to(tl.int64))
    tl.store(out_ptr + 4 * i + 1, r1.to(tl.int64))
    tl.store(out_ptr + 4 * i + 2, r2.to(tl.int64))
    tl.store(out_ptr + 4 * i + 3, r3.to(tl.int64))


@pytest.mark.parametrize("seed,site", [(0, 0), (7, 3), (2**31 - 1, 2**31 - 1)])
def test_torch_philox_equals_triton(seed, site):
    n = 64
    counters = torch.randint(0, 2**32, (n, 4), generator=torch.Generator().manual_seed(seed % 97),
                             dtype=torch.int64)
    counters[0] = torch.tensor([0, 0, 0, 0])
    counters[1] = torch.tensor([2**32 - 1] * 4)
    key = dropout_key(seed, site)
    out = torch.empty((n, 4), dtype=torch.int64)
    backend.launch(_philox_words_kernel, (1,), counters.to(torch.int32), out, key, N=n)
    words = philox4x32(key, *counters.unbind(-1))
    assert torch.equal(torch.stack(words, -1), out & 0xFFFFFFFF)


def test_keep_fraction_is_one_minus_p():
    """n Bernoulli(1 − p) draws: the kept count has standard deviation √(n p (1 − p)); 6 of them
    bound a correct generator's deviation (two-sided probability 2e-9), while a wrong threshold
    (p off by 1/256) moves it by n/256 ≫ 6σ at n = 2·10⁵."""
    p, rows, hidden = 0.1, 400, 500
    coords = RowCoordinates(dropout_key(5, 9), torch.arange(rows) % 40, torch.arange(rows) // 40)
    kept = hidden_keep_mask(p, coords, hidden).sum().item()
    n = rows * hidden
    assert abs(kept - n * (1 - p)) <= 6 * math.sqrt(n * p * (1 - p))
    mask = attention_keep_mask(p, dropout_key(5, 10), torch.arange(8), torch.arange(4),
                               torch.arange(40), torch.arange(40))
    n = mask.numel()
    assert abs(mask.sum().item() - n * (1 - p)) <= 6 * math.sqrt(n * p * (1 - p))


def test_masks_depend_on_every_coordinate():
    coords = RowCoordinates(dropout_key(5, 9), torch.arange(64), torch.zeros(64, dtype=torch.long))
    base = hidden_keep_mask(0.5, coords, 64)
    for other in (RowCoordinates(dropout_key(6, 9), coords.positions, coords.samples),
                  RowCoordinates(dropout_key(5, 8), coords.positions, coords.samples),
                  RowCoordinates(coords.key, coords.positions + 1, coords.samples),
                  RowCoordinates(coords.key, coords.positions, coords.samples + 1)):
        assert not torch.equal(base, hidden_keep_mask(0.5, other, 64))
