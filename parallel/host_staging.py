"""gloo process groups whose collectives also take CUDA tensors: each one staged through host memory.

Two ranks cannot share one GPU under NCCL, and gloo's own CUDA support is partial: its
ProcessGroupGloo copies CUDA tensors to pinned host buffers itself for all_reduce, broadcast,
all_gather (and the tensor form built on it), gather, scatter and all_to_all, but send / recv hand
the tensor's raw pointer to its transport, which reads host memory only, so a pipeline's
activations cannot travel that way. Rather than a per-op mix of gloo's CUDA paths and our own,
a world joined with the backend ``HOST_STAGED`` is a gloo world in which every collective and
point-to-point message of a tensor that is not on the CPU takes one path, for every op alike::

    host = tensor.to("cpu")           # a copy in host memory (a CUDA tensor: stream-ordered)
    gloo op on host                   # the same op, same options, on an inner ProcessGroupGloo
    work.wait(): tensor.copy_(host)   # outputs copied back when the op is waited on

So the model and its activations can live on ``cuda:0`` for every rank while the process groups
are gloo (``--device cuda --distributed-backend gloo``: correctness on CUDA, not speed). CPU
tensors go to gloo unchanged. ``HOST_STAGED_EVERY`` stages CPU tensors too (to a second host
tensor): the same path, testable on a CPU-only machine. The staging lives here and nowhere else:
every ``torch.distributed`` call the project makes on such a group — tensor-parallel mappings,
pipeline p2p, gradient buckets, the fused comm GEMMs' exchanges, timers and exit flags — reaches
``HostStagedGroup``, since ``new_group`` gives every sub-group the world's backend.

The group is a ``torch.distributed.ProcessGroup`` written in Python (torch's registered-backend
route, ``Backend.register_backend``); its methods carry both the names torch 2.13 calls
(``all_gather_single`` ...) and the older ones (``_allgather_base`` ...).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

HOST_STAGED = "gloo_host_staged"             # stages tensors that are not on the CPU
HOST_STAGED_EVERY = "gloo_host_staged_cpu"   # stages every tensor (the path's CPU test)
_STAGES_CPU = {HOST_STAGED: False, HOST_STAGED_EVERY: True}


def is_host_staged(backend: str) -> bool:
    """``backend`` (a ``dist.get_backend`` name) is one of this module's gloo groups."""
    return str(backend) in _STAGES_CPU


def backend_family(backend: str) -> str:
    """The library under ``backend``: "gloo" for the host-staged groups, else ``backend``."""
    return "gloo" if is_host_staged(backend) else str(backend)


def register_host_staged_backends() -> None:
    """Make both names known to ``init_process_group`` / ``new_group`` (idempotent)."""
    for name, stages_cpu in _STAGES_CPU.items():
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _creator(stages_cpu), devices=["cpu", "cuda"])


def world_backend(backend: str, device: torch.device) -> str:
    """The backend to join the world with: ``HOST_STAGED`` for gloo with the model on a GPU,
    else ``backend`` itself."""
    if backend == "gloo" and device.type != "cpu":
        register_host_staged_backends()
        return HOST_STAGED
    return backend


def _creator(stages_cpu: bool):
    def create(store, rank: int, size: int, timeout: datetime.timedelta):
        return HostStagedGroup(store, rank, size, timeout, stages_cpu)
    return create


class StagedWork(dist.Work):
    """The inner gloo work; ``wait()`` waits for it, then copies each host output back into the
    caller's tensor (``copies``: (caller tensor, host tensor) pairs). ``keep`` holds the host
    inputs alive until the op is done."""

    def __init__(self, inner, copies=(), keep=()):
        super().__init__()
        self.inner, self.copies, self.keep, self.done = inner, list(copies), list(keep), False

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if not self.done:
            self.inner.wait()
            with torch.no_grad():               # a Parameter (a leaf that requires grad) too
                for tensor, host in self.copies:
                    tensor.copy_(host)
            self.done = True
            self.copies, self.keep = [], []
        return True

    def is_completed(self) -> bool:
        """True once waited on, or when gloo finished and nothing is left to copy back."""
        return self.done or (not self.copies and self.inner.is_completed())

    def is_success(self) -> bool:
        return self.is_completed()


