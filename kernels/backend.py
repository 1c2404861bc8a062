"""Which implementation an op runs: compiled Triton, Triton's interpreter, or plain torch.

``backend`` is ``"auto" | "triton" | "torch"``, chosen per call (``backend=`` keyword of every op) or
globally (``set_backend`` / ``use_backend``):

- ``auto``   compiled Triton for CUDA tensors, the torch path for CPU tensors (fast everywhere);
- ``triton`` the Triton kernel; on CPU tensors it runs through Triton's interpreter, which is how
  the kernels are tested on machines without a GPU;
- ``torch``  the plain-torch reference path.

The interpreter and the compiler coexist in one process: ``launch`` runs a kernel compiled when its
tensors live on a GPU and interpreted (``triton.runtime.interpreter.InterpretedFunction``) when they
live on the CPU, so no environment variable has to be set before importing triton.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

BACKENDS = ("auto", "triton", "torch")
_state = threading.local()
_global_backend = "auto"


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Set the process-wide default backend."""
    global _global_backend
    _global_backend = _check(name)


def get_backend() -> str:
    """The backend in force: an enclosing ``use_backend`` block, else the process-wide default."""
    return getattr(_state, "override", None) or _global_backend


@contextlib.contextmanager
def use_backend(name: str):
    """Run the enclosed ops with ``name`` as the default backend (this thread only)."""
    previous = getattr(_state, "override", None)
    _state.override = _check(name)
    try:
        yield
    finally:
        _state.override = previous


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (asked on every op's backend resolution: answered once)."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton is a dependency; kept for broken installs
        return False
    return True


def resolve(backend: str | None, *tensors: torch.Tensor) -> str:
    """Decide ``"triton"`` or ``"torch"`` for one call on ``tensors``."""
    name = _check(backend) if backend is not None else get_backend()
    if name == "auto":
        on_gpu = bool(tensors) and all(t.is_cuda for t in tensors if t is not None)
        return "triton" if on_gpu and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise RuntimeError("backend='triton' was asked for but triton is not importable")
    return name


# ----------------------------------------------------------------------------- launching kernels

_interpreted_cache: dict = {}
_patch_lock = threading.Lock()


def _python_function(kernel):
    """The plain Python function under a @triton.jit / @triton.autotune / @triton.heuristics kernel."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    raw = _python_function(kernel)
    if raw not in _interpreted_cache:
        _interpreted_cache[raw] = InterpretedFunction(raw)
    return _interpreted_cache[raw]


def _call_helper_interpreted(helper, *args, **kwargs):
    """Call a nested @triton.jit helper (ours, or triton's own: tl.cdiv, tl.sigmoid, tl.rand, ...)
    inside an interpreted kernel. ``InterpretedFunction.__call__`` patches triton.language for the
    helper and never restores it, which breaks every later GPU compile in the process; so the
    patch is scoped to the call here."""
    from triton.runtime import interpreter

    interpreted = _interpreted(helper)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None:  # pragma: no cover - other triton versions: their own __call__
        return interpreted(*args, **kwargs)
    scope = patch_lang(interpreted.fn)
    try:
        return interpreted.rewrite()(*args, **kwargs)
    finally:
        scope.restore()


@contextlib.contextmanager
def _jit_helpers_interpreted():
    """Inside an interpreted kernel, calls to other @triton.jit helpers must be interpreted too."""
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        original = JITFunction.__call__
        JITFunction.__call__ = _call_helper_interpreted
        try:
            yield
        finally:
            JITFunction.__call__ = original


def launch(kernel, grid, *args, cpu_meta: dict | None = None, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``, compiled on GPU tensors, interpreted on CPU ones.

    ``cpu_meta`` holds the meta-parameters (block sizes, ...) used under the interpreter in place of
    an autotuner's choice; they must be small, since the interpreter runs every program in numpy.
    ``grid`` is a tuple or a callable of the meta-parameter dict, as in Triton.
    """
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    on_cpu = any(not t.is_cuda for t in tensors)
    if not on_cpu:
        return kernel[grid](*args, **kwargs)
    meta = dict(kwargs)
    meta.update(cpu_meta or {})
    for launch_only in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        meta.pop(launch_only, None)
    resolved_grid = grid(meta) if callable(grid) else grid
    with _jit_helpers_interpreted():
        return _interpreted(kernel)[resolved_grid](*args, **meta)
