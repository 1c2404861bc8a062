"""tpfuse.runtime: process start-up, shared by the trainer and ``tpfuse-generate``.

- ``initialize.py``: ``initialize_distributed`` (torch.distributed from torchrun's environment,
  a loopback-only rendezvous for local jobs) and ``check_layout`` (sizes that cannot split the
  world fail on every rank before any group is built);
- ``launcher.py``: ``run_local`` — N local ranks of a given program with torchrun's environment,
  signal forwarding, one traceback per job, ranks that die with their launcher — and
  ``report_failure``, the ranks' side of it.

Where it sits: above ``parallel`` and ``pipeline`` (``check_layout`` asks the pipeline whether its
p2p settings fit the backend), beside ``checkpoint``, below ``training``, ``inference`` and
``convert``; so inference starts its ranks without importing the trainer. The ``tpfuse-train``
command itself (its flags, the presets, ``python -m tpfuse.pretrain_gpt`` as the program) stays
the trainer's: ``training/launcher.py``.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "initialize_distributed": "initialize", "check_layout": "initialize",
    "run_local": "launcher", "report_failure": "launcher",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
