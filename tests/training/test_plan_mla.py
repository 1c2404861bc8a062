"""tpfuse-plan with multi-latent attention: the chunk's parameters are the real GPTModel's (names
and element counts, registration order), and the predicted activations equal the bytes the
forward saves for backward (saved-tensor hooks, test_plan.py's counter), exactly, for q
compression, latent norms (LayerNorm / RMSNorm, fp32 / bf16), v head dims below / equal to /
above the q/k one, every selective recompute module and tp 2 with and without SP. Under full
recompute the rope tables are held by the layers' checkpoints by reference, not as saved
tensors, so there the measured bytes plus the tables are compared.
"""
import pytest

from test_plan import saved_chunk_bytes_body
from tpfuse.training.arguments import parse_args
from tpfuse.training.plan.activations import chunk_activation_bytes
from tpfuse.training.plan.memory import chunk_shapes
from tpfuse.training.plan.mla import mla_rope_table_bytes

MLA = ["--multi-latent-attention", "--kv-lora-rank", "24", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
SELECTIVE = ["--recompute-activations", "--recompute-modules"]
GRID = [[], ["--bf16"], ["--q-lora-rank", "20", "--qk-layernorm"],
        ["--q-lora-rank", "20", "--qk-layernorm", "--bf16"],
        ["--q-lora-rank", "20", "--qk-layernorm", "--bf16", "--normalization", "RMSNorm"],
        ["--v-head-dim", "16"], ["--v-head-dim", "20", "--q-lora-rank", "20"],
        SELECTIVE + ["core_attn"], SELECTIVE + ["mla_up_proj", "--qk-layernorm", "--bf16"],
        SELECTIVE + ["layernorm", "mlp", "core_attn", "--q-lora-rank", "20", "--qk-layernorm"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"]]
TP_GRID = [["--tensor-model-parallel-size", "2"],
           ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--q-lora-rank", "20",
            "--qk-layernorm"],
           ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + SELECTIVE
           + ["mla_up_proj"]]


def _config(flags):
    from test_plan import ACTIVATION_SHAPE

    return parse_args(ACTIVATION_SHAPE + MLA + flags)[0]


def _check(flags, saved):
    config = _config(flags)
    kept, _ = chunk_activation_bytes(config, 2, 0, 0)
    if config.recompute_granularity == "full":
        saved += mla_rope_table_bytes(config, 2)
    assert kept == saved, flags


def test_mla_parameters_are_the_models():
    from tpfuse.models import build_model, make_gpt_model_provider

    for flags in ([], ["--q-lora-rank", "20", "--qk-layernorm"],
                  ["--qk-layernorm", "--normalization", "RMSNorm", "--disable-bias-linear"]):
        config = _config(flags)
        (model,) = build_model(make_gpt_model_provider(config), config, None)
        assert ([(n, p.numel()) for n, p in model.named_parameters()]
                == [(s.name, s.numel) for s in chunk_shapes(config, 0, 0)]), flags


def test_mla_activations_equal_the_saved_tensors():
    for flags, saved in zip(GRID, saved_chunk_bytes_body([MLA + f for f in GRID])):
        _check(flags, saved)


def test_mla_activations_under_tensor_and_sequence_parallelism(run_distributed):
    measured = run_distributed(2, saved_chunk_bytes_body, [MLA + f for f in TP_GRID])
    for index, flags in enumerate(TP_GRID):
        for rank_result in measured:
            _check(flags, rank_result[index])
