"""sp_lab: a workbench for Sequence Parallelism + AsyncTP under piecewise torch.compile.

Public entry points (imported lazily so that ``import sp_lab`` stays cheap and a notebook
that only plots recorded data never pays for Inductor's start-up):

- :class:`LabConfig`, :class:`ConfigError` (``sp_lab.config``)
- :func:`enable_sp_and_async_tp`, :class:`EffectiveConfig` (``sp_lab.effective``)
- :class:`BoundaryStrategy` (``LabConfig.boundary``'s values, ``sp_lab.config``)
- :func:`compile`, :class:`CompiledModel`, :class:`BoundaryError` (``sp_lab.compiler.backend``)
- :class:`SharedCaptures`: one Dynamo capture for the compiles of a model's variants (``sp_lab.compiler.capture``)
- :class:`CompileReport` (``sp_lab.compiler.report``; reading one needs no torch)
- :func:`launch` (``sp_lab.distributed.launch``)
- :func:`tune` (``sp_lab.widgets.tuner``)
- :mod:`sp_lab.models` with :func:`sp_lab.models.build`
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from sp_lab import models
    from sp_lab.compiler.backend import BoundaryError, CompiledModel, compile
    from sp_lab.compiler.capture import SharedCaptures
    from sp_lab.compiler.report import CompileReport
    from sp_lab.config import BoundaryStrategy, ConfigError, LabConfig
    from sp_lab.distributed.launch import launch
    from sp_lab.effective import EffectiveConfig, enable_sp_and_async_tp
    from sp_lab.widgets.tuner import tune

__version__ = "0.1.0"

_EXPORTS = {
    "LabConfig": "sp_lab.config",
    "BoundaryStrategy": "sp_lab.config",
    "EffectiveConfig": "sp_lab.effective",
    "ConfigError": "sp_lab.config",
    "enable_sp_and_async_tp": "sp_lab.effective",
    "compile": "sp_lab.compiler.backend",
    "CompiledModel": "sp_lab.compiler.backend",
    "BoundaryError": "sp_lab.compiler.backend",
    "SharedCaptures": "sp_lab.compiler.capture",
    "CompileReport": "sp_lab.compiler.report",
    "launch": "sp_lab.distributed.launch",
    "tune": "sp_lab.widgets.tuner",
}

__all__ = [
    "BoundaryError",
    "BoundaryStrategy",
    "CompileReport",
    "CompiledModel",
    "ConfigError",
    "EffectiveConfig",
    "LabConfig",
    "SharedCaptures",
    "compile",
    "enable_sp_and_async_tp",
    "launch",
    "models",
    "tune",
]
assert sorted([*_EXPORTS, "models"]) == sorted(__all__)


def __getattr__(name: str) -> Any:
    if name == "models":
        return import_module("sp_lab.models")
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sp_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, lazy ones included (tab completion in a notebook lists what ``sp_lab.`` offers)."""
    return sorted([*__all__, "__version__"])
