"""MultiLatentAttention against transformers' DeepseekV3Attention (the same weights copied in):
output, input gradient and every weight gradient, at tp 1 and tp 2 with sequence parallelism off
and on, with and without q compression (q_lora_rank), YaRN tables (v head dim != q/k head dim).

The reference is HF's module in float64 with two precision-only changes: its RMSNorms (which
compute in fp32 whatever the input) run the same formula in float64, and attention is HF's
"sdpa" implementation (its eager path runs the softmax in fp32). tpfuse's layer runs in fp32 (its
norm kernels take fp32 / bf16 / fp16) on the same weights and inputs rounded to fp32. Both get
the same rope tables (HF's DeepseekV3RotaryEmbedding, fp32 as tpfuse's); the tables themselves
are checked against tpfuse's ``MLARotary`` in their own test.

Tolerance: tests/support/tp_testing.py's fp32 band (rtol = atol = 1e-5: dot products of length
<= 32 over O(1) values in fp32 against an essentially exact float64 reference); a wrong head
order, scale, rotation or missing reduction gives errors of 1e-2 or more.
"""
import math

import torch
import torch.nn.functional as F

from support.tp_testing import assembled, assert_close_fp32, chunk_of, tp_layouts
from tpfuse.tp_layers.mla import MultiLatentAttention
from tpfuse.tp_layers.mla_rope import MLARotary

HIDDEN, HEADS, KV_RANK, Q_RANK, NOPE, ROPE_DIM, V_DIM = 32, 4, 8, 12, 8, 4, 6
S, B, EPS = 8, 2, 1e-6
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4, beta_fast=32.0,
            beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707, rope_theta=10000.0)

# HF module name → tpfuse module name (and how the master is split over TP: 0 rows, 1 columns)
HF_TO_TPFUSE = {
    "q_proj": ("linear_q_proj", 0), "q_a_proj": ("linear_q_down_proj", None),
    "q_a_layernorm": ("q_layernorm", None), "q_b_proj": ("linear_q_up_proj", 0),
    "kv_a_proj_with_mqa": ("linear_kv_down_proj", None),
    "kv_a_layernorm": ("kv_layernorm", None), "kv_b_proj": ("linear_kv_up_proj", 0),
    "o_proj": ("linear_proj", 1),
}


def hf_config(q_lora_rank):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE_DIM, v_head_dim=V_DIM, rms_norm_eps=EPS, attention_bias=False,
        rope_interleave=True, rope_parameters=dict(YARN), max_position_embeddings=16,
        num_hidden_layers=1, vocab_size=16)
    config._attn_implementation = "sdpa"
    return config


def _float64_rms_norm(norm):
    def forward(x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + norm.variance_epsilon))
    norm.forward = forward


def hf_attention(q_lora_rank, seed=0):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    torch.manual_seed(seed)
    module = DeepseekV3Attention(hf_config(q_lora_rank), layer_idx=0).double()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "layernorm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    for norm in (module.q_a_layernorm, module.kv_a_layernorm):
        if norm is not None:
            _float64_rms_norm(norm)
    return module


def hf_tables(q_lora_rank, positions):
    """HF's (cos, sin) (b, s, d_pe), fp32 as HF computes them, in float64."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rotary = DeepseekV3RotaryEmbedding(hf_config(q_lora_rank))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos.double(), sin.double()


def rotary_settings():
    return MLARotary(rope_type="yarn", rotary_base=YARN["rope_theta"],
                     rotary_scaling_factor=YARN["factor"],
                     original_max_position_embeddings=YARN["original_max_position_embeddings"],
                     beta_fast=YARN["beta_fast"], beta_slow=YARN["beta_slow"],
                     mscale=YARN["mscale"], mscale_all_dim=YARN["mscale_all_dim"])


def copy_weights(reference, module, state):
    """HF's weights into the TP module, each rank taking its slice."""
    for hf_name, param in reference.named_parameters():
        owner, leaf = hf_name.rsplit(".", 1)
        name, dim = HF_TO_TPFUSE[owner]
        full = param.detach().float()
        if dim is not None:
            full = full.chunk(state.tp_size, dim=dim)[state.tp_rank]
        with torch.no_grad():
            getattr(getattr(module, name), leaf).copy_(full)


