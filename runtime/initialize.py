"""Start-up of a tpfuse process (the trainer's ranks, ``tpfuse-generate``'s): torch.distributed from
torchrun's environment, and the check that the layout can split the world.

``initialize_distributed`` joins the world (a single-process one without torchrun's variables);
``check_layout(config)`` refuses, on every rank and before any group is built, sizes that cannot
split the world. The parallel state itself is built afterwards by the caller
(``parallel_state.initialize_model_parallel``)."""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch
import torch.distributed as dist

from tpfuse.parallel.devices import check_device_choice, cuda_index_for
from tpfuse.parallel.host_staging import world_backend
from tpfuse.pipeline.p2p import recv_ahead_for


def initialize_distributed(backend: str | None, timeout_minutes: float,
                           device: str | None = None) -> None:
    """Join the world described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.

    ``device`` (``--device``: None, "cpu" or "cuda") is where the model will live; "cuda" on gloo
    sets each rank's CUDA device (``cuda_index_for``: ranks may share one) and joins the world
    with the host-staged gloo backend (``tpfuse.parallel.host_staging``).

    A no-op when torch.distributed is already initialised (tests run pretrain inside a worker
    pool). Without those variables a single-process world is created, so ``python -m
    tpfuse.pretrain_gpt`` works on its own. A loopback MASTER_ADDR gets a rendezvous listening
    on loopback only (``rendezvous_store``).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--distributed-backend nccl needs CUDA, which is not available here")
    check_device_choice(device, backend)
    if "RANK" not in os.environ:
        from tpfuse.parallel.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif device == "cuda":
        torch.cuda.set_device(cuda_index_for(int(os.environ.get("LOCAL_RANK", "0"))))
    backend = world_backend(backend, torch.device(device or "cpu"))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = rendezvous_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def is_loopback(address: str) -> bool:
    try:
        resolved = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in resolved)


def rendezvous_store(timeout: datetime.timedelta):
    """The rendezvous TCPStore bound to ``MASTER_ADDR`` itself when that is a loopback address
    (torch's own listens on every interface), so a local job is not reachable from the network.
    None (torch's ``env://`` rendezvous) for other addresses and under torchrun's agent store."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not is_loopback(address):
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) != 0:
        return dist.TCPStore(address, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(max(128, world_size))
    # the store serves on this socket from now on; detach() hands it the descriptor for good
    return dist.TCPStore(address, port, world_size, True, timeout=timeout,
                         master_listen_fd=listener.detach())


def check_layout(config) -> None:
    """Sizes that cannot split the world fail here, on every rank, before any group is built."""
    world = dist.get_world_size()
    tp = config.tensor_model_parallel_size
    pp = config.pipeline_model_parallel_size
    cp = config.context_parallel_size
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size ({tp}) × "
            f"pipeline_model_parallel_size ({pp}) × context_parallel_size ({cp})")
    ep = config.expert_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    if world % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by expert_tensor_parallel_size ({etp}) × "
            f"expert_model_parallel_size ({ep}) × pipeline_model_parallel_size ({pp})")
    if pp > 1:   # the pipeline group gets the world's backend: receiving ahead needs gloo
        recv_ahead_for(config.p2p_recv_ahead, dist.get_backend())


def shutdown_distributed(finished: bool) -> None:
    """End this rank's torch.distributed world before the interpreter exits.

    Left to interpreter exit, a gloo process group is torn down by static destructors in no set
    order, while a peer may still be inside its last send or collective: a worker thread still
    joinable when its ``std::thread`` is destroyed aborts the process (``terminate called
    without an active exception``, SIGABRT) after a run that had finished. So a finished run
    meets every rank at a barrier (no peer has a pending operation any more), destroys the
    model-parallel groups, then the world. After an error no barrier is held (a failed peer would
    never reach it); the groups are destroyed as they stand and the launcher ends the job."""
    if not dist.is_initialized():
        return
    from tpfuse.parallel import parallel_state

    if finished:
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
