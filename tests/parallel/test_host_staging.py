"""The host-staged gloo groups (``tpfuse.parallel.host_staging``) and the trainer's ``--device``.

On a GPU, ``--device cuda --distributed-backend gloo`` keeps each rank's model on the GPU while
every collective of a CUDA tensor is copied to host memory, run by gloo and copied back. On this
CPU-only machine the same path runs with ``HOST_STAGED_EVERY``, which stages CPU tensors too (to
a second host tensor), in a pool of two workers joined with that backend:

- every op the project issues (all-reduce sync and async, all-gather in both forms,
  reduce-scatter, uneven all-to-all, broadcast, isend / irecv, batched p2p, barrier, object
  collectives, a sub-group) gives what the same op gives on plain gloo, and its tensors did go
  through the staging;
- the trainer at tp=2 and pp=2 gives bit-identical losses on the staged and the plain gloo
  world (the staging copies bytes: the reference is exact equality);
- with ``--device cuda`` requested (CUDA pretended, tensors asked for on CUDA made on the CPU),
  ``support.device_audit``'s rule holds (no factory call on the default device) and no operation
  combines a tensor the project made explicitly on the host (``device="cpu"``, ``.to("cpu")``,
  the collective device of a gloo world) with one of the model's (on a GPU: a device mismatch);
- the device choices that cannot run are refused before any process group exists.
"""
import sys
from functools import partial

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from support.device_audit import DefaultDeviceRecorder, _is_project_file, _tensors, REPO
from support.pretrain_run import logged_by_one_rank, logged_train_losses, run_pretrain

TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3",
        "--mock-data", "--log-interval", "1000", "--no-progress-bar", "--no-layout-table",
        "--eval-interval", "1000", "--eval-iters", "1"]
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}


@pytest.fixture(scope="module")
def staged_pool():
    from tpfuse.parallel.host_staging import HOST_STAGED_EVERY
    from tpfuse.parallel.launch import WorkerPool

    pool = WorkerPool(2, backend=HOST_STAGED_EVERY)
    yield pool.run
    pool.close()


# ---------------------------------------------------------------------------- every op
def _every_op() -> dict:
    import torch.distributed as dist

    rank, other = dist.get_rank(), 1 - dist.get_rank()
    out = {"backend": dist.get_backend()}
    x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    dist.all_reduce(x)
    out["all_reduce"] = x.tolist()
    work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    out["all_reduce_async_max"] = x.tolist()
    rows = [torch.empty(2) for _ in range(2)]
    dist.all_gather(rows, torch.tensor([rank, rank + 0.5]))
    out["all_gather"] = [row.tolist() for row in rows]
    flat = torch.empty(4)
    dist.all_gather_into_tensor(flat, torch.tensor([rank, rank + 0.5]))
    out["all_gather_into_tensor"] = flat.tolist()
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(4.0) * (rank + 1))
    out["reduce_scatter_tensor"] = mine.tolist()
    sizes = [1, 2] if rank == 0 else [2, 1]         # rank r sends sizes[j] rows to rank j
    received = [1, 2] if rank == 0 else [2, 1]
    got = torch.empty(sum(received))
    dist.all_to_all_single(got, torch.arange(3.0) + 10 * rank, output_split_sizes=received,
                           input_split_sizes=sizes)
    out["all_to_all_single"] = got.tolist()
    value = torch.tensor([7.0 + rank])
    dist.broadcast(value, src=1)
    out["broadcast"] = value.tolist()
    inbox = torch.empty(3)
    sends = dist.isend(torch.full((3,), 100.0 + rank), dst=other)
    dist.irecv(inbox, src=other).wait()
    sends.wait()
    out["isend_irecv"] = inbox.tolist()
    batched = torch.empty(2)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), -1.0 - rank),
                                                   other),
                                        dist.P2POp(dist.irecv, batched, other)]):
        work.wait()
    out["batch_isend_irecv"] = batched.tolist()
    dist.barrier()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=0)
    out["broadcast_object_list"] = box
    sub = dist.new_group([0, 1])
    y = torch.ones(2)
    dist.all_reduce(y, group=sub)
    out["sub_group"] = (dist.get_backend(sub), y.tolist())
    out["staged"] = dist.distributed_c10d._get_default_group().staged \
        if hasattr(dist.distributed_c10d._get_default_group(), "staged") else None
    return out


