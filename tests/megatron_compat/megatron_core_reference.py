"""megatron-core 0.16's side of the checkpoint interchange test, run as its own process (one
rank, tp = 1, gloo) with megatron-core installed: ``write DIR`` builds Megatron's GPT (local
spec) and saves it with megatron-core's dist_checkpointing; ``read DIR`` loads a checkpoint
written by tpfuse into Megatron's GPT. Both write the model's logits on the probe batch to
``DIR/../<write|read>_logits.pt``.

megatron-core needs CUDA for a few calls even with ``use_cpu_initialization``; on a CPU they
are emulated here (current device → cpu, synchronize → nothing, the RNG tracker's CUDA
states → the CPU generator's), as its own CPU run of Megatron's example does.
"""
import os
import socket
import sys

import torch

NUM_LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 16, 4, 32, 8


def probe():
    tokens = (torch.arange(2 * SEQ).view(2, SEQ) * 3) % VOCAB
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def _emulate_cuda():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.tensor_parallel import random as megatron_random
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    return megatron_random


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(action, directory):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    megatron_random = _emulate_cuda()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    megatron_random.model_parallel_cuda_manual_seed(11)
    torch.manual_seed(11)
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN,
                               num_attention_heads=HEADS, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    if action == "write":
        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), directory)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    model.eval()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(*probe(), causal)                          # (b, s, V)
    torch.save(logits, os.path.join(os.path.dirname(directory), f"{action}_logits.pt"))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
