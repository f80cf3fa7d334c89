"""How one piece becomes callable: a small interface with three implementations, chosen once per range.

- :class:`InductorPieces`: Inductor from a Dynamo-level (torch IR) piece, ``compile_fx``;
- :class:`InductorPieces` with ``aten=True``: Inductor's inner compile for a piece that is already a
  functional aten graph (the ``sharded`` path splits the AOT graph; a second AOT trace would be wasted);
- :class:`PassesOnly`: trace to the aten graph Inductor would receive and run the passes on it, no code
  generation (inspect-only compiles of meta-device models).

Each returns a :class:`CompiledPiece`: the callable and the record our post-grad passes filled. Inductor's
FX-graph cache stays on; on a cache hit the passes do not run, so the record they made the first time is kept
beside the cache as JSON (the same :class:`PieceRecord`, written with the report's encoder) under the
pass manager's ``uuid()`` and the piece's structural fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.runtime.cache_dir_utils import cache_dir

from sp_lab.compiler.artifact_cache import cache_dir as artifact_cache_dir
from sp_lab.compiler.artifact_cache import write_atomic
from sp_lab.compiler.inspection import structural_fingerprint
from sp_lab.compiler.passes.post_grad import PostGradPassManager
from sp_lab.compiler.report import PieceRecord, ReportError, record_from_json, record_to_json

__all__ = ["CompiledPiece", "InductorPieces", "PassesOnly", "PieceCompiler", "choose_piece_compiler"]


@dataclass(frozen=True)
class CompiledPiece:
    fn: Callable[..., Any]
    record: PieceRecord  # what the pass saw and did (replayed from the side file on an Inductor cache hit)
    inductor_cache_hit: bool


class PieceCompiler(Protocol):
    def __call__(self, gm: fx.GraphModule, inputs: list[Any], passes: PostGradPassManager, *,
                 wait: bool = True) -> CompiledPiece | None:
        """Compile ``gm`` for ``inputs`` (fake) with ``passes`` as Inductor's post-grad pass.

        ``wait=False``: None, at once, while another process is compiling the same piece."""
        ...


def choose_piece_compiler(*, inspect_only: bool, aten: bool) -> PieceCompiler:
    """The piece compiler of a range: passes only when inspecting, else Inductor (inner when ``aten``)."""
    return PassesOnly() if inspect_only else InductorPieces(aten=aten)


@dataclass(frozen=True)
class InductorPieces:
    """Inductor with the FX-graph cache on, and the pass's record kept beside it."""

    aten: bool = False  # the piece is already functional aten (sharded path): inner compile, no AOT trace

    def __call__(self, gm: fx.GraphModule, inputs: list[Any], passes: PostGradPassManager, *,
                 wait: bool = True) -> CompiledPiece | None:
        side_file = _record_path(passes.uuid(), structural_fingerprint(gm, inputs))
        with _compile_turn(side_file, wait=wait) as ours:  # until the record is saved: a waiting process reads it
            return self._compile(gm, inputs, passes, side_file) if ours else None

    def _compile(self, gm: fx.GraphModule, inputs: list[Any], passes: PostGradPassManager,
                 side_file: Path) -> CompiledPiece:
        compile_one = _compile_aten_piece if self.aten else _compile_dynamo_piece
        with torch._inductor.config.patch({"post_grad_custom_post_pass": passes, "fx_graph_cache": True}):
            fn = compile_one(gm, inputs)
        if passes.record is not None:
            _save(side_file, passes.record)
            return CompiledPiece(fn, passes.record, False)
        replayed = _load(side_file)
        if replayed is not None:
            return CompiledPiece(fn, dataclasses.replace(replayed, index=passes.piece_index,
                                                         name=passes.piece_name), True)
        # A cache hit without our record: compile again with the cache off, so a report is never made up.
        with torch._inductor.config.patch({"post_grad_custom_post_pass": passes, "fx_graph_cache": False}):
            fn = compile_one(gm, inputs)
        _save(side_file, passes.record)
        return CompiledPiece(fn, passes.record, False)


