"""Megatron-LM's simple train loop example (``megatron_simple_train_loop.py``: the same
imports and calls with ``megatron.core`` → ``tpfuse.megatron_compat``, cpu, gloo) runs on 2
processes at tp=2: five iterations with a loss ≈ ln(100) (the example's plain Adam sees no
gradient behind Megatron's DDP, so the model does not move: megatron-core's run logs 4.60–4.62),
a checkpoint in Megatron's torch_dist layout, and a reload that gives the saved logits exactly
(the same bytes are read back into the same layout).
"""
import math

from megatron_simple_train_loop import main


def test_simple_train_loop_example_runs(run_distributed, tmp_path):
    results = run_distributed(2, main, str(tmp_path))
    for losses, reloaded_equal, files in results:
        assert len(losses) == 5
        for loss in losses:                      # uniform over 100 tokens: ln 100 = 4.605
            assert abs(loss - math.log(100)) < 0.1, losses
        assert reloaded_equal
        assert {"metadata.json", ".metadata", "common.pt"} <= set(files)
    assert results[0][0] == results[1][0]       # both tp ranks log the same losses
