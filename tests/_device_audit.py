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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