@dataclass(frozen=True)
class PassesOnly:
    """AOT-trace ``gm`` to the functional aten graph Inductor would receive and run the pass on it."""

    def __call__(self, gm: fx.GraphModule, inputs: list[Any], passes: PostGradPassManager, *,
                 wait: bool = True) -> CompiledPiece:
        def forward_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Callable:
            passes(aten_gm.graph)
            aten_gm.recompile()
            return make_boxed_func(aten_gm)

        gm = with_tuple_output(gm) or gm  # AOT wants tuple outputs; nothing runs the result
        with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(inputs))):
            fn = aot_module_simplified(
                gm, inputs, fw_compiler=forward_compiler, decompositions=select_decomp_table(),
                keep_inference_input_mutations=True,
            )
        return CompiledPiece(fn, passes.record, False)


def with_tuple_output(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of ``gm`` returning ``(x,)`` where it returned ``x``; None when it already returns a tuple."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return None
    graph = copy.deepcopy(gm.graph)
    tuple_output = next(n for n in reversed(graph.nodes) if n.op == "output")
    tuple_output.args = ((tuple_output.args[0],),)
    return fx.GraphModule(gm, graph)


def _compile_dynamo_piece(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
    """Inductor's ``compile_fx`` for a piece of Dynamo's graph, never changing ``gm``.

    ``compile_fx`` rewrites a graph that returns one value, in place, to return a tuple. A second compile of the
    same piece (the record fallback in :class:`InductorPieces`, when Inductor's cache hit but the record beside it
    was missing, as when another rank is still writing it) would then get the rewritten graph and hand the next
    piece a list. So the copy that already returns a tuple is compiled, and unpacked here."""
    single = with_tuple_output(gm)
    if single is None:
        return compile_fx(gm, inputs)
    compiled = compile_fx(single, inputs)

    def run(*args: Any) -> Any:
        return compiled(*args)[0]

    return run


def _compile_aten_piece(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
    """Inductor's inner compile for a piece that is already a functional aten graph (the sharded path)."""
    single = with_tuple_output(gm)
    # A tracing context of its own: the enclosing one belongs to the whole graph's AOT trace.
    with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(inputs))):
        compiled = compile_fx_inner(single if single is not None else gm, inputs, is_inference=True)

    def run(*args: Any) -> Any:
        out = compiled(list(args))
        return out[0] if single is not None else out

    return run


# -- the record kept beside Inductor's cache ------------------------------------------------------------------


def _record_path(pass_uuid: str, fingerprint: str) -> Path:
    """Beside sp_lab's artifact cache when there is one (its entries make Inductor hit in a cache directory
    that never saw the pass run), else beside Inductor's cache."""
    key = hashlib.sha256(f"{pass_uuid}:{fingerprint}".encode()).hexdigest()[:32]
    root = artifact_cache_dir() or Path(cache_dir())
    return root / "sp_lab_piece_records" / f"{key}.json"


@contextlib.contextmanager
def _compile_turn(side_file: Path, *, wait: bool) -> Iterator[bool]:
    """Whether this process compiles the piece now: held while a piece compiles that no process has compiled into
    this cache yet, so that processes compiling the same piece at the same moment take turns. The first compiles;
    the others wait, then hit Inductor's cache and read the record the first left in ``side_file`` -- or, with
    ``wait=False``, get False at once and compile another piece meanwhile.

    The ranks of a launch are such processes: they compile each range at the same moment, and most pieces are
    one graph on every rank (weights are inputs; a value that differs by rank, such as the offset of a rank's
    rows, makes a piece another graph, hence another file and no wait). Without turns every rank would miss the
    cache and generate the same code. Once the record is there, the loads run side by side. The lock is the
    operating system's (``flock``), released when its file closes: also by a process that dies holding it."""
    if side_file.exists():
        yield True
        return
    side_file.parent.mkdir(parents=True, exist_ok=True)
    with open(side_file.with_suffix(".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process compiles it now
            yield False
            return
        if side_file.exists():  # compiled while this process waited: load it beside the other waiters
            fcntl.flock(lock, fcntl.LOCK_UN)
        yield True


def _save(path: Path, record: PieceRecord) -> None:
    """Write the record as JSON (atomically: a concurrent compile may read it)."""
    write_atomic(path, json.dumps(record_to_json(record)))


def _load(path: Path) -> PieceRecord | None:
    """The record at ``path``; None when there is none or it is unreadable (then the piece compiles again)."""
    try:
        return record_from_json(PieceRecord, json.loads(path.read_text()))
    except (OSError, ValueError, ReportError):
        return None