class HostStagedGroup(dist.ProcessGroup):
    """A gloo group (``inner``) behind the staging described in the module docstring;
    ``staged``: how many tensors went through host copies (the tests read it)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 stages_cpu: bool = False):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.stages_cpu, self.staged, self.names = stages_cpu, 0, {}

    def getBackendName(self) -> str:
        return HOST_STAGED_EVERY if self.stages_cpu else HOST_STAGED

    # torch keeps a group's name and description on its backends; this group has none of its
    # own (``destroy_process_group`` reads the name)
    def getGroupName(self) -> str:
        return self.names.get("name", "")

    def setGroupName(self, name: str) -> None:
        self.names["name"] = name

    def getGroupDesc(self) -> str:
        return self.names.get("desc", "")

    def setGroupDesc(self, desc: str) -> None:
        self.names["desc"] = desc

    # ------------------------------------------------------------------ staging
    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself on the CPU (unless CPU tensors are staged too), else a host copy."""
        if tensor.device.type == "cpu" and not self.stages_cpu:
            return tensor
        self.staged += 1
        return tensor.detach().to("cpu", copy=True)

    def _hosts(self, tensors) -> list:
        return [self._host(t) for t in tensors]

    @staticmethod
    def _back(tensors, hosts) -> list:
        """(caller, host) pairs for the outputs that were staged."""
        return [(t, h) for t, h in zip(tensors, hosts) if h is not t]

    def _in_place(self, method, tensors, *args) -> StagedWork:
        """An op whose tensors are both its input and its output (all_reduce, broadcast, recv)."""
        hosts = self._hosts(tensors)
        return StagedWork(method(hosts, *args), self._back(tensors, hosts))

    def _into(self, method, output, input, *args) -> StagedWork:
        """An op from ``input`` into one ``output`` tensor."""
        host_out, host_in = self._host(output), self._host(input)
        return StagedWork(method(host_out, host_in, *args), self._back([output], [host_out]),
                          keep=[host_in])

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors, opts=None):
        return self._in_place(self.inner.allreduce, tensors, opts or dist.AllreduceOptions())

    def broadcast(self, tensors, opts=None):
        return self._in_place(self.inner.broadcast, tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_lists, inputs, opts=None):
        host_lists = [self._hosts(outputs) for outputs in output_lists]
        host_inputs = self._hosts(inputs)
        copies = [pair for outputs, hosts in zip(output_lists, host_lists)
                  for pair in self._back(outputs, hosts)]
        return StagedWork(self.inner.allgather(host_lists, host_inputs,
                                               opts or _allgather_options()),
                          copies, keep=host_inputs)

    def all_gather_single(self, output, input, opts=None):
        return self._into(self.inner._allgather_base, output, input,
                          opts or _allgather_options())

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        host_outputs = self._hosts(outputs)
        host_lists = [self._hosts(inputs) for inputs in input_lists]
        return StagedWork(self.inner.reduce_scatter(host_outputs, host_lists,
                                                    opts or dist.ReduceScatterOptions()),
                          self._back(outputs, host_outputs), keep=host_lists)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._into(self.inner._reduce_scatter_base, output, input,
                          opts or dist.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self._into(self.inner.alltoall_base, output, input, output_split_sizes,
                          input_split_sizes, opts or dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        host_outputs, host_inputs = self._hosts(outputs), self._hosts(inputs)
        return StagedWork(self.inner.alltoall(host_outputs, host_inputs,
                                              opts or dist.AllToAllOptions()),
                          self._back(outputs, host_outputs), keep=host_inputs)

    def barrier(self, opts=None):
        return StagedWork(self.inner.barrier(opts or dist.BarrierOptions()))

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dst_rank: int, tag: int):
        hosts = self._hosts(tensors)
        return StagedWork(self.inner.send(hosts, dst_rank, tag), keep=hosts)

    def recv(self, tensors, src_rank: int, tag: int):
        return self._in_place(self.inner.recv, tensors, src_rank, tag)


def _allgather_options():
    return dist.distributed_c10d.AllgatherOptions()