def _against_hf():
    cases = 0
    positions = torch.arange(S).expand(B, S) + torch.tensor([[0], [3]])
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(B, S, HIDDEN, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(2))
    for q_lora_rank in (None, Q_RANK):
        reference = hf_attention(q_lora_rank)
        cos, sin = hf_tables(q_lora_rank, positions)
        x_ref = x.clone().requires_grad_()
        expected, _ = reference(x_ref, (cos, sin), attention_mask=None)
        expected.backward(dy)
        for tp, state in tp_layouts((1, 2)):
            for sp in (False, True) if tp > 1 else (False,):
                tag = f"q_lora_rank={q_lora_rank} tp={tp} sp={sp}"
                module = MultiLatentAttention(
                    HIDDEN, HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
                    qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE_DIM, v_head_dim=V_DIM,
                    rotary=rotary_settings(), add_bias_linear=False, sequence_parallel=sp,
                    params_dtype=torch.float32, state=state, qk_layernorm=True,
                    normalization="RMSNorm", layernorm_epsilon=EPS)
                assert math.isclose(module.softmax_scale, reference.scaling, rel_tol=1e-15), tag
                copy_weights(reference, module, state)
                x_seq = x.float().transpose(0, 1)                                 # (s, b, h)
                x_in = (chunk_of(x_seq, state, 0) if sp else x_seq).clone().requires_grad_()
                out, bias = module(x_in, positions, rotary_pos_emb=(cos[:, None].float(),
                                                             sin[:, None].float()))
                assert bias is None
                want = expected.detach().float().transpose(0, 1)
                assert_close_fp32(out, chunk_of(want, state, 0) if sp else want, f"{tag}: output")
                grad = dy.float().transpose(0, 1)
                out.backward(chunk_of(grad, state, 0) if sp else grad)
                dx = x_ref.grad.float().transpose(0, 1)
                assert_close_fp32(x_in.grad, chunk_of(dx, state, 0) if sp else dx, f"{tag}: dx")
                for hf_name, param in reference.named_parameters():
                    owner, leaf = hf_name.rsplit(".", 1)
                    name, dim = HF_TO_TPFUSE[owner]
                    mine = getattr(getattr(module, name), leaf).grad
                    if dim is not None:
                        mine = assembled(mine, state, dim)
                    assert_close_fp32(mine, param.grad.float(), f"{tag}: d{name}.{leaf}")
                cases += 1
    return cases


def test_mla_matches_deepseek_v3_attention_at_tp1_and_tp2(run_distributed):
    assert run_distributed(2, _against_hf) == [6] * 2


def test_mla_yarn_tables_and_scale_match_transformers():
    """fp32 tables from the same formulas: agreement to a few fp32 ulps of O(1) values."""
    positions = torch.arange(40).expand(1, 40)
    cos, sin = hf_tables(None, positions)
    mine_cos, mine_sin = rotary_settings().cos_sin(positions, ROPE_DIM)
    torch.testing.assert_close(mine_cos[:, 0].double(), cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(mine_sin[:, 0].double(), sin, rtol=0, atol=1e-5)
    plain = MLARotary(rope_type="rope")
    assert plain.concentration() == 1.0 and plain.softmax_scale(16) == 0.25
    assert math.isclose(rotary_settings().softmax_scale(NOPE + ROPE_DIM),
                        hf_attention(None).scaling, rel_tol=1e-15)


def test_mla_without_norms_has_megatron_parameters():
    """Without qk_layernorm Megatron's MLA has no q / kv norms; shapes of the projections."""
    module = MultiLatentAttention(HIDDEN, HEADS, q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK,
                                  qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE_DIM,
                                  v_head_dim=V_DIM)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    assert shapes == {
        "linear_proj.weight": (HIDDEN, HEADS * V_DIM), "linear_proj.bias": (HIDDEN,),
        "linear_q_down_proj.weight": (Q_RANK, HIDDEN),
        "linear_q_up_proj.weight": (HEADS * (NOPE + ROPE_DIM), Q_RANK),
        "linear_kv_down_proj.weight": (KV_RANK + ROPE_DIM, HIDDEN),
        "linear_kv_up_proj.weight": (HEADS * (NOPE + V_DIM), KV_RANK)}
    x = torch.randn(S, B, HIDDEN)
    out, bias = module(x)
    assert out.shape == (S, B, HIDDEN) and bias is None
    assert F.mse_loss(out, torch.zeros_like(out)) > 0
