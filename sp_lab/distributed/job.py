"""What :func:`sp_lab.launch` sends to every rank, and how it travels: the function, its arguments, and the
custom ops the caller defined itself.

Ranks are fresh interpreters. cloudpickle sends functions and classes defined in a notebook by value, but two
things it cannot send on its own:

- ``torch.ops`` and everything under it (``torch.ops.aten``, ``torch.ops.aten.mm.default``, a
  user's ``torch.ops.mylib.attn``): ``torch.ops`` is a module subclass that cloudpickle tries to pickle by value
  ("cannot pickle '_Ops' object"), and op packets and overloads are not picklable at all. They travel *by name*
  here and are looked up again in the rank.
- a custom op defined in the notebook (``@torch.library.custom_op("mylib::attn", ...)`` in a cell): the rank
  never runs that cell, so the op would not exist there. Ops defined with ``torch.library.custom_op`` are
  re-created in every rank from their definition (schema, kernels, fake, autograd; the Python functions by
  value) before the function is loaded. Ops defined in the notebook with the low-level
  ``torch.library.Library`` API cannot be re-created that way; a job that refers to one is refused in the
  caller, before any rank starts, with the op's name and the fix.

The job is two pickles in one file: first the op definitions, then the :class:`Job`, so that loading the job
(which may hold ``torch.ops.mylib.attn.default``) finds the ops already there.
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import types
from collections.abc import Callable
from typing import Any, BinaryIO

import cloudpickle
import torch

__all__ = ["CustomOpDefinition", "Job", "check_before_launch", "recreate_custom_ops", "serialise_job"]


@dataclasses.dataclass(frozen=True)
class Job:
    """What every rank receives: the function, its arguments and how to join the group."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    backend: str
    timeout_s: float
    store_port: int


# -- torch.ops by name ---------------------------------------------------------------------------------------


def _namespace(name: str) -> Any:
    return getattr(torch.ops, name)


def _packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _torch_ops() -> Any:
    return torch.ops


def _reduce_ops(_: Any) -> tuple:
    return _torch_ops, ()


def _reduce_namespace(ns: Any) -> tuple:
    return _namespace, (ns.name,)


def _reduce_packet(packet: torch._ops.OpOverloadPacket) -> tuple:
    namespace, name = packet._qualified_op_name.split("::")
    return _packet, (namespace, name)


def _reduce_overload(op: torch._ops.OpOverload) -> tuple:
    namespace, name = op._schema.name.split("::")
    return _overload, (namespace, name, op._overloadname)


def _reduce_higher_order(op: torch._ops.HigherOrderOperator) -> tuple:
    return _packet, ("higher_order", op.__name__)


# The higher-order namespace's class is named differently across torch 2.11-2.14.
_NAMESPACE_TYPES = [getattr(torch._ops, n, None) for n in ("_HigherOrderNamespace", "_PyOpNamespace")]
# Checked in order with isinstance: subclasses (a higher-order op's own class) travel by name too.
_BY_NAME: tuple[tuple[type, Callable[[Any], tuple]], ...] = (
    (torch._ops._Ops, _reduce_ops),
    (torch._ops._OpNamespace, _reduce_namespace),
    *((t, _reduce_namespace) for t in _NAMESPACE_TYPES if isinstance(t, type)),
    (torch._ops.OpOverloadPacket, _reduce_packet),
    (torch._ops.OpOverload, _reduce_overload),
    (torch._ops.HigherOrderOperator, _reduce_higher_order),
)


class _JobPickler(cloudpickle.Pickler):
    """cloudpickle, with ``torch.ops`` objects by name, remembering the names the by-value code mentions."""

    def __init__(self, file: BinaryIO):
        super().__init__(file)
        self.code_names: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        for kind, reduce in _BY_NAME:
            if isinstance(obj, kind):
                return reduce(obj)
        if isinstance(obj, types.FunctionType) and _by_value(obj):
            self.code_names |= _names_in(obj.__code__)
        return super().reducer_override(obj)


def _by_value(fn: types.FunctionType) -> bool:
    module = sys.modules.get(fn.__module__ or "")
    return module is None or fn.__module__ == "__main__" or getattr(module, "__file__", None) is None


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _dumps(obj: Any) -> tuple[bytes, set[str]]:
    buffer = io.BytesIO()
    pickler = _JobPickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.code_names


# -- custom ops defined by the caller ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CustomOpDefinition:
    """Everything ``torch.library.custom_op`` needs to define the same op again in a rank."""

    qualname: str
    schema: str  # "(Tensor q) -> Tensor", as custom_op takes it
    mutates_args: tuple[str, ...]
    tags: tuple[str, ...]
    init_fn: Callable[..., Any]
    init_devices: tuple[str | None, ...]  # the device types init_fn serves (None: every device)
    kernels: tuple[tuple[str | None, Callable[..., Any]], ...]  # further register_kernel calls
    fake: Callable[..., Any] | None
    autograd: tuple[Callable[..., Any], Callable[..., Any] | None] | None  # (backward, setup_context)

    def create(self) -> None:
        """Define the op in this process (a no-op where it exists already, e.g. imported from a module)."""
        from torch._library.custom_ops import OPDEFS

        if self.qualname in OPDEFS:
            return
        tags = tuple(getattr(torch.Tag, t) for t in self.tags)
        devices = None if None in self.init_devices else list(self.init_devices)
        op = torch.library.custom_op(self.qualname, self.init_fn, mutates_args=self.mutates_args,
                                     device_types=devices, schema=self.schema, tags=tags)
        for device, kernel in self.kernels:
            op.register_kernel(device, kernel)
        if self.fake is not None:
            op.register_fake(self.fake)
        if self.autograd is not None:
            op.register_autograd(self.autograd[0], setup_context=self.autograd[1])


