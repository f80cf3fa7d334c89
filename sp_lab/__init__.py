"""sp_lab: a workbench for Sequence Parallelism + AsyncTP under piecewise torch.compile.

Public entry points (imported lazily so that ``import sp_lab`` stays cheap and a notebook
that only plots recorded data never pays for Inductor's start-up):

- :class:`LabConfig`, :func:`enable_sp_and_async_tp` (``sp_lab.config``)
- :func:`compile` (``sp_lab.compiler.backend``)
- :func:`launch` (``sp_lab.distributed.launch``)
- :func:`tune` (``sp_lab.widgets.tuner``)
- :mod:`sp_lab.models` with :func:`sp_lab.models.build`
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LabConfig": "sp_lab.config",
    "EffectiveConfig": "sp_lab.config",
    "enable_sp_and_async_tp": "sp_lab.config",
    "compile": "sp_lab.compiler.backend",
    "CompiledModel": "sp_lab.compiler.backend",
    "launch": "sp_lab.distributed.launch",
    "tune": "sp_lab.widgets.tuner",
}

__all__ = sorted([*_EXPORTS, "models"])


def __getattr__(name: str):
    if name == "models":
        return import_module("sp_lab.models")
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sp_lab' has no attribute {name!r}")
