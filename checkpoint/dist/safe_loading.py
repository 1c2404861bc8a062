"""What the torch_dist reader may unpickle: ``torch.load(weights_only=True)`` builds tensors and
plain containers only, plus the types listed here, so a checkpoint runs no code of its own.

- ``common_safe_globals()``: common.pt's extra types — Megatron-LM's ``args`` (an
  ``argparse.Namespace`` of standard-library values, ``ARGS_TYPES``) and the megatron-core enums
  its flags parse into, each read as a ``MegatronEnumValue`` stand-in (its value, without
  megatron-core installed);
- ``object_safe_globals()``: a ShardedObject's (Megatron-LM's ``rng_state`` holds numpy's
  generator state, an ndarray): the above and numpy's array reconstruction.
"""
from __future__ import annotations

import argparse
import pathlib
import signal
import types

import numpy as np


class MegatronEnumValue:
    """Stands in for an enum member of megatron-core that Megatron-LM's ``args`` hold (its
    pickle calls the enum class with the member's value): the value, without megatron-core."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is type(self) and other.value == self.value

    def __hash__(self):
        return hash((type(self).__name__, self.value))

    def __repr__(self):
        return f"{type(self).__name__}({self.value!r})"


# the megatron-core enums Megatron-LM's arguments parse into (megatron/training/arguments.py;
# megatron.core.safe_globals lists the same for its own weights_only loads)
MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend",
                  "megatron.core.transformer.enums.CudaGraphScope",
                  "megatron.core.transformer.enums.AttnMaskType",
                  "megatron.core.transformer.enums.ModelType", "megatron.core.enums.ModelType",
                  "megatron.core.enums.Fp8Recipe",
                  "megatron.core.rerun_state_machine.RerunMode",
                  "megatron.core.rerun_state_machine.RerunDiagnostic",
                  "megatron.core.rerun_state_machine.RerunState",
                  "megatron.core.dist_checkpointing.validation.StrictHandling")
# the standard-library types in Megatron-LM's args (its --exit-signal is a signal.Signals)
ARGS_TYPES = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals)


def _stand_in(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[1], (MegatronEnumValue,),
                {"__module__": __name__, "qualified_name": qualified_name})


def common_safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` may build in a common.pt beyond tensors and plain
    containers: Megatron-LM's ``args`` (ARGS_TYPES) and a stand-in per enum above."""
    return list(ARGS_TYPES) + [(_stand_in(name), name) for name in MEGATRON_ENUMS]


def object_safe_globals() -> list:
    """``common_safe_globals()`` and what an ndarray's pickle calls (numpy's own reconstruction
    function, found from an array's ``__reduce__`` so it holds on numpy 1 and 2)."""
    reconstruct = np.zeros(0).__reduce__()[0]
    return common_safe_globals() + [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