def _inner(wrapped: Callable[..., Any]) -> Callable[..., Any] | None:
    """The function given to ``register_kernel`` inside the wrapper custom ops keep (None if not found)."""
    fn = getattr(wrapped, "__wrapped__", wrapped)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())) if hasattr(fn, "__code__") else {}
    return cells["fn"].cell_contents if "fn" in cells else None


def _definition(opdef: Any) -> CustomOpDefinition:
    schema = opdef._opoverload._schema
    mutated = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    init_devices, kernels = [], []
    for device, wrapped in opdef._backend_fns.items():
        fn = _inner(wrapped)
        if fn is None or fn is opdef._init_fn:
            init_devices.append(device)
        else:
            kernels.append((device, fn))
    autograd = (opdef._backward_fn, opdef._setup_context_fn) if opdef._backward_fn is not None else None
    return CustomOpDefinition(
        qualname=opdef._qualname, schema=opdef._schema, mutates_args=mutated,
        tags=tuple(t.name for t in opdef._tags), init_fn=opdef._init_fn,
        init_devices=tuple(init_devices) or (None,),
        kernels=tuple(kernels), fake=opdef._abstract_fn, autograd=autograd,
    )


def _defined_by_caller(fn: Callable[..., Any]) -> bool:
    return isinstance(fn, types.FunctionType) and _by_value(fn)


def _caller_custom_ops() -> list[CustomOpDefinition]:
    """The ``torch.library.custom_op`` ops implemented in the caller's ``__main__`` (a notebook)."""
    from torch._library.custom_ops import OPDEFS

    return [_definition(opdef) for opdef in list(OPDEFS.values()) if _defined_by_caller(opdef._init_fn)]


_REGISTERED_AT = re.compile(r"debug: registered at (.*):\d+")
_QUALNAME = re.compile(r"^\w+::\w+$")


def _low_level_caller_ops(names: set[str]) -> dict[str, str]:
    """Ops the job's code mentions (``names``) that were defined with ``torch.library.Library`` in the
    caller's ``__main__``: qualname -> where."""
    from torch._library.custom_ops import OPDEFS

    main = sys.modules.get("__main__")  # also registered as "__mp_main__" once multiprocessing is imported
    module_files = {getattr(m, "__file__", None) for m in list(sys.modules.values()) if m is not main}
    found = {}
    for qualname in sorted(torch.library._defs - set(OPDEFS)):
        if not _QUALNAME.match(qualname) or not _referenced(qualname, names):
            continue
        where = _REGISTERED_AT.search(torch._C._dispatch_dump(qualname))
        if where and where.group(1) not in module_files:
            found[qualname] = where.group(1)
    return found


def _referenced(qualname: str, names: set[str]) -> bool:
    namespace, name = qualname.split("::")
    return qualname in names or (namespace in names and name in names)


def recreate_custom_ops(definitions: list[CustomOpDefinition]) -> None:
    """In a rank: define the caller's custom ops before the job that uses them is loaded."""
    for definition in definitions:
        definition.create()


# -- checks in the caller and serialisation ---------------------------------------------------------------


def check_before_launch(args: tuple, kwargs: dict, world_size: int) -> None:
    """Refuse in the caller what every rank would refuse: a LabConfig whose tp_size is not the world size."""
    from sp_lab.config import LabConfig

    values = [*args, *kwargs.values()]
    for value in list(values):
        if isinstance(value, (list, tuple)):
            values.extend(value)
        elif isinstance(value, dict):
            values.extend(value.values())
    for value in values:
        if isinstance(value, LabConfig) and value.tp_size != world_size:
            raise ValueError(
                f"a LabConfig passed to launch() has tp_size={value.tp_size} but world_size={world_size}: "
                f"tensor parallelism spans every rank. Launch with world_size={value.tp_size}, or use "
                f"LabConfig(tp_size={world_size})."
            )


def serialise_job(job: Job) -> bytes:
    """The bytes of the job file: the caller's custom-op definitions, then the job (two pickles)."""
    try:
        job_bytes, names = _dumps(job)
    except Exception as error:
        raise TypeError(
            f"launch() could not serialise {job.fn!r} and its arguments with cloudpickle ({error}). "
            "Arguments must be picklable: pass data (tensors, numbers, configs), not open files, locks "
            "or process groups, and create such things inside the function."
        ) from error
    for qualname, where in _low_level_caller_ops(names).items():
        raise TypeError(
            f"the launched function uses the custom op {qualname!r}, defined with torch.library.Library "
            f"in {where}, which the ranks never run, so the op would not exist there. Define it with "
            f"@torch.library.custom_op({qualname!r}, mutates_args=...) (sp_lab.launch re-creates those in "
            "every rank), or move its definition into a module file that the function imports."
        )
    definitions = _caller_custom_ops()
    for definition in definitions:
        try:
            _dumps(definition)
        except Exception as error:
            raise TypeError(
                f"the custom op {definition.qualname!r}, defined in the notebook, cannot be sent to the "
                f"ranks: its functions are not picklable ({error}). Make its kernel, fake and autograd functions "
                "plain functions, or move the op into a module file that the launched function imports."
            ) from error
    return _dumps(definitions)[0] + job_bytes
