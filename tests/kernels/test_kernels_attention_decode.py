"""Cached (prefill + decode) attention on the Triton kernels: what the model runs on a GPU.

Every step of generation calls flash_attention with the step's queries at ``q_offset`` = tokens
already cached, over the whole cache (s_q = 1 for a decode step), and with left padding as
document ids. Run through Triton's interpreter here, the steps must give the logits of the full
forward on the torch path (the reference), and the Triton forward must really be what ran.

Tolerance: both sides are fp32 with the same weights; they differ in summation order only (online
softmax over key tiles vs aten's flash, other GEMM shapes): ~1e-7 relative per op over 2 layers of
width 64, so 1e-5 holds; a wrong offset, window or padding mask moves logits by ~1e-2 or more.
"""
import importlib

import pytest
import torch

from tpfuse.inference import InferenceContext
from tpfuse.kernels import backend as kernel_backend
from tpfuse.models import GPTModel, TransformerConfig

flash_module = importlib.import_module("tpfuse.kernels.flash_attention")  # (the package exports the function)


def _model(**overrides):
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,  # d = 16: the kernel's
                  seq_length=16, vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, seed=5,
                  position_embedding_type="rope")
    return GPTModel(TransformerConfig(**{**values, **overrides})).eval()


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts the Triton forward launches, tiled or split-key decode (the decode steps must not fall
    back to the torch path)."""
    calls = []
    for name in ("attention_forward_triton", "attention_decode_triton"):
        real = getattr(flash_module, name)

        def counted(q, *args, real=real):
            calls.append(q.shape[2])
            return real(q, *args)
        monkeypatch.setattr(flash_module, name, counted)
    return calls


@pytest.mark.parametrize("window", [None, 3])
def test_decode_steps_on_the_triton_kernel_equal_the_full_forward(window, triton_calls):
    model = _model(window_size=window)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), kernel_backend.use_backend("torch"):
        full = model(ids)                                                # (b, s, V) reference
    context = InferenceContext(2, 7, materialize_only_last_token_logits=False)
    steps = []
    with torch.no_grad(), kernel_backend.use_backend("triton"):
        for start, end in ((0, 4), (4, 5), (5, 6), (6, 7)):            # prefill 4, then 3 decode steps
            steps.append(model(ids[:, start:end], inference_context=context))
            context.increment_sequence_len_offset(end - start)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert triton_calls == [4, 4, 1, 1, 1, 1, 1, 1]                     # 2 layers per step, s_q per call


def test_left_padded_decode_on_the_triton_kernel(triton_calls):
    """A prompt padded on the left in a batch (padding = document 0) decodes as it does alone."""
    model = _model()
    short, long = [5, 6, 7], [1, 2, 3, 4, 8, 9]
    with torch.no_grad(), kernel_backend.use_backend("torch"):
        alone = model(torch.tensor([short + [11]]))[0, -1]
    with torch.no_grad(), kernel_backend.use_backend("triton"):
        context = InferenceContext(2, 8)
        context.set_left_padding([3, 0])
        batch = torch.tensor([[0, 0, 0] + short, long])
        positions = torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
        model(batch, positions, inference_context=context)
        context.increment_sequence_len_offset(6)
        step = model(torch.tensor([[11], [12]]), torch.tensor([[3], [6]]), inference_context=context)
    torch.testing.assert_close(step[0, -1], alone, rtol=1e-5, atol=1e-5)
    assert triton_calls == [6, 6, 1, 1]
