"""Writes the megatron-core checkpoint fixtures of tests/data/megatron_core_checkpoints/ (run it
with a Python that has megatron-core 0.16.1 installed; tpfuse is not needed)::

    python tests/support/write_megatron_core_fixtures.py [OUT_DIR]

For every case in CASES (a dense GPT, a SwiGLU GPT with tied embeddings, an MoE GPT with
sequential SwiGLU experts, the same MoE GPT with grouped-GEMM experts: see WEIGHTS_FROM) it
builds megatron-core's own GPTModel with the local spec at tp = 1 on one gloo rank, moves
every parameter off its initial value (``perturb``: norms and biases would otherwise be 1 and 0,
and a checkpoint reader that dropped them would go unnoticed), saves it with megatron-core's
``dist_checkpointing.save`` into ``OUT_DIR/<case>/checkpoint`` and writes next to it
``reference.pt``: the probe batch (``tokens``, ``position_ids``) and megatron-core's fp32
logits ``(b, s, V)`` on it, plus ``config.json``, the TransformerConfig / GPTModel arguments
the test rebuilds the model from.

megatron-core needs CUDA for a few calls even with ``use_cpu_initialization``; on a CPU they are
emulated (current device → cpu, synchronize → nothing, the RNG tracker's CUDA states → the CPU
generator's; tests/megatron_compat/megatron_core_reference.py uses the same emulation); the
router's optional Transformer Engine GEMM, whose name megatron-core leaves undefined without TE,
is set to None.
"""
import json
import os
import shutil
import socket
import sys

import torch
import torch.nn.functional as F

NUM_LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 32, 4, 64, 16, 2
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "megatron_core_checkpoints")

# case: (TransformerConfig fields beyond the common ones, GPTModel keyword arguments)
CASES = {
    "dense": ({}, {}),
    "swiglu": ({"gated_linear_unit": True, "activation": "silu"},
               {"share_embeddings_and_output_weights": True}),
    "moe": ({"gated_linear_unit": True, "activation": "silu", "num_moe_experts": 4,
             "moe_router_topk": 2, "moe_ffn_hidden_size": HIDDEN // 2, "add_bias_linear": False,
             "moe_token_dispatcher_type": "allgather", "moe_aux_loss_coeff": 0.0}, {}),
}
CASES["moe_grouped"] = (dict(CASES["moe"][0], moe_grouped_gemm=True), {})
# megatron-core's GroupedMLP computes in bf16 with the grouped_gemm CUDA package only: that case
# takes the weights (and logits) of the SequentialMLP case's model, loaded into a GroupedMLP
# model by megatron-core and saved from it (its own layout of the same tensors)
WEIGHTS_FROM = {"moe_grouped": "moe"}
LIVE_CASES = ("dense", "swiglu", "moe")          # the cases megatron-core can also compute
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


def probe():
    """A fixed (b, s) token batch and its positions."""
    tokens = (torch.arange(BATCH * SEQ).view(BATCH, SEQ) * 7 + 3) % VOCAB
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ).contiguous()


def config_fields(case):
    """The TransformerConfig fields of a case (``activation`` names the activation_func)."""
    fields = dict(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(CASES[case][0])
    return fields


def perturb(model, seed):
    """Every parameter += N(0, 0.05²) from a generator seeded once (in named order)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _emulate_cuda():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):       # its import fails without TE
        moe_utils.te_general_gemm = None
    return megatron_random


def _allow_grouped_mlp():
    """GroupedMLP's constructor asserts the grouped_gemm package; it is built here only to
    save and load (its forward, which needs that package, is never run)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = "not installed: GroupedMLP built for checkpoints only"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_model(case, seed):
    """megatron-core's GPTModel of a case (tp = 1, local spec), perturbed; parallel_state
    initialised (the caller destroys it)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = config_fields(case)
    activation = fields.pop("activation", "gelu")
    if fields.get("moe_grouped_gemm"):
        _allow_grouped_mlp()
    parallel_state.initialize_model_parallel(1, 1)
    megatron_random.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(**fields, activation_func=ACTIVATIONS[activation],
                               use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=fields.get("num_moe_experts"),
                                    moe_grouped_gemm=bool(fields.get("moe_grouped_gemm")))
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, **CASES[case][1])
    perturb(model, seed)
    return model


def megatron_logits(model):
    """The model's fp32 logits (b, s, V) on the probe batch (eval mode)."""
    model.eval()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        return model(*probe(), causal).float()


def _regrouped(sequential, case, seed, scratch):
    """A GroupedMLP model of ``case`` holding ``sequential``'s weights (through megatron-core's
    own save and load)."""
    from megatron.core import dist_checkpointing, parallel_state

    os.makedirs(scratch)
    dist_checkpointing.save(sequential.sharded_state_dict(), scratch)
    parallel_state.destroy_model_parallel()
    grouped = megatron_model(case, seed)
    grouped.load_state_dict(dist_checkpointing.load(grouped.sharded_state_dict(), scratch))
    return grouped


def write_case(case, out_dir, seed):
    from megatron.core import dist_checkpointing, parallel_state

    model = megatron_model(WEIGHTS_FROM.get(case, case), seed)
    logits = megatron_logits(model)
    case_dir = os.path.join(out_dir, case)
    checkpoint = os.path.join(case_dir, "checkpoint")
    shutil.rmtree(case_dir, ignore_errors=True)
    if case in WEIGHTS_FROM:
        model = _regrouped(model, case, seed, os.path.join(case_dir, "scratch"))
    os.makedirs(checkpoint)
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
    shutil.rmtree(os.path.join(case_dir, "scratch"), ignore_errors=True)
    tokens, positions = probe()
    torch.save({"tokens": tokens, "position_ids": positions, "logits": logits},
               os.path.join(case_dir, "reference.pt"))
    with open(os.path.join(case_dir, "config.json"), "w") as f:
        json.dump({"config": config_fields(case), "model": CASES[case][1], "vocab_size": VOCAB,
                   "max_sequence_length": SEQ}, f, indent=1, sort_keys=True)
    parallel_state.destroy_model_parallel()


def start_single_process():
    """One gloo rank, CUDA calls emulated."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    _emulate_cuda()


def main(out_dir=DEFAULT_OUT):
    start_single_process()
    for index, case in enumerate(CASES):
        write_case(case, out_dir, seed=11 + index)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
