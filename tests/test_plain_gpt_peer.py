"""benchmarks/plain_gpt_peer.py is really tpfuse's GPT written plainly: given tpfuse's weights it
has the same parameter count, its own FLOP count (read off its Linear modules) equals
``tpfuse.models.flops``, and its per-token loss equals the GPTModel's (fp32, CPU)."""
import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "plain_gpt_peer.py")
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "100",
          "--make-vocab-size-divisible-by", "64", "--position-embedding-type", "rope",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data",
          "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
          "--lr", "1e-3", "--tensor-model-parallel-size", "1",
          "--pipeline-model-parallel-size", "1"]
VARIANTS = {
    "gqa-swiglu-rmsnorm-tied": ["--num-query-groups", "2", "--swiglu", "--normalization",
                                "RMSNorm", "--disable-bias-linear"],
    "mha-gelu-layernorm-bias-untied": ["--untie-embeddings-and-output-weights"],
}
# fp32 on the CPU, the same operations up to summation order: a few roundings of 1.2e-7 each
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def peer_script():
    """The script loaded as a module (its ``main`` is what ``python SCRIPT`` runs): one import in
    this process instead of an interpreter start-up per variant."""
    spec = importlib.util.spec_from_file_location("plain_gpt_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peer_is_the_same_model(variant, peer_script, capsys):
    assert peer_script.main(["--compare-with-tpfuse", *COMMON, *VARIANTS[variant]]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["peer_parameters"] == result["tpfuse_parameters"]
    assert result["peer_flops_per_token"] == result["tpfuse_flops_per_token"]
    assert result["max_abs_loss_difference"] <= TOLERANCE * result["max_abs_loss"]
