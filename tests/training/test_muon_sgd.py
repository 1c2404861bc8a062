"""``--optimizer sgd`` and ``--optimizer muon`` against torch's own optimizers on one process, the
Newton–Schulz schedule against its singular-value form in float64, and the flags' bad values.

The one-process comparisons build the trainer's GPT model (tp 1) twice from one seed, the copy trained by
torch.optim (Muon on the 2-D hidden weights, AdamW on the rest, or SGD on all, in the trainer's
decay / no-decay groups), and run the same batches through both for several steps.
"""
import math

import pytest
import torch

from tpfuse.training.arguments import parse_args
from tpfuse.training.muon import (QUINTIC_COEFFICIENTS, SIMPLE_COEFFICIENTS, MuonConfig,
                                  MuonUpdate, QkvLayout, is_muon_matrix, newton_schulz,
                                  scale_factor)
from tpfuse.training.optimizer import Piece, decays

MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "8", "--max-position-embeddings", "8",
         "--vocab-size", "61", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
         "--mock-data", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-2",
         "--seed", "3"]
STEPS, LR, WEIGHT_DECAY = 4, 1e-2, 0.1


def _torch_reference(module, kind):
    """torch.optim over ``module`` in the trainer's groups (Muon / AdamW, or SGD)."""
    named = list(module.named_parameters())
    muon = [p for n, p in named if kind == "muon" and is_muon_matrix(n, p)]
    rest = [(n, p) for n, p in named if not any(p is m for m in muon)]
    groups = [{"params": [p for n, p in rest if decays(n, p)], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in rest if not decays(n, p)], "weight_decay": 0.0}]
    if kind == "sgd":
        return [torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)]
    adam = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, fused=True)
    return [adam, torch.optim.Muon(muon, lr=LR, weight_decay=WEIGHT_DECAY, momentum=0.95,
                                   nesterov=True)]


def against_torch_body(kind):
    """(max |Δθ| per step between the trainer's optimizer and torch's, max |Δθ| of the steps
    themselves): the trainer's Muon configured as torch.optim.Muon's defaults (the simple
    coefficient triple, shape_scaling = adjust_lr_fn "original", Nesterov, momentum 0.95, bf16
    Newton–Schulz, the fused QKV as one matrix)."""
    from tpfuse.models import build_model, make_gpt_model_provider
    from tpfuse.parallel.state import ParallelState
    from tpfuse.training.data_parallel import DataParallelBuffers, DistributedDataParallelConfig
    from tpfuse.training.optimizer import MixedPrecisionOptimizer

    config, _ = parse_args(MODEL)
    state = ParallelState.initialize(tp=1)
    try:
        torch.manual_seed(0)
        chunks = build_model(make_gpt_model_provider(config), config, state)
        torch.manual_seed(0)
        reference = build_model(make_gpt_model_provider(config), config, state)[0]
        assert all(torch.equal(a, b) for a, b in zip(chunks[0].parameters(),
                                                     reference.parameters()))
        torch_optimizers = _torch_reference(reference, kind)
        buffers = DataParallelBuffers(chunks, DistributedDataParallelConfig(), state)
        muon = MuonConfig(momentum=0.95, nesterov=True, split_qkv=False,
                          scale_mode="shape_scaling", matmul_precision="medium",
                          coefficients=SIMPLE_COEFFICIENTS)
        ours = MixedPrecisionOptimizer(chunks, buffers, state, lr=LR, weight_decay=WEIGHT_DECAY,
                                       optimizer=kind, sgd_momentum=0.9, muon=muon)
        differences, moved = [], 0.0
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            tokens = torch.randint(0, 61, (2, 8), generator=generator)
            labels = torch.randint(0, 61, (2, 8), generator=generator)
            before = [p.detach().clone() for p in reference.parameters()]
            buffers.zero_grad_buffer()
            buffers.begin_step(1)
            chunks[0](tokens, labels=labels).mean().backward()
            buffers.finish_grad_sync()
            assert ours.step().success
            for optimizer in torch_optimizers:
                optimizer.zero_grad()
            reference(tokens, labels=labels).mean().backward()
            for optimizer in torch_optimizers:
                optimizer.step()
            differences.append(max(float((a - b).abs().max()) for a, b in
                                   zip(chunks[0].parameters(), reference.parameters())))
            moved = max(moved, max(float((a - b).abs().max()) for a, b in
                                   zip(reference.parameters(), before)))
        return differences, moved
    finally:
        state.destroy()


