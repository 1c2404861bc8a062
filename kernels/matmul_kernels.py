"""The Triton kernels of ``matmul.py`` and their tile configurations (sm_90: H100 / H200).

Two main-loop designs share one epilogue (``y = act(acc + bias)``, optionally also z = acc + bias):

- ``_matmul_tma_kernel`` (Hopper, 16-bit operands): persistent — one program per SM walks the
  output tiles in grouped order (``tl.range(start, tiles, NUM_SMS, flatten=True)`` so the
  software pipeline runs across tile boundaries) — and reads A and B through TMA tensor
  descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``, made on the host). The copy
  engine handles the edges (zero padding), so no address arithmetic or masks in the main loop; a
  transposed operand is a descriptor over its storage whose tile is transposed in shared memory
  (``.T``), which wgmma reads directly.
- ``_matmul_kernel`` (everything else: fp32, other GPUs, strides TMA cannot describe): the
  grouped-order tile kernel with pointer loads. Full tiles (``EVEN_M`` / ``EVEN_N``, decided per
  config) load without row/column masks and with contiguity hints, so a transposed operand still
  gets vector loads; in ragged ones out-of-range rows wrap around (never stored; ``tile_indices``
  says why a modulo and not a clamp). The grouped GEMM and the fp32 wgrad kernel index the same way.

Epilogue: tiles 256 wide are processed in two 128-column halves (``EPILOGUE_SPLIT``), so the
bias + gelu + pre-activation store never holds two full fp32 tiles of temporaries (no spills at
128×256 / 8 warps; ``kernels/sm90_report.py`` checks every config).
"""
from __future__ import annotations

import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
# Pruned by kernels/sm90_report.py: 128×128 at 4 warps spills in the bias+gelu epilogue (and an
# 8-warp 128×128 tile does the same work without), so it cannot win.
TMA_SHAPES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (64, 128, 64, 4, 4)]
POINTER_SHAPES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4),
                  (64, 128, 64, 4, 4), (64, 64, 32, 5, 2)]
POINTER_SHAPES_FP32 = [(128, 128, 32, 3, 8), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)]
# the autotuner's key: the problem, the operand layouts and the epilogue (dtypes are added by Triton)
TUNING_KEY = ["M", "N", "K", "A_ROW_MAJOR", "B_ROW_MAJOR", "HAS_BIAS", "ACTIVATION", "SAVE_PREACT"]


def make_configs(shapes, group_m=8):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                          num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in shapes]


# ----------------------------------------------------------------------------- shared pieces

@triton.jit
def _apply_activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # gelu (erf)
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:  # gelu, tanh approximation; tanh(u) = 2σ(2u) − 1
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        z = z * tl.sigmoid(2.0 * u)  # 0.5·z·(1 + tanh u) = z·σ(2u)
    elif ACTIVATION == 3:  # relu
        z = tl.maximum(z, 0.0)
    return z


