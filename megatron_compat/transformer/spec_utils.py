"""megatron-core 0.16's ``transformer.spec_utils``: ``ModuleSpec``, ``import_module``,
``get_module``, ``build_module``.

A spec names a module (a class, a function, or a ``(module path, name)`` pair), the keyword
``params`` it is built with and its ``submodules`` (a dataclass of further specs).
``build_module(spec, *args, **kwargs)`` calls the module with ``*args``, ``params`` and
``**kwargs``, passing ``submodules=`` when the spec has them; a function (e.g.
``get_bias_dropout_add``) is returned as it is, as Megatron does.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    module: Union[Tuple, type]
    params: dict = field(default_factory=lambda: {})
    submodules: type = None


def import_module(module_path: Tuple[str]):
    """``getattr(import(module_path[0]), module_path[1])``."""
    base_path, name = module_path
    return getattr(importlib.import_module(base_path), name)


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (a class/function passes through)."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module, *args, **kwargs):
    """Build what ``spec_or_module`` names (see the module docstring)."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and isinstance(spec_or_module.module,
                                                             types.FunctionType):
        return spec_or_module.module
    if isinstance(spec_or_module, type):
        module, params, submodules = spec_or_module, {}, None
    else:
        module = spec_or_module.module
        if isinstance(module, tuple):
            module = import_module(module)
        params, submodules = spec_or_module.params, spec_or_module.submodules
    if submodules is not None:
        kwargs = {**kwargs, "submodules": submodules}
    return module(*args, **params, **kwargs)
