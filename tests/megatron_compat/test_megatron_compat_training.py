"""A Megatron-style training script (TransformerConfig, Megatron-signature layers, forward_step
with a 3-value loss function, get_forward_backward_func(), the module-level micro-batch API with
ramp-up) trains at tp2·pp2 on gloo and reproduces the native tpfuse script's losses.

Both build identical weights and read identical data; the compat layers run on the native
ones, so only the loss reduction order differs (Σ loss / tokens vs a mean), ~1e-7 relative per
step in fp32; 1e-5 leaves room for 4 SGD steps while a wrong convention (loss not divided by the
micro-batch or token count, a bias dropped, a wrong micro-batch count) moves the loss by far more.
"""
import pytest

from megatron_style_script import STEPS, both


def test_megatron_style_script_matches_native_run(run_distributed):
    results = run_distributed(4, both)
    logged = [r for r in results if r[0]]
    assert len(logged) == 2                      # the two last-stage ranks (tp 0 and 1)
    megatron, native = logged[0]
    assert len(megatron) == STEPS and megatron[-1] < megatron[0]     # it trains
    assert megatron == pytest.approx(native, rel=1e-5)
    assert logged[1] == logged[0]                # both TP ranks saw the same losses
