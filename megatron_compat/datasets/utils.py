"""megatron-core 0.16's ``datasets.utils``: ``Split`` and ``compile_helpers``.

Megatron compiles a C++ extension (``helpers_cpp``) that builds its sample and blend indices;
tpfuse builds them in numpy (``tpfuse.data.indices``), so ``compile_helpers()`` has nothing to
compile and returns None (rank 0 may call it before a barrier, as Megatron's scripts do).
"""
import enum


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


def compile_helpers() -> None:
    """A documented no-op: tpfuse needs no C++ dataset helper."""
    return None
