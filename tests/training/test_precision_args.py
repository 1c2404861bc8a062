"""Mixed-precision, loss-scaling and data-parallel flags: Megatron-LM's defaults, the gradient
buffer dtype each precision gets, and bad settings refused with the flag's name (at parse time, so
before any process reaches a collective)."""
import pytest
import torch

from tpfuse.training import arguments
from tpfuse.training.precision_args import ddp_config_from_settings, grad_reduce_in_fp32

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "3e-5",
        "--mock-data", "--vocab-size", "63"]

# megatron/training/arguments.py, by argparse dest
MEGATRON_DEFAULTS = {
    "loss_scale": None, "initial_loss_scale": 2.0**32, "min_loss_scale": 1.0,
    "loss_scale_window": 1000, "hysteresis": 2, "accumulate_allreduce_grads_in_fp32": False,
    "grad_reduce_in_bf16": False, "use_distributed_optimizer": False,
    "overlap_grad_reduce": False, "overlap_param_gather": False, "ddp_bucket_size": None,
}


def test_precision_flags_default_to_megatron():
    parsed = vars(arguments.build_parser().parse_args([]))
    assert {name: parsed[name] for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS
    assert parsed["skip_nonfinite"] is False


@pytest.mark.parametrize("flags, params_dtype, fp32_grads", [
    ([], torch.float32, True),
    (["--bf16"], torch.bfloat16, True),                       # Megatron turns fp32 on for bf16
    (["--bf16", "--grad-reduce-in-bf16"], torch.bfloat16, False),
    (["--fp16"], torch.float16, False),                       # fp16 reduces in fp16 unless ...
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], torch.float16, True),
])
def test_gradient_buffer_dtype_follows_megatron(flags, params_dtype, fp32_grads):
    config, args = arguments.parse_args(TINY + flags)
    assert config.params_dtype == params_dtype
    assert grad_reduce_in_fp32(args.precision, config) is fp32_grads
    assert ddp_config_from_settings(args.precision, args.data_parallel,
                                    config).grad_reduce_in_fp32 is fp32_grads


@pytest.mark.parametrize("flags, message", [
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "contradict"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be > 0, got 0.0"),
    (["--fp16", "--initial-loss-scale", "-1"], "--initial-loss-scale must be > 0"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "--min-loss-scale"),
    (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window must be >= 1, got 0"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis must be >= 1, got 0"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1 elements, got 0"),
])
def test_bad_precision_settings_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace(".", r"\.")):
        arguments.parse_args(TINY + flags)