def test_every_op_matches_plain_gloo_and_goes_through_the_host_copies(staged_pool,
                                                                      run_distributed):
    staged, plain = staged_pool(_every_op), run_distributed(2, _every_op)
    for rank in range(2):
        assert staged[rank]["backend"] == "gloo_host_staged_cpu"
        assert plain[rank]["backend"] == "gloo"
        assert staged[rank]["sub_group"][0] == "gloo_host_staged_cpu"
        assert staged[rank]["staged"] >= 20          # each tensor op above staged its tensors
        assert plain[rank]["staged"] is None
        for op in plain[rank]:
            if op not in ("backend", "staged", "sub_group"):
                assert staged[rank][op] == plain[rank][op], op
    # and the plain results are the ops' definitions
    assert plain[0]["all_reduce"] == [3.0, 30.0]
    assert plain[1]["all_to_all_single"] == [1.0, 2.0, 12.0]
    assert plain[0]["isend_irecv"] == [101.0] * 3 and plain[1]["batch_isend_irecv"] == [-1.0] * 2


# ---------------------------------------------------------------------------- training
def _train(argv) -> list | None:
    return logged_train_losses(TINY + list(argv))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trainer_losses_are_identical_on_the_staged_world(layout, staged_pool, run_distributed):
    staged = logged_by_one_rank(staged_pool(_train, LAYOUTS[layout]))
    plain = logged_by_one_rank(run_distributed(2, _train, LAYOUTS[layout]))
    assert len(staged) == 3 and staged[-1] < staged[0]
    assert staged == plain


# ---------------------------------------------------------------------------- --device cuda
_CUDA_STUBS = {"is_available": lambda: True, "device_count": lambda: 1,
               "current_device": lambda: 0, "set_device": lambda device: None,
               "synchronize": lambda device=None: None,
               "max_memory_allocated": lambda device=None: 0,
               "memory_allocated": lambda device=None: 0,
               "reset_peak_memory_stats": lambda device=None: None}
_TRANSFERS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_,
              torch.Tensor.item, torch.Tensor.tolist}


def _names(value, device_type: str) -> bool:
    return isinstance(value, (str, torch.device)) and torch.device(value).type == device_type


def _where(frame) -> str | None:
    import os

    if not _is_project_file(frame.f_code.co_filename):
        return None
    return f"{os.path.relpath(frame.f_code.co_filename, REPO)}:{frame.f_lineno}"


class PretendCuda(TorchFunctionMode):
    """CUDA looks available (device 0); a tensor asked for on CUDA (a factory's ``device=``,
    ``.to(cuda)``, ``.cuda()``) is made on the CPU, standing for the model's device. A tensor the
    project makes explicitly on the host (a factory naming the CPU, ``.to("cpu")``, ``.cpu()``)
    is marked, and so is what is computed from marked tensors alone. ``found``: the project's
    operations that take a marked tensor together with an unmarked one (transfers and copies
    excepted) — on a GPU, host memory meeting the model's."""

    def __init__(self):
        super().__init__()
        self.found: set[str] = set()
        self.asked_for_cuda = 0
        self.building = False        # inside the model provider: on the host, then sent to CUDA
        self._factories = _device_constructors()
        self._saved = {}

    def __enter__(self):
        self._saved = {name: getattr(torch.cuda, name) for name in _CUDA_STUBS}
        for name, stub in _CUDA_STUBS.items():
            setattr(torch.cuda, name, stub)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, saved in self._saved.items():
            setattr(torch.cuda, name, saved)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        targets = list(args[1:]) + [kwargs.get("device")] if func is torch.Tensor.to else \
            [kwargs.get("device")] if func in self._factories else []
        if func is torch.Tensor.cuda or any(_names(t, "cuda") for t in targets):
            self.asked_for_cuda += 1
            if func is torch.Tensor.cuda:
                return args[0].clone()
            args = tuple("cpu" if _names(a, "cuda") else a for a in args)
            kwargs = {k: "cpu" if k == "device" and _names(v, "cuda") else v
                      for k, v in kwargs.items()}
            if func is torch.Tensor.to:
                kwargs["copy"] = True
            return func(*args, **kwargs)                      # the model's side: unmarked
        host = not self.building and (func is torch.Tensor.cpu or
                                      any(_names(t, "cpu") for t in targets))
        result = func(*args, **kwargs)
        inputs = _tensors(list(args) + list(kwargs.values()))
        marked = [t for t in inputs if getattr(t, "on_host", False)]
        if host or (marked and len(marked) == len(inputs)):
            for tensor in _tensors(result):
                tensor.on_host = True
        elif marked and func not in _TRANSFERS:
            where = _where(sys._getframe(1))
            if where:
                self.found.add(f"{where}: {getattr(func, '__name__', func)} takes a host tensor "
                               "with the model's")
        return result


