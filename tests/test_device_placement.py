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

A tensor made with an explicit but wrong device (``device="cpu"``), or by a helper whose device
parameter defaults to the CPU, escapes that recorder. So the trainer's own collectives (timers'
gather, checkpoint agreement and async-save poll, exit agreement, dataset-build failure flag,
layout check, grad-norm statistics) also run under ``PretendNccl``: the project sees an NCCL
backend, and every tensor handed to a collective must stand for a CUDA tensor. Its replay of the
timers' old default (a gather row made with ``device=None``) shows the check can fail.
"""
import os
import threading
from types import SimpleNamespace

import torch

from support.device_audit import REPO, DefaultDeviceRecorder, PretendNccl, built_on_cpu
from support.pretrain_run import run_pretrain

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
    from tpfuse.inference import generate, load_model
    from tpfuse.parallel import parallel_state

    recorder = DefaultDeviceRecorder()
    with recorder:
        for run in RUNS:
            run_pretrain(TINY + [flag.format(root=root) for flag in run],
                         model_provider_wrapper=built_on_cpu, with_sampling=True)
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


def _trainer_collectives() -> None:
    """Each collective the trainer issues outside the model, called as the trainer calls it."""
    from tpfuse.data.builder import BlendedMegatronDatasetBuilder
    from tpfuse.parallel.devices import collective_device
    from tpfuse.parallel.layout import RankLayout
    from tpfuse.parallel.state import check_same_layout_on_every_rank
    from tpfuse.checkpoint import format as ckpt
    from tpfuse.checkpoint.async_save import AsyncCheckpointSaver
    from tpfuse.training.exit_conditions import ExitConditions
    from tpfuse.training.grad_norm import global_norm_stats
    from tpfuse.training.timers import Timers

    timers = Timers(log_level=2, log_option="all")
    timers.gather({"forward-backward": 1.0})                 # no device given: the backend's
    timers("optimizer", 1).start(barrier=True)
    timers("optimizer", 1).stop()
    timers.step_summary()
    ckpt.agree(None, "a test step")
    saver = AsyncCheckpointSaver("unused")
    running = threading.Thread(target=threading.Event().wait, args=(0.5,))
    running.start()
    saver.pending = (1, SimpleNamespace(done=False, thread=running), {})
    assert saver.poll() is None                              # the flag all-reduce, not done
    running.join()
    exits = ExitConditions(SimpleNamespace(exit_interval=None, exit_duration_in_mins=1e6,
                                           exit_signal_handler=False))
    assert exits.reason(1) is None
    BlendedMegatronDatasetBuilder._share_failure(None)
    check_same_layout_on_every_rank(RankLayout(2), None)
    device = collective_device()
    global_norm_stats([torch.ones(3, device=device)], [], None, device)


def _under_pretend_nccl():
    from tpfuse.parallel.devices import collective_device

    pretend = PretendNccl()
    with pretend:
        assert collective_device() == torch.device("cuda", 0)
        _trainer_collectives()
    clean = sorted(pretend.found)
    # the timers' old gather: a row made on the default device (the CPU) whatever the backend
    old_gather = compile("local = torch.tensor([1.0, 2.0], dtype=torch.float64, device=None)\n"
                         "rows = [torch.empty_like(local) for _ in range(2)]\n"
                         "dist.all_gather(rows, local)",
                         os.path.join(REPO, "training", "timers.py"), "exec")
    pretend = PretendNccl()
    with pretend:
        exec(old_gather, {"torch": torch, "dist": torch.distributed})
    return clean, sorted(pretend.found)


def test_trainer_collectives_take_the_backends_device(run_distributed):
    results = run_distributed(2, _under_pretend_nccl)
    for clean, old_gather in results:
        assert clean == [], "collectives given CPU tensors under NCCL:\n" + "\n".join(clean)
        assert old_gather == ["training/timers.py:3: dist.all_gather got a CPU tensor on an "
                              "NCCL group"]


def test_collective_device_follows_the_backend(monkeypatch):
    from tpfuse.parallel.devices import collective_device

    backends = {None: "gloo", "world-nccl": "nccl", "mixed": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backends[group])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cpu")
    assert collective_device("world-nccl") == torch.device("cuda", 3)
    assert collective_device("mixed") == torch.device("cuda", 3)