@triton.jit
def tile_indices(offs, size, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """The indices one tile reads along a dim of ``size`` (``offs``: the tile's aranged indices).
    Full tile (``EVEN``: size is a multiple of BLOCK, decided per config): ``offs`` with contiguity
    hints over the whole tile, no index arithmetic. Ragged tile: indices past the edge wrap around
    (their results are never stored). The wrap is a modulo, not a ``tl.where`` clamp to 0: the
    compiler keeps a modulo's contiguity (gcd(BLOCK, 16) for a size that is a multiple of 16), so an
    operand with unit stride along this dim (a transposed one included) still gets 16-byte cp.async
    loads, while a clamp has contiguity 1 — scalar loads, no cp.async pipeline, and spills
    (benchmarks/RESULTS.md, "Hopper compile report"). For a size that is not a multiple of 16 the
    rows themselves are not 16-byte aligned, so nothing vectorises that dim."""
    if EVEN:
        return tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    else:
        return offs % size


@triton.jit
def _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile in groups of GROUP_M tile rows (consecutive tiles share B in L2)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _store_tile(acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
                HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr):
    """z = acc + bias (stored when SAVE_PREACT), y = act(z), masked to the (M, N) output."""
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    offsets = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if SAVE_PREACT:
        tl.store(z_ptr + offsets, acc.to(z_ptr.dtype.element_ty), mask=mask)
    acc = _apply_activation(acc, ACTIVATION)
    tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, pid_m, pid_n, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if EPILOGUE_SPLIT:  # two (BLOCK_M, BLOCK_N/2) halves, one after the other
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc_lo, acc_hi = tl.split(halves)
        offs_lo = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _store_tile(acc_lo, offs_m, offs_lo, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
                    HAS_BIAS, ACTIVATION, SAVE_PREACT)
        _store_tile(acc_hi, offs_m, offs_lo + BLOCK_N // 2, M, N, bias_ptr, y_ptr, z_ptr,
                    stride_ym, stride_yn, HAS_BIAS, ACTIVATION, SAVE_PREACT)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_tile(acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
                    HAS_BIAS, ACTIVATION, SAVE_PREACT)


@triton.jit
def dot_over_reduction(acc, a_ptrs, b_ptrs, R, stride_ar, stride_br, BLOCK_R: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc (BM, BN) += Σ_r a[:, r] · b[r, :] over the reduction length R: the tiles a (BM, BR) and
    b (BR, BN) start at ``a_ptrs`` / ``b_ptrs`` and step BLOCK_R along their reduction strides;
    the last step's reduction indices past R load as 0. fp32 accumulation."""
    offs_r = tl.arange(0, BLOCK_R)
    for r in range(0, tl.cdiv(R, BLOCK_R)):
        r_left = R - r * BLOCK_R
        a = tl.load(a_ptrs, mask=offs_r[None, :] < r_left, other=0.0)      # (BM, BR)
        b = tl.load(b_ptrs, mask=offs_r[:, None] < r_left, other=0.0)      # (BR, BN)
        if DOT_IN_FP32:  # interpreter only: its tl.dot multiplies 16-bit bit patterns as integers
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_R * stride_ar
        b_ptrs += BLOCK_R * stride_br
    return acc


# ----------------------------------------------------------------------------- TMA kernel

@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, bias_ptr, y_ptr, z_ptr,
    M, N, K, stride_ym, stride_yn,
    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, NUM_SMS: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Persistent y = act(a @ b + bias). ``a_desc`` describes a's storage: (M, K) when
    A_ROW_MAJOR, else (K, M) (a is a transpose); ``b_desc`` (K, N) when B_ROW_MAJOR, else (N, K)
    (the usual linear layer: b = wᵀ)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_ROW_MAJOR:
                a = a_desc.load([off_m, off_k])                     # (BM, BK)
            else:
                a = a_desc.load([off_k, off_m]).T                   # (BK, BM) tile, transposed
            if B_ROW_MAJOR:
                b = b_desc.load([off_k, off_n])                     # (BK, BN)
            else:
                b = b_desc.load([off_n, off_k]).T                   # (BN, BK) tile, transposed
            if DOT_IN_FP32:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        _epilogue(acc, pid_m, pid_n, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
                  HAS_BIAS, ACTIVATION, SAVE_PREACT, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)


# ----------------------------------------------------------------------------- pointer kernel

@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, y_ptr, z_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_ym, stride_yn,
    A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PREACT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of y = act(a @ b + bias); z (same strides as y) gets a @ b + bias
    when SAVE_PREACT. The layout flags only enter the tuning key (strides carry the layout)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = tile_indices(offs_m, M, BLOCK_M, EVEN_M)   # past the edge: wrapped, never stored
    cols_b = tile_indices(offs_n, N, BLOCK_N, EVEN_N)
    # int64 so huge operands (e.g. vocab GEMMs) cannot overflow the offsets
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b.to(tl.int64)[None, :] * stride_bn  # (BK, BN)

    acc = dot_over_reduction(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs, K,
                             stride_ak, stride_bk, BLOCK_K, INPUT_PRECISION, DOT_IN_FP32)
    _epilogue(acc, pid_m, pid_n, M, N, bias_ptr, y_ptr, z_ptr, stride_ym, stride_yn,
              HAS_BIAS, ACTIVATION, SAVE_PREACT, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)


@triton.jit
def _activation_grad_kernel(dy_ptr, saved_ptr, g_ptr, n_elements,
                            ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """g = dy ⊙ act'(z) over flat contiguous tensors; ``saved`` is z (gelu*) or y (relu)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(saved_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 1:  # Φ(z) + z·φ(z)
        slope = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACTIVATION == 2:  # ½(1 + t) + ½·z·(1 − t²)·c·(1 + 3·0.044715·z²),  t = tanh(c(z + 0.044715 z³))
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        slope = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    else:  # relu, from the saved output: y > 0 ⇔ z > 0
        slope = tl.where(z > 0.0, 1.0, 0.0)
    tl.store(g_ptr + offs, (dy * slope).to(g_ptr.dtype.element_ty), mask=mask)




def _tma_block_shapes(nargs):
    """pre_hook of the autotuned TMA configs: the descriptors' tiles follow the config."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk] if nargs["A_ROW_MAJOR"] else [bk, bm]
    nargs["b_desc"].block_shape = [bk, bn] if nargs["B_ROW_MAJOR"] else [bn, bk]


def _per_config(kernel, **rules):
    return triton.heuristics({name: rule for name, rule in rules.items()})(kernel)


def even_tile_rules(*dims):
    """``triton.heuristics`` rules EVEN_<d> = (<d> % BLOCK_<d> == 0) for ``tile_indices``, decided
    per autotune config (e.g. ``even_tile_rules("N", "K")``)."""
    return {f"EVEN_{d}": (lambda meta, d=d: meta[d] % meta[f"BLOCK_{d}"] == 0) for d in dims}


def even_tiles(meta, **sizes):
    """The same flags for a launch with fixed blocks (pinned configs, the interpreter):
    ``even_tiles(CPU_META, N=n)`` → {"EVEN_N": n % CPU_META["BLOCK_N"] == 0}."""
    return {f"EVEN_{d}": size % meta[f"BLOCK_{d}"] == 0 for d, size in sizes.items()}


# the autotuned wrappers (``MatmulOptions(autotune=True)``); pinned launches call the JIT functions
_split = lambda meta: meta["BLOCK_N"] >= 256  # noqa: E731
tma_kernel_autotuned = triton.autotune(
    configs=[triton.Config(c.kwargs, num_stages=c.num_stages, num_warps=c.num_warps,
                           pre_hook=_tma_block_shapes) for c in make_configs(TMA_SHAPES)],
    key=TUNING_KEY)(_per_config(_matmul_tma_kernel, EPILOGUE_SPLIT=_split))
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


def fits_shared_memory(configs, named_args, **_):
    """early_config_prune of the autotuned pointer kernel: the configs whose pipelined operand tiles,
    stages × (BLOCK_M·BLOCK_K + BLOCK_K·BLOCK_N) × element size (Triton's figure for wgmma tiles, an
    upper bound for the others), fit in a block's shared memory (fp32 operands drop 128×256×64 at 3 stages: 294,912 B, and 128×128×64 at 4: 262,144 B)."""
    size = named_args["a_ptr"].element_size()
    return [c for c in configs if c.num_stages * size * c.kwargs["BLOCK_K"] *
            (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) <= SHARED_LIMIT]


matmul_kernel_autotuned = triton.autotune(configs=make_configs(POINTER_SHAPES), key=TUNING_KEY,
                                          prune_configs_by={"early_config_prune": fits_shared_memory})(
    _per_config(_matmul_kernel, EPILOGUE_SPLIT=_split, **even_tile_rules("M", "N")))