def _built_on_the_host(model_provider, pretend: PretendCuda):
    """``support.device_audit.built_on_cpu``'s exemption: the trainer builds the model on the
    host and sends it to the model's device; those parameters are the model's, not host tensors."""
    def provider(*args, **kwargs):
        pretend.building = True
        try:
            with torch.device("cpu"):
                return model_provider(*args, **kwargs)
        finally:
            pretend.building = False
    return provider


def _train_on_pretend_cuda(argv) -> tuple:
    recorder, pretend = DefaultDeviceRecorder(), PretendCuda()
    with pretend, recorder:
        result = run_pretrain(TINY + ["--device", "cuda", "--distributed-backend", "gloo",
                                      "--timing-log-level", "2"] + list(argv),
                              model_provider_wrapper=partial(_built_on_the_host, pretend=pretend))
    return (sorted(recorder.found), sorted(pretend.found), pretend.asked_for_cuda,
            result.train_losses if result.is_logger else None)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_device_cuda_puts_nothing_on_the_wrong_device(layout, staged_pool):
    per_rank = staged_pool(_train_on_pretend_cuda, LAYOUTS[layout])
    for default_device, mixed, asked, _ in per_rank:
        assert default_device == [], "\n".join(default_device)
        assert mixed == [], "\n".join(mixed)
        assert asked > 0                                 # the model was sent to "cuda"
    assert len(logged_by_one_rank([losses for *_, losses in per_rank])) == 3     # and it trained


def _replay_mix(source: str) -> set:
    """``source`` run as a line of training/pretrain.py under PretendCuda: what it found."""
    import os

    code = compile(source, os.path.join(REPO, "training", "pretrain.py"), "exec")
    pretend = PretendCuda()
    with pretend:
        exec(code, {"torch": torch})
    return pretend.found


def test_pretend_cuda_flags_host_memory_meeting_the_model():
    mixed = ("weights = torch.ones(3, device='cuda')\n"
             "flags = torch.zeros(3, device='cpu')\n"
             "weights + flags")
    assert _replay_mix(mixed) == {"training/pretrain.py:3: add takes a host tensor with the "
                                  "model's"}
    moved = ("weights = torch.ones(3, device='cuda')\n"
             "flags = torch.zeros(3, device='cpu')\n"
             "weights + flags.to('cuda'); (flags * 2).sum().item()")
    assert _replay_mix(moved) == set()


# ---------------------------------------------------------------------------- refusals
def test_impossible_device_choices_are_refused_before_any_group():
    from tpfuse.parallel.devices import check_device_choice

    with pytest.raises(ValueError, match="--device cpu cannot run on --distributed-backend nccl"):
        check_device_choice("cpu", "nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda needs CUDA"):
            check_device_choice("cuda", "gloo")
    check_device_choice(None, "gloo")
    check_device_choice("cpu", "gloo")


def _cuda_on_plain_gloo():
    from tpfuse.parallel.devices import model_device

    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        model_device("cuda")
    except ValueError as error:
        return str(error)
    finally:
        torch.cuda.is_available = saved
    return None


def test_device_cuda_on_a_plain_gloo_world_is_refused(run_distributed):
    for message in run_distributed(2, _cuda_on_plain_gloo):
        assert message and "host-staged gloo backend" in message


def test_world_backend_is_unchanged_unless_the_model_leaves_the_cpu():
    from tpfuse.parallel.host_staging import HOST_STAGED, backend_family, world_backend

    assert world_backend("gloo", torch.device("cpu")) == "gloo"
    assert world_backend("nccl", torch.device("cuda", 0)) == "nccl"
    assert world_backend("gloo", torch.device("cuda", 0)) == HOST_STAGED
    assert backend_family(HOST_STAGED) == "gloo" and backend_family("nccl") == "nccl"
