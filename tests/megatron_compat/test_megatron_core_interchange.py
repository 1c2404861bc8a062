"""Checkpoints go both ways between megatron-core 0.16 and tpfuse (Megatron's torch_dist
layout): a GPT saved by megatron-core at tp = 1 loads into the compat GPTModel at tp = 2, and
one saved by tpfuse at tp = 2 loads into megatron-core's GPTModel at tp = 1; the logits on a
probe batch agree. Needs megatron-core importable (``pip install --no-deps
megatron-core==0.16.1``); megatron-core runs in its own process (``megatron_core_reference``).

Tolerance: the same weights; the two implementations (and tp 1 vs 2) order the fp32 sums
differently: rtol = atol = 1e-5, as the tp_layers tests (see tests/support/tp_testing.py).
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core 0.16 is not installed: the "
                    "checkpoint interchange with files it writes is not tested here")

import megatron_core_reference as reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _megatron(action, directory):
    subprocess.run([sys.executable, os.path.join(HERE, "megatron_core_reference.py"), action,
                    directory], check=True, cwd=HERE, timeout=300)
    return torch.load(os.path.join(os.path.dirname(directory), f"{action}_logits.pt"))


def _tpfuse(action, directory):
    """tp = 2 compat GPTModel: load (and return logits) or save (and return logits)."""
    import torch.distributed as dist

    from tpfuse.megatron_compat import dist_checkpointing, parallel_state
    from tpfuse.megatron_compat.models.gpt import GPTModel
    from tpfuse.megatron_compat.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tpfuse.megatron_compat.tensor_parallel import (gather_from_tensor_model_parallel_region,
                                                        model_parallel_cuda_manual_seed)
    from tpfuse.megatron_compat.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(2, 1)
    try:
        model_parallel_cuda_manual_seed(5)
        config = TransformerConfig(num_layers=reference.NUM_LAYERS, hidden_size=reference.HIDDEN,
                                   num_attention_heads=reference.HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=reference.VOCAB,
                         max_sequence_length=reference.SEQ)
        if action == "load":
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        else:
            if dist.get_rank() == 0:
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), directory)
        model.eval()
        with torch.no_grad():
            return gather_from_tensor_model_parallel_region(model(*reference.probe(), None))
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_core_checkpoint_loads_into_tpfuse(run_distributed, tmp_path):
    directory = str(tmp_path / "megatron")
    expected = _megatron("write", directory)
    for logits in run_distributed(2, _tpfuse, "load", directory):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_tpfuse_checkpoint_loads_into_megatron_core(run_distributed, tmp_path):
    directory = str(tmp_path / "tpfuse")
    ours = run_distributed(2, _tpfuse, "save", directory)[0]
    torch.testing.assert_close(_megatron("read", directory), ours, rtol=1e-5, atol=1e-5)
