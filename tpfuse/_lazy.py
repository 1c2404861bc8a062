"""Lazy package exports (PEP 562), shared by every tpfuse subpackage's ``__init__``.

``__getattr__, __dir__, __all__ = lazy_exports(__name__, {"name": "module", ...}, globals())``
imports ``package.module`` only when ``package.name`` is first used, so importing a package stays
cheap (``tpfuse.parallel`` does not pull in torch.distributed).

One exception: a name defined in a submodule of the same name (``kernels/matmul.py`` defines
``matmul``) would be shadowed by the module object as soon as anyone imports that submodule (the
import system sets the package attribute), so such names are bound eagerly.
"""
import importlib
import importlib.util


def lazy_exports(package: str, exports: dict, namespace: dict):
    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{module}", package), name)

    names = sorted(exports)

    def __dir__():
        return names

    for name, module in exports.items():
        if name == module and importlib.util.find_spec(f"{package}.{module}") is not None:
            namespace[name] = getattr(importlib.import_module(f".{module}", package), name)
    return __getattr__, __dir__, names
