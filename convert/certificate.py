"""Conversion certificates: the max |Δ logit| between ``transformers`` and tpfuse on a fixed prompt.

    tpfuse side:  the checkpoint's single-process tensors (persistent buffers included) →
                  GPTModel at tp = pp = 1 (fp32)
    HF side:      AutoModelForCausalLM.from_pretrained(dir) (fp32)
    prompt:       PROMPT_LENGTH ids  (7·j + 3) mod V,  j = 0 ..
    certificate:  {"max_abs_logit_diff", "tolerance", "max_abs_logit", "prompt", "tpfuse",
                   "huggingface"} as ``certificate.json`` in the written folder, the two
                   folders' paths relative to it (the pair can move together)

Both models run in fp32 whatever the weights' dtype (bf16 / fp16 values are exact in fp32), so the
two sides compute the same function of the same numbers and differ only by the order of fp32
operations. Tolerance, from the summation-order bound: a length-n fp32 dot product computed in
any order is within γ_n·Σ|a_i b_i| of the exact value, γ_n ≈ n·u, u = 2⁻²⁴; two orders differ by
at most 2·n·u relative. The longest reductions of a layer have n = N = max(hidden, the output
projection's heads × head dim, ffn, prompt length; with experts: the experts' ffn × top-k plus
the shared expert's width — all summed into one output — and the router's softmax over E); the
residual stream carries each layer's error forward, so over L layers and the output layer
(L + 1 reductions in sequence) the first-order bound on a logit of size ≤ M is

    tolerance = 2 · N · u · (L + 1) · max(1, M)

A wrong mapping moves logits by ~1e-2 or more, far above it for test-sized models; a conversion
whose difference exceeds it is refused (the written folder is removed). Without ``transformers``
installed, the certificate says it was not computed, and why.
"""
from __future__ import annotations

import json
import os

import torch

CERTIFICATE = "certificate.json"
PROMPT_LENGTH = 16
UNIT_ROUNDOFF = 2.0 ** -24
SIDES = ("tpfuse", "huggingface")          # the certificate's two folder paths


def fixed_prompt(vocab_size: int) -> list[int]:
    return [(7 * j + 3) % vocab_size for j in range(PROMPT_LENGTH)]


def tolerance_for(config, max_abs_logit: float) -> float:
    """The summation-order bound of the module docstring."""
    longest = max(config.hidden_size, config.num_attention_heads * config.kv_channels,
                  config.ffn_hidden_size, PROMPT_LENGTH)
    if config.num_moe_experts is not None:
        routed = config.moe_ffn_hidden_size * config.moe_router_topk
        shared = config.moe_shared_expert_intermediate_size or 0
        longest = max(longest, routed + shared, config.num_moe_experts)
    return 2 * longest * UNIT_ROUNDOFF * (config.num_layers + 1) * max(1.0, max_abs_logit)


def tpfuse_logits(tpfuse_dir: str, ids: torch.Tensor) -> tuple:
    """(config, logits (1, s, V) fp32) of a tpfuse checkpoint run in one process."""
    from tpfuse.checkpoint.reshard import persistent_buffers
    from tpfuse.models.gpt import GPTModel

    from tpfuse.models.cli import config_from_dict, config_to_dict

    from .tpfuse_io import read_checkpoint, single_process_config

    config, params, _ = read_checkpoint(tpfuse_dir)
    single = single_process_config(config)
    single = config_from_dict(config_to_dict(single), params_dtype=torch.float32, bf16=False,
                              fp16=False, hidden_dropout=0.0, attention_dropout=0.0,
                              context_parallel_size=1, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=None)
    with torch.device("meta"):
        model = GPTModel(single, state=None)
    model.to_empty(device="cpu")
    if not single.untie_embeddings_and_output_weights:
        model.output_layer.weight = model.embedding.word_embeddings.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name].float())
        for name, buffer in persistent_buffers(model).items():   # the routers' expert biases
            buffer.copy_(params[name])
    model.eval()
    with torch.no_grad():
        return config, model(ids)[..., :config.vocab_size].float()


def hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def compute(tpfuse_dir: str, hf_dir: str) -> dict:
    """The certificate of a (tpfuse checkpoint, HF directory) pair holding the same model."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"computed": False, "reason": "transformers is not installed", "tpfuse":
                os.path.abspath(tpfuse_dir), "huggingface": os.path.abspath(hf_dir)}
    from tpfuse.checkpoint.reading import read_checkpoint_head

    vocab = read_checkpoint_head(tpfuse_dir)["model_config"]["vocab_size"]
    ids = torch.tensor([fixed_prompt(vocab)])
    config, ours = tpfuse_logits(tpfuse_dir, ids)
    theirs = hf_logits(hf_dir, ids)[..., :config.vocab_size]
    largest = float(theirs.abs().max())
    return {"computed": True, "max_abs_logit_diff": float((ours - theirs).abs().max()),
            "tolerance": tolerance_for(config, largest), "max_abs_logit": largest,
            "prompt": ids[0].tolist(), "tpfuse": os.path.abspath(tpfuse_dir),
            "huggingface": os.path.abspath(hf_dir)}


def check(certificate: dict) -> None:
    """ValueError when a computed difference exceeds its tolerance."""
    if certificate["computed"] and not (certificate["max_abs_logit_diff"]
                                        <= certificate["tolerance"]):
        raise ValueError(f"the converted model's logits differ from transformers' by "
                         f"{certificate['max_abs_logit_diff']:.3e}, above the tolerance "
                         f"{certificate['tolerance']:.3e} (fp32 summation-order bound): refused")


def write(folder: str, certificate: dict) -> None:
    """Store ``certificate`` in ``folder``, its "tpfuse" / "huggingface" paths relative to it."""
    stored = dict(certificate)
    for side in SIDES:
        stored[side] = os.path.relpath(certificate[side], start=folder)
    with open(os.path.join(folder, CERTIFICATE), "w") as handle:
        json.dump(stored, handle, indent=1)


def certify(written: str, tpfuse_dir: str, hf_dir: str) -> dict:
    """Compute, check (removing ``written`` when above tolerance) and store the certificate."""
    import shutil

    certificate = compute(tpfuse_dir, hf_dir)
    try:
        check(certificate)
    except ValueError:
        shutil.rmtree(written, ignore_errors=True)
        raise
    write(written, certificate)
    return certificate


def verify(folder: str) -> dict:
    """Recompute the certificate stored in ``folder`` (a converted tpfuse checkpoint or HF
    export) against the counterpart it names; ValueError above tolerance."""
    path = os.path.join(folder, CERTIFICATE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder} holds no {CERTIFICATE} (not written by tpfuse-convert)")
    with open(path) as handle:
        stored = json.load(handle)
    # relative to the folder (an absolute path, as older certificates hold, joins as itself)
    tpfuse_dir, hf_dir = (os.path.join(folder, stored[side]) for side in SIDES)
    certificate = compute(tpfuse_dir, hf_dir)
    check(certificate)
    return certificate
