"""Checkpoints go both ways between megatron-core 0.16 and tpfuse (Megatron's torch_dist
layout), live: for each case of the fixture writer (dense, SwiGLU with tied embeddings, MoE
with sequential SwiGLU experts; tests/support/write_megatron_core_fixtures.py) a GPT saved by
megatron-core at tp = 1 loads into the compat GPTModel at tp = 2, and one saved by tpfuse at
tp = 2 loads into megatron-core's GPTModel at tp = 1; the logits on the probe batch agree.
Needs megatron-core importable; megatron-core runs in its own process
(``megatron_core_reference.py``). Without it, the direction megatron-core → tpfuse is still
tested on the committed fixtures (test_dist_checkpointing_megatron_fixtures.py).

Tolerance: the same weights; the two implementations (and tp 1 vs 2) order the fp32 sums
differently: rtol = atol = 1e-5, as the tp_layers tests (see tests/support/tp_testing.py).
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core 0.16 is not installed: the live "
                    "checkpoint interchange with it is not tested here (the committed "
                    "megatron-core fixtures are, in test_dist_checkpointing_megatron_fixtures)")

import dist_checkpointing_cases as cases  # noqa: E402
from support import write_megatron_core_fixtures as fixtures  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = fixtures.LIVE_CASES           # megatron-core computes GroupedMLP on CUDA only


def _recorded(case):
    return {"config": fixtures.config_fields(case), "model": fixtures.CASES[case][1],
            "vocab_size": fixtures.VOCAB, "max_sequence_length": fixtures.SEQ}


def _megatron(action, directory, case):
    subprocess.run([sys.executable, os.path.join(HERE, "megatron_core_reference.py"), action,
                    directory, case], check=True, cwd=HERE, timeout=300)
    return torch.load(os.path.join(os.path.dirname(directory), f"{action}_logits.pt"))


def _tpfuse(action, directory, case):
    """tp = 2 compat GPTModel of the case: load (and return logits) or perturb, save (and
    return logits)."""
    import torch.distributed as dist

    from tpfuse.megatron_compat import dist_checkpointing, parallel_state

    try:
        model = cases.megatron_case_model(_recorded(case), 2, seed=5)
        if action == "load":
            model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
        else:
            cases.perturb(model, seed=29)
            if dist.get_rank() == 0:
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), directory)
        with torch.no_grad():
            return model(*fixtures.probe(), None, runtime_gather_output=True)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_checkpoint_loads_into_tpfuse(run_distributed, tmp_path, case):
    directory = str(tmp_path / "megatron")
    expected = _megatron("write", directory, case)
    for logits in run_distributed(2, _tpfuse, "load", directory, case):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_tpfuse_checkpoint_loads_into_megatron_core(run_distributed, tmp_path, case):
    directory = str(tmp_path / "tpfuse")
    ours = run_distributed(2, _tpfuse, "save", directory, case)[0]
    torch.testing.assert_close(_megatron("read", directory, case), ours, rtol=1e-5, atol=1e-5)
