"""Optional dependencies: import one when the feature that needs it is used, or fail naming it.

``import_optional("wandb", extra="wandb", feature="--wandb-project")`` returns the module; when it
does not import, the ImportError reads::

    --wandb-project needs the optional package 'wandb' (pip install 'tpfuse[wandb]'): <why>

``extra`` is the ``extras_require`` entry of ``setup.py`` that installs the package; ``instead``
names a way to run without it (``", or <instead>"`` before the reason). The package named is the
top-level one of ``module``. This module imports nothing from tpfuse, so every package may use it.
"""
import importlib


def import_optional(module: str, *, extra: str, feature: str, instead: str | None = None):
    """``module`` imported, or an ImportError saying that ``feature`` needs its package and which
    pip extra installs it (the import's own error chained and quoted)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        alternative = f", or {instead}" if instead else ""
        raise ImportError(f"{feature} needs the optional package {module.split('.')[0]!r} "
                          f"(pip install 'tpfuse[{extra}]'){alternative}: {error}") from error
