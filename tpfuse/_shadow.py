"""Hands a top-level name that the checkout's root shadows over to the installed distribution.

The repository's root holds the folders that install as ``tpfuse.kernels``, ``tpfuse.data``, ...
Python started in the root (``python``, ``python -m``, Jupyter, ``python -m pytest``) puts the
root first on ``sys.path``, so ``import kernels`` there would find ``kernels/`` instead of the
``kernels`` distribution that transformers imports. A shadowed folder's ``__init__`` calls
``hand_over`` when it is being imported under its bare name: the distribution of that name is
looked up on ``sys.path`` without the root, executed, and left in ``sys.modules`` in place of the
folder, so the importer gets the distribution; without one the import fails with a message that
names ``tpfuse.<name>``.
"""
import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (the root folder ``name``/ being imported, whose
    ``__init__.py`` is ``init_file``) by the installed module ``name`` found outside the root.
    ImportError naming ``tpfuse.<name>`` when none is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ImportError(
            f"{name!r} resolved to tpfuse's folder {os.path.join(root, name)} because the "
            f"repository root is on sys.path, and no installed {name!r} distribution exists: "
            f"tpfuse's module is imported as tpfuse.{name}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