@pytest.mark.parametrize("kind", ["muon", "sgd"])
def test_one_process_matches_torch_optim(run_distributed, kind):
    """The same forward, the same fp32 gradients (one micro-batch, no DP), torch's update ops in
    torch's order (Muon: lerp, lerp, bf16 NS with torch's ops, mul_(1 − lr·λ), add_ with alpha
    −lr·√max(1, m/n); SGD: torch.optim.SGD itself): every parameter equals torch's to the bit
    after every step. The steps themselves move the parameters (so the check can fail)."""
    (differences, moved), = run_distributed(1, against_torch_body, kind)
    assert moved > 1e-4
    assert differences == [0.0] * STEPS


def test_split_qkv_orthogonalises_q_k_and_v_apart_as_torch_muon_on_each():
    """A fused (g·(hpg + 2)·d, h) QKV weight with --muon-split-qkv: the q rows of all groups, the
    k rows and the v rows each take torch.optim.Muon's update on their own (shape_scaling: each
    part's √max(1, m/n); the parts' NS inputs are exact slices, so only the scale's rounding
    differs: ours rounds s·O in fp32 before the add, torch folds s into the add's alpha, ≤ 1 ulp
    of |lr·s·O| per step; over 3 steps 2⁻²² · max|lr·s·O| bounds it, with max|O| ≤ 1.5, the
    quintic's overshoot of the unit singular values)."""
    groups, hpg, d, h = 2, 2, 4, 16
    layout = QkvLayout(hpg, d)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(groups * (hpg + 2) * d, h))
    piece = Piece(weight, 0, 0, weight.numel(), weight.data, True, False)
    config = MuonConfig(momentum=0.95, nesterov=True, scale_mode="shape_scaling",
                        matmul_precision="medium", coefficients=SIMPLE_COEFFICIENTS)
    update = MuonUpdate(config, [(weight, piece, None)], None, {id(weight): layout})

    def parts(matrix):
        rows = matrix.view(groups, (hpg + 2) * d, h)
        return [rows[:, :hpg * d], rows[:, hpg * d:(hpg + 1) * d], rows[:, (hpg + 1) * d:]]

    references = [torch.nn.Parameter(p.detach().reshape(-1, h).clone()) for p in parts(weight)]
    muon = torch.optim.Muon(references, lr=LR, weight_decay=WEIGHT_DECAY, momentum=0.95)
    for _ in range(3):
        grad = torch.randn_like(weight)
        piece.main.grad = grad
        update.step(LR, WEIGHT_DECAY)
        for reference, part in zip(references, parts(grad)):
            reference.grad = part.reshape(-1, h).clone()
        muon.step()
    largest_scale = math.sqrt(max(1.0, groups * hpg * d / h))
    tolerance = 3 * 2.0 ** -22 * LR * largest_scale * 1.5
    for reference, part in zip(references, parts(weight.detach())):
        assert torch.allclose(part.reshape(-1, h), reference.detach(), rtol=0, atol=tolerance)


