"""Device placement, checked on a CPU-only machine.

On a GPU every tensor of a step must live on the model's device; one made by a factory without
``device=`` is a CPU tensor and fails there ("Expected all tensors to be on the same device", or an
NCCL collective refusing it), while on the CPU nothing shows. ``tests/_device_audit.py`` records
every such factory call the project's own code makes (see its docstring for the rule). Here the
recorder runs over training steps in bf16/fp16 with the pipeline, tensor, sequence, expert and data
parallel paths, timers, evaluation, synchronous / asynchronous / resharded checkpoints, the exit
agreements, MoE routing and logging, the trained model's sample and generation from a checkpoint;
the reference is the empty set. The recorder's own test replays the line that crashed the first
GPU run (``torch.tensor(float(len(values)))`` stacked with the losses) as project code.
"""
import os

import torch

from _device_audit import REPO, DefaultDeviceRecorder, built_on_cpu

TINY = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--log-interval", "1",
        "--no-progress-bar", "--no-layout-table", "--eval-interval", "2", "--eval-iters", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "1e-2", "--fp16", "--initial-loss-scale", "1024"]
RUNS = [
    # pp2 × vpp2 (p2p, interleaving), bf16, per-rank timers (a gather), the trained model's sample
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
     "--bf16", "--train-iters", "2", "--timing-log-level", "2", "--save", "{root}/dense",
     "--sample-prompt", "1 2", "--sample-max-new-tokens", "2"],
    # resharded to tp2 + SP, distributed optimizer, async save, full recompute, exit agreements
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16", "--train-iters", "3",
     "--load", "{root}/dense", "--save", "{root}/dense", "--async-save",
     "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method",
     "uniform", "--recompute-num-layers", "1", "--exit-duration-in-mins", "100",
     "--exit-signal-handler"],
    # MoE over ep2 (all-to-all), fp16 loss scaling, selective recompute, router losses logged
    MOE + ["--expert-model-parallel-size", "2", "--recompute-granularity", "selective",
           "--train-iters", "2", "--save", "{root}/moe"],
    # the same checkpoint on one data-parallel replica of tp2 (expert weights resharded)
    MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "3",
           "--load", "{root}/moe"],
]


def _train_and_generate(root):
    from tpfuse import pretrain_gpt
    from tpfuse.inference import generate, load_model
    from tpfuse.parallel import parallel_state
    from tpfuse.training.pretrain import pretrain

    recorder = DefaultDeviceRecorder()
    with recorder:
        for run in RUNS:
            pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                     built_on_cpu(pretrain_gpt.model_provider), pretrain_gpt.forward_step,
                     argv=TINY + [flag.format(root=root) for flag in run])
            parallel_state.destroy_model_parallel()
        state = parallel_state.initialize_model_parallel(1, 2)
        chunks = load_model(f"{root}/dense", state)
        generate(chunks, [[1, 2, 3], [4]], 2, temperature=0.9, top_k=5, state=state)
    return sorted(recorder.found)


def test_no_step_path_creates_a_tensor_on_the_default_device(run_distributed, tmp_path):
    found = run_distributed(2, _train_and_generate, str(tmp_path))
    assert found == [[], []], "tensors created without a device:\n" + "\n".join(found[0])


def _replay(source: str, values: torch.Tensor) -> set:
    """Run ``source`` as if it were a line of training/pretrain.py; what the recorder found."""
    code = compile(source, os.path.join(REPO, "training", "pretrain.py"), "exec")
    recorder = DefaultDeviceRecorder()
    with recorder:
        exec(code, {"torch": torch, "values": values})
    return recorder.found


def test_recorder_flags_the_first_gpu_crash_and_passes_its_fix():
    values = torch.tensor([2.0, 4.0])
    crashed = "torch.stack([values.sum(), torch.tensor(float(len(values)))])"
    assert _replay(crashed, values) == {
        "training/pretrain.py:1: torch.tensor(...) without a device"}
    fixed = ("torch.stack([values.sum(), values.new_tensor(float(len(values)))])\n"
             "torch.zeros(2, device=values.device); torch.as_tensor(values)\n"
             "torch.arange(3, device='cpu')")
    assert _replay(fixed, values) == set()
    assert _replay("torch.zeros(2, device=None)", values)      # an explicit None is the default
