"""Finds the project's tensors that land on the *default* device.

On a GPU the model, its activations and every NCCL buffer live on ``cuda:k``, while a factory call
without ``device=`` (``torch.tensor(x)``, ``torch.zeros(n)``, ``torch.arange(s)``) makes a CPU
tensor; mixed into an operation with CUDA tensors, or handed to an NCCL collective, it fails
("Expected all tensors to be on the same device", "No backend type associated with device type
cpu"). On a CPU-only machine both devices are the same and such a call goes unnoticed.

``DefaultDeviceRecorder`` (a ``TorchFunctionMode``) sees every factory call made while it is
active, and records the ones whose *immediate caller* is a file of the project (not tests, not
benchmarks, not torch itself) that name no device (a missing ``device=``, or ``device=None``).
Such a call is correct only by accident of the test machine. The rule it enforces: on the paths a
training step, evaluation, checkpoint save/load and generation take, every tensor is created on
the device of its inputs or state (``x.new_*``, ``*_like``, ``device=x.device``), or names
``device="cpu"`` where host memory is meant. Model construction is exempt: the trainer builds the
model on the CPU and moves it (``chunk.to(device)``), which a ``with torch.device("cpu")`` around
the provider states (modes nest, the innermost fills in the device first).
"""
from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_EXEMPT = tuple(os.path.join(REPO, folder) + os.sep for folder in ("tests", "benchmarks"))
_CONVERTERS = {torch.as_tensor, torch.asarray}     # keep a tensor argument's own device


def _is_project_file(filename: str) -> bool:
    return filename.startswith(REPO + os.sep) and not filename.startswith(_EXEMPT) \
        and os.sep + ".venv" + os.sep not in filename


class DefaultDeviceRecorder(TorchFunctionMode):
    """``found``: ``{"file.py:line: torch.name(...)"}`` of the default-device factory calls."""

    def __init__(self):
        super().__init__()
        self.found: set[str] = set()
        self._factories = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._factories and kwargs.get("device") is None and \
                not (func in _CONVERTERS and args and isinstance(args[0], torch.Tensor)):
            caller = sys._getframe(1)
            if _is_project_file(caller.f_code.co_filename):
                where = os.path.relpath(caller.f_code.co_filename, REPO)
                self.found.add(f"{where}:{caller.f_lineno}: torch.{func.__name__}(...) without "
                               "a device")
        return func(*args, **kwargs)


def built_on_cpu(model_provider):
    """``model_provider`` building its modules under ``torch.device("cpu")``: construction on the
    host is the design (the trainer moves the chunks to the device)."""
    def provider(*args, **kwargs):
        with torch.device("cpu"):
            return model_provider(*args, **kwargs)
    return provider


# ---------------------------------------------------------------------------- pretend NCCL
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single", "send",
               "recv", "isend", "irecv")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _mark(value) -> None:
    for tensor in _tensors(value):
        tensor.on_pretend_cuda = True


def _names_cuda(value) -> bool:
    """``value`` is a device (or its name) of type CUDA."""
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "cuda"


class PretendNccl(TorchFunctionMode):
    """The world runs on gloo, but the project's code sees an NCCL backend
    (``dist.get_backend()`` → "nccl", current CUDA device 0).

    A tensor the code asks for on CUDA (a factory's ``device=``, ``.to(cuda)``, ``.cuda()``) is
    made on the CPU and marked as standing for a CUDA tensor; every tensor computed from a marked
    one is marked too (``*_like``, ``new_*``, ``stack``, in-place ops). The collectives in
    ``COLLECTIVES`` record, in ``found``, each unmarked tensor handed to them by a project file:
    under real NCCL that tensor would be on the CPU and the collective would fail.
    """

    def __init__(self):
        super().__init__()
        self.found: set[str] = set()
        self._factories = _device_constructors()
        self._saved = {}

    def __enter__(self):
        dist = torch.distributed
        self._saved = {name: getattr(dist, name) for name in COLLECTIVES}
        self._saved["get_backend"] = dist.get_backend
        self._saved["current_device"] = torch.cuda.current_device
        dist.get_backend = lambda group=None: "nccl"
        torch.cuda.current_device = lambda: 0
        for name in COLLECTIVES:
            setattr(dist, name, self._checked(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name in COLLECTIVES + ("get_backend",):
            setattr(torch.distributed, name, self._saved[name])
        torch.cuda.current_device = self._saved["current_device"]
        return super().__exit__(*exc)

    def _checked(self, name, collective):
        def checked(*args, **kwargs):
            caller = sys._getframe(1)
            if _is_project_file(caller.f_code.co_filename):
                where = os.path.relpath(caller.f_code.co_filename, REPO)
                for tensor in _tensors(list(args) + list(kwargs.values())):
                    if not getattr(tensor, "on_pretend_cuda", False):
                        self.found.add(f"{where}:{caller.f_lineno}: dist.{name} got a CPU "
                                       "tensor on an NCCL group")
            return collective(*args, **kwargs)
        return checked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        to_cuda = False
        if func in self._factories or func is torch.Tensor.to:
            to_cuda = any(_names_cuda(a) for a in list(args[1:]) + [kwargs.get("device")]) \
                if func is torch.Tensor.to else _names_cuda(kwargs.get("device"))
            if to_cuda:              # the same call, on the CPU
                args = tuple("cpu" if _names_cuda(a) else a for a in args)
                kwargs = {k: "cpu" if k == "device" else v for k, v in kwargs.items()}
                if func is torch.Tensor.to:
                    kwargs["copy"] = True       # a new tensor, not the (unmarked) source
        elif func is torch.Tensor.cuda:
            func, args, kwargs, to_cuda = torch.clone, args[:1], {}, True
        result = func(*args, **kwargs)
        if to_cuda or any(getattr(t, "on_pretend_cuda", False)
                          for t in _tensors(list(args) + list(kwargs.values()))):
            _mark(result)
        return result