def _ns_from_singular_values(matrix64, steps):
    """NS through the SVD (float64): X = U Σ Vᵀ / ‖X‖_F, each step maps every singular value σ
    to a σ + b σ³ + c σ⁵ (A = X Xᵀ = U Σ² Uᵀ, so the polynomial acts on Σ alone)."""
    u, sigma, vt = torch.linalg.svd(matrix64, full_matrices=False)
    sigma = sigma / matrix64.norm()
    for step in range(steps):
        a, b, c = QUINTIC_COEFFICIENTS[step % 5]
        sigma = a * sigma + b * sigma ** 3 + c * sigma ** 5
    return u @ torch.diag(sigma) @ vt


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
def test_quintic_newton_schulz_is_the_polynomial_on_the_singular_values(shape):
    """fp32 NS (``high``) vs the same schedule applied to the float64 singular values, both
    orientations (the tall one runs on Xᵀ). Bound: each step's GEMMs add ≤ n·u relative (n = 24,
    u = 2⁻²⁴: 1.4e-6) times |a| + |b| + |c| ≤ 13.9, 2e-5 per step; the map's slope (≤ a ≈ 4.1
    near 0) carries earlier steps forward: Σ_k 4.1^k · 2e-5 over 5 steps = 7.5e-3."""
    torch.manual_seed(1)
    matrix = torch.randn(*shape)
    ours = newton_schulz(matrix, QUINTIC_COEFFICIENTS, 5, bf16=False)
    expected = _ns_from_singular_values(matrix.double(), 5)
    bound = 7.5e-3
    assert float((ours.double() - expected).abs().max()) < bound        # measured 5e-7
    # one step fewer, or torch's fixed triple, lands outside the bound
    assert float((ours.double() - _ns_from_singular_values(matrix.double(), 4)).abs().max()) > \
        bound
    simple = newton_schulz(matrix, SIMPLE_COEFFICIENTS, 5, bf16=False)
    assert float((ours - simple).abs().max()) > bound


def test_scale_modes_are_megatrons():
    assert scale_factor(64, 16, "spectral") == 8.0                   # √max(m, n)
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5              # √(m/n)
    assert scale_factor(64, 16, "shape_scaling") == 2.0              # √max(1, m/n)
    assert scale_factor(16, 64, "shape_scaling") == 1.0


def test_which_parameters_are_muons():
    matrix, vector = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    embedding = torch.nn.Parameter(torch.zeros(8, 4))
    embedding.is_embedding_or_output_parameter = True
    assert is_muon_matrix("decoder.layers.0.self_attention.linear_qkv.weight", matrix)
    assert is_muon_matrix("layers.0.mlp.router.weight", matrix)
    assert not is_muon_matrix("layers.0.input_norm.weight", vector)
    assert not is_muon_matrix("layers.0.mlp.experts.bias1", matrix)          # stacked biases
    assert not is_muon_matrix("layers.0.mlp.experts.weight1", torch.zeros(2, 4, 4))
    assert not is_muon_matrix("embedding.word_embeddings.weight", embedding)
    assert not is_muon_matrix("embedding.position_embeddings.weight", matrix)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "dist_muon"], "--optimizer dist_muon is not supported"),
    (["--optimizer", "muon", "--muon-tp-mode", "distributed"],
     "--muon-tp-mode distributed is not supported: use duplicated"),
    (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec low is not supported"),
    (["--muon-num-ns-steps", "3"], "--muon-num-ns-steps must be a multiple of 5"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be >= 1"),
    (["--muon-momentum", "1.0"], r"--muon-momentum must be in \[0.0, 1.0\)"),
    (["--sgd-momentum", "-0.5"], r"--sgd-momentum must be in \[0.0, ∞\)"),
    (["--muon-extra-scale-factor", "0"], r"--muon-extra-scale-factor must be in \(0.0, ∞\)"),
])
def test_bad_values_are_refused_at_parsing_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(MODEL + flags)


def test_defaults_are_megatron_lms():
    _, settings = parse_args(MODEL)
    o = settings.optimizer
    assert (o.optimizer, o.sgd_momentum, o.muon_momentum, o.muon_split_qkv, o.muon_use_nesterov,
            o.muon_scale_mode, o.muon_fp32_matmul_prec, o.muon_num_ns_steps, o.muon_tp_mode,
            o.muon_extra_scale_factor) == ("adam", 0.9, 0.9, True, False, "spectral", "medium",
                                           5, "blockwise", 1.0)
    _, settings = parse_args(MODEL + ["--muon-no-split-qkv", "--muon-use-nesterov"])
    assert not settings.optimizer.muon_split_qkv and settings.optimizer.muon_use_nesterov
