"""Latency sweeps: one model, several variants (which passes are on), many token counts.

Variants are :data:`sp_lab.programs.VARIANTS`: each reference variant (``baseline``, ``sp``,
``sp+async_tp``) runs its program at every token count with no per-matmul rule, ``tuned`` is the given
config as is; :func:`sp_lab.programs.variant_config` derives each from the user's
:class:`~sp_lab.config.LabConfig` and :func:`sp_lab.programs.expectation` says what its report should show.

:func:`run_sweep` runs *inside every rank* (from :func:`sp_lab.launch`, under ``torchrun``, or in one
plain process for tp=1). All ranks build and compile the same model and time the same calls; each call's
time is the slowest rank's (the ranks start every call together), a row's latency the median of those calls
(:mod:`sp_lab.bench.interleave`), and rank 0 appends one row per (variant, token count) to a
:class:`~sp_lab.bench.store.SweepStore` as soon as it is measured.

A sweep, step by step (:func:`run_sweep`):

1. **Plan the points** (``_plan_points``): before measuring, rank 0 reads the keys already in the store
   (:data:`KEY_COLUMNS`) and every rank skips them, so a sweep that was killed part-way picks up where it
   stopped; a variant whose token counts are all done is not even compiled.
2. **Claim or skip** each token count's points (``_claim_or_skip``): one measurement per point across
   concurrent sweeps of one store.
3. **Measure the point** (``_measure_point``): a variant compiles only the range the point needs, when the
   point needs it. The variants already compiled for it are measured together, interleaved; each one still
   to compile is compiled (the progress bar says which variant and range) and measured as soon as it is,
   so the first row is on screen after one compile, not after every variant's.
4. **Record the rows** (``_record_rows``): rank 0 appends each row as soon as it is measured.

Honesty: every row records what actually ran at its token count (SP rewrites and collective / fused
op counts from the :class:`CompileReport`). If the variant's transformation was expected and did not
run (fusion did not fire, SP did not rewrite), the row has ``fusion_missing=True`` and its
``reported_variant`` is ``"<variant> [fusion missing]"``, so a plot never shows it as that variant.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import inspect
import json
import os
import platform
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sp_lab.bench.interleave import PointTiming, StopRule, broadcast, every_rank, interleave
from sp_lab.bench.progress import SweepTally, tally_reuse
from sp_lab.bench.setups import Setup, setup_of_row
from sp_lab.bench.store import KEY_COLUMNS, SweepStore, release_claims
from sp_lab.bench.timing import check_counts
from sp_lab.distributed.collectives import rehearsal_device
from sp_lab.programs import REFERENCE_VARIANTS, VARIANTS, expectation, variant_config
from sp_lab.vocabulary import FUSION_MISSING_SUFFIX, MEASURED, REHEARSAL

if TYPE_CHECKING:
    from sp_lab.compiler.backend import CompiledModel
    from sp_lab.compiler.capture import SharedCaptures
    from sp_lab.compiler.report import CompileReport
    from sp_lab.config import LabConfig

DEFAULT_VARIANTS = REFERENCE_VARIANTS
"""What a sweep measures unless told otherwise (``tuned`` needs a tuned config to mean anything)."""

# ---------------------------------------------------------------------------------------------- variants
def config_hash(config: LabConfig) -> str:
    """A short, stable hash of a config's JSON form (12 hex digits): part of a row's resume key."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------- provenance
@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows, or ``"cpu"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_name(device: torch.device) -> str:
    """``"NVIDIA H200"`` for a CUDA device, ``"cpu: <model name>"`` otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {cpu_name()}"


def _sp_lab_version() -> str:
    try:
        import sp_lab

        return str(sp_lab.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def _world() -> tuple[int, int, str]:
    """(rank, world_size, backend); (0, 1, "none") without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    return 0, 1, "none"


def _default_device(backend: str) -> torch.device:
    shared = rehearsal_device()  # rehearsal ranks all compute on the one GPU
    if shared is not None:
        return shared
    if backend == "nccl" or (backend == "none" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_count(device: torch.device) -> int:
    """Distinct devices the ranks compute on (all ranks of a gloo CPU run share one host CPU)."""
    return len(set(every_rank((socket.gethostname(), str(device)))))


class SweepArgumentError(ValueError):
    """A sweep argument refused before anything is built or launched; the message names it and what would work."""


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The model dtype the sweep builds with (the models' own rule, :func:`sp_lab.models.registry.resolve_dtype`)."""
    from sp_lab.models.registry import resolve_dtype

    try:
        return resolve_dtype(dtype)
    except ValueError as error:
        raise SweepArgumentError(str(error)) from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- the sweep
@dataclasses.dataclass
class SweepResult:
    """What :func:`run_sweep` did (on rank 0; other ranks return the same counts and no rows)."""

    rows: list[dict[str, Any]]
    """The rows written by this call, in measurement order (empty on ranks other than 0)."""
    skipped: int
    """(variant, token count) points already in the store, not measured again."""
    store_dir: str
    """Where the rows went."""
    sweep_id: str
    """The ``sweep_id`` of the rows written by this call."""
    elsewhere: int = 0
    """Points a concurrent sweep of the same store claimed first and measured (never measured twice)."""
    device_name: str = ""
    """The device the sweep ran on, as its rows (and the resume key that skipped stored points) name it."""
    backend: str = ""
    """The process-group backend, likewise."""
    tally: SweepTally | None = None
    """All the sweep's points: how many were reused from which earlier sweeps, measured now, measured elsewhere."""
    setup: Setup | None = None
    """The setup of the sweep's rows (:mod:`sp_lab.bench.setups`): what a reader asks for to show them alone."""

    @property
    def fusion_missing(self) -> list[dict[str, Any]]:
        """Rows whose variant's transformation did not run."""
        return [r for r in self.rows if r["fusion_missing"]]

    def __repr__(self) -> str:
        """One line (the dataclass's own spelled out every row: 40 lines under a notebook cell): what was measured,
        reused and where the rows are; the rows themselves are in :attr:`rows`."""
        done = (self.tally.describe() if self.tally is not None
                else f"{len(self.rows)} rows measured now, {self.skipped} points reused")
        missing = f", fusion missing in {len(self.fusion_missing)}" if self.fusion_missing else ""
        return f"SweepResult({done}{missing}; sweep {self.sweep_id} in {self.store_dir})"


def _check_token_counts(token_counts: Sequence[int]) -> list[int]:
    counts = list(token_counts)
    if not counts:
        raise SweepArgumentError("token_counts is empty; pass e.g. [1, 16, 128, 1024]")
    bad = [t for t in counts if isinstance(t, bool) or not isinstance(t, int) or t < 1]
    if bad:
        raise SweepArgumentError(f"token counts must be positive ints, got {bad}")
    return sorted(set(counts))


def run_sweep(
    model_name: str,
    *,
    token_counts: Sequence[int],
    store_dir: str | os.PathLike,
    config: LabConfig | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    tp_size: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    num_layers: int | None = None,
    model_overrides: Mapping[str, Any] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    max_repeats: int | None = None,
    ci_width: float = 0.05,
    budget_s: float | None = None,
    cuda_graph: bool = True,
    seed: int = 0,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    sweep_id: str | None = None,
    reports_dir: str | os.PathLike | None = None,
    build_fn: Callable[..., torch.nn.Module] | None = None,
    compile_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
) -> SweepResult:
    """Measure forward latency of ``model_name`` for every (variant, token count); call in every rank.

    Variants are measured **interleaved**: at one token count, each variant is called in turn and the
    order rotates every round, so a machine that slows down for a minute slows every variant alike
    instead of whichever was being measured in its block. A variant that must first compile the point's
    range is measured right after its compile, on its own (the others are not kept waiting for it). Rounds repeat until the 95% confidence
    interval of every variant's median is within ``ci_width`` of it (relative full width), after at least
    ``repeats`` and at most ``max_repeats`` calls, or until this token count's share of ``budget_s`` is
    spent. A call's latency is that of the slowest rank (the ranks start each call together).

    Args:
        model_name: anything :func:`sp_lab.models.build` takes ("toy", a preset, a checkpoint dir).
        token_counts: token counts ``T`` to time; the input is ``input_ids`` of shape ``[T]``.
        store_dir: the :class:`SweepStore` directory rows are appended to (rank 0 writes).
        config: the base :class:`LabConfig` (default ``LabConfig(tp_size=world_size)``); ``tuned`` measures
            it as is, the other variants are derived from it by :func:`variant_config`.
        variants: subset of :data:`VARIANTS`.
        tp_size: must equal the world size when given (a check, not a choice: TP spans the whole group).
        dtype, device: of the model; ``device`` defaults to this rank's GPU under NCCL, else the CPU.
        num_layers, model_overrides, seed: passed to the model builder.
        warmup: untimed calls per point (after one untimed first call that compiles).
        repeats, max_repeats: least and most timed calls per point (``max_repeats`` default ``10 * repeats``).
        ci_width: stop once every median's 95% interval is narrower than this fraction of it.
        budget_s: seconds of timing for the whole sweep (shared equally by the token counts left);
            ``None``: no limit but ``max_repeats``.
        cuda_graph: on CUDA, replay a captured graph (falls back to eager, recorded in the row's note).
        progress: a tqdm progress bar on rank 0.
        on_row: called on rank 0 with each row right after it is on disk (e.g. to update a live plot).
        sweep_id: label of this run's rows (default: a fresh uuid).
        reports_dir: if given, rank 0 saves each compiled variant's CompileReport there as
            ``<variant>.json`` after measuring it (for ``python -m sp_lab report``).
        build_fn: ``build_fn(model_name, tp_rank=, tp_size=, num_layers=, dtype=, device=, seed=, **overrides)``
            (default :func:`sp_lab.models.build`); a stand-in for tests.
        compile_fn: ``compile_fn(model, config) -> compiled`` with ``compiled(input_ids)`` and
            ``compiled.report`` (default :func:`sp_lab.compile`); a stand-in for tests.

    Returns:
        A :class:`SweepResult`: the rows written (rank 0) and how many points were already done.
    """
    rank, world, backend = _world()
    tokens, max_repeats, config = _checked(tp_size, world, token_counts, variants, warmup, repeats, max_repeats,
                                           ci_width, budget_s, config)
    torch_dtype = _resolve_dtype(dtype)
    device = torch.device(device) if device is not None else _default_device(backend)
    sweep_id = broadcast(sweep_id or uuid.uuid4().hex)
    store = SweepStore(Path(store_dir))
    model = (build_fn or _default_build)(
        model_name, tp_rank=rank, tp_size=world, num_layers=num_layers, dtype=torch_dtype, device=device,
        seed=seed, **dict(model_overrides or {}),
    )
    base = _row_base(model.spec, sweep_id, torch_dtype, world, device, backend, warmup)
    seen = set(store.parts()) if rank == 0 else set()  # parts after these are checked before each claim
    plan = _plan_points(store, base, {v: variant_config(v, config, tp_size=world) for v in variants}, tokens, rank)
    progress = _Progress(store, sweep_id, plan.tally, enabled=progress and rank == 0, rank=rank)
    # Nothing compiles here: each variant compiles a range on its first call at a count in it (_measure_point).
    # The variants share the model's Dynamo captures: the first to reach a call captures it, the others only
    # compile their ranges from that graph.
    compile_variant = compile_fn or functools.partial(_default_compile, captures=_shared_captures(model))
    compiled = {v: compile_variant(model, plan.configs[v]) for v in plan.needed}
    stop = StopRule(repeats=repeats, max_repeats=max_repeats, ci_width=ci_width, budget_s=budget_s,
                    points_left=len(plan.pending))
    written: list[dict[str, Any]] = []
    claims: dict = {}
    try:
        for t, todo in plan.pending.items():
            claims, claimed = _claim_or_skip(store, plan, t, todo, seen, progress, rank)
            if not claimed:
                stop.points_left -= 1
                continue
            # same seed on every rank: TP ranks must see the same tokens
            gen = torch.Generator().manual_seed(seed * 1_000_003 + t)
            input_ids = torch.randint(0, model.spec.vocab_size, (t,), generator=gen).to(device)
            for timings in _measure_point(compiled, claimed, input_ids, progress, device=device, warmup=warmup,
                                          cuda_graph=cuda_graph, stop=stop):
                written += _record_rows(store, base, plan, compiled, t, timings, progress, on_row, rank)
            release_claims(claims)  # after the rows are on disk: whoever claims next sees them
        if reports_dir is not None and rank == 0:
            Path(reports_dir).mkdir(parents=True, exist_ok=True)
            for v in plan.needed:
                (Path(reports_dir) / f"{v}.json").write_text(compiled[v].report.to_json())
    finally:
        release_claims(claims)
        progress.close()
    return SweepResult(rows=written, skipped=plan.skipped, store_dir=str(store.path), sweep_id=sweep_id,
                       device_name=base["device_name"], backend=base["backend"],
                       elsewhere=progress.elsewhere, tally=progress.tally,
                       setup=setup_of_row({**base, "boundary": config.boundary, "config_json": config.to_json()}))


def _checked(
    tp_size: int | None, world: int, token_counts: Sequence[int], variants: Sequence[str], warmup: int,
    repeats: int, max_repeats: int | None, ci_width: float, budget_s: float | None, config: LabConfig | None,
) -> tuple[list[int], int, LabConfig]:
    """The arguments refused (:class:`SweepArgumentError`) with what would work, or ``(token counts sorted,
    max_repeats, config)``. Run in every rank and, by :func:`launch_sweep`, once before the ranks start."""
    if tp_size is not None and tp_size != world:
        raise SweepArgumentError(
            f"tp_size={tp_size} but the process group has world_size={world}: TP spans the whole group. "
            f"Launch with world_size={tp_size} (sp_lab.launch / torchrun --nproc-per-node {tp_size})."
        )
    tokens = _check_token_counts(token_counts)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SweepArgumentError(f"unknown or no variants {unknown or list(variants)}; choose from {VARIANTS}")
    try:
        check_counts(warmup, repeats)
    except ValueError as e:
        raise SweepArgumentError(str(e)) from None
    max_repeats = 10 * repeats if max_repeats is None else max_repeats
    if max_repeats < repeats or not 0 < ci_width or (budget_s is not None and budget_s <= 0):
        raise SweepArgumentError(
            f"need max_repeats >= repeats, ci_width > 0 and budget_s > 0 (or None); got max_repeats="
            f"{max_repeats}, repeats={repeats}, ci_width={ci_width}, budget_s={budget_s}"
        )
    if config is None:
        from sp_lab.config import LabConfig

        config = LabConfig(tp_size=world)
    too_many = [t for t in tokens if t > config.max_num_tokens]
    if too_many:
        raise SweepArgumentError(
            f"token counts {too_many} exceed config.max_num_tokens={config.max_num_tokens}; "
            "raise LabConfig.max_num_tokens or drop them"
        )
    return tokens, max_repeats, config


def _row_base(spec: Any, sweep_id: str, dtype: torch.dtype, world: int, device: torch.device, backend: str,
              warmup: int) -> dict[str, Any]:
    """The provenance every row of this sweep carries."""
    return {
        # Ranks sharing one GPU run the multi-GPU code path, not its latency: their rows are never "measured".
        "source": REHEARSAL if rehearsal_device() is not None else MEASURED,
        "sweep_id": sweep_id,
        "model": spec.name,
        "hidden_size": spec.hidden_size,
        "num_layers": spec.num_layers,
        # An FP8 model's setup is its scheme ("fp8-rowwise"), so its rows never pool with the bf16 model's.
        "dtype": getattr(spec, "quant", None) or _dtype_name(dtype),
        "tp": world,
        "device_name": device_name(device),
        "device_count": _device_count(device),
        "backend": backend,
        "torch_version": torch.__version__,
        "sp_lab_version": _sp_lab_version(),
        "hostname": socket.gethostname(),
        "warmup": warmup,
    }


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What this sweep measures: each variant's config, and the (variant, token count) points left."""

    configs: dict[str, LabConfig]
    base: dict[str, Any]
    pending: dict[int, list[str]]
    """Token count -> the variants not yet in the store there, in the sweep's order."""
    done: Any
    """The store's keys when the sweep started (rank 0's, broadcast)."""
    skipped: int
    tally: SweepTally | None = None
    """The sweep's points as it starts: how many the store holds already, from which sweeps."""

    @property
    def planned(self) -> int:
        return sum(len(vs) for vs in self.pending.values())

    @property
    def needed(self) -> list[str]:
        """Variants with a point left (one whose points are all done is not even compiled)."""
        return [v for v in self.configs if any(v in vs for vs in self.pending.values())]

    def key(self, variant: str, t: int) -> tuple:
        cfg = self.configs[variant]
        values = {**self.base, "variant": variant, "boundary": cfg.boundary, "num_tokens": t,
                  "config_hash": config_hash(cfg)}
        return tuple(values[c] for c in KEY_COLUMNS)


def _plan_points(store: SweepStore, base: dict[str, Any], configs: dict[str, LabConfig], tokens: list[int],
                 rank: int) -> _Plan:
    """The points not yet in the store. Rank 0 alone reads it, so every rank skips exactly the same points (a
    rank that disagreed would wait forever in a collective the others skip)."""
    stored = store.read(skip_corrupt=True) if rank == 0 else None  # corrupt parts: their points are measured again
    if stored is not None:
        stored = stored.filter(stored["source"] == base["source"])
    done = broadcast(set(stored.select(KEY_COLUMNS).iter_rows()) if stored is not None else None)
    plan = _Plan(configs, base, {}, done, 0)
    keys = [plan.key(v, t) for t in tokens for v in configs]
    # Rank 0 alone knows where the reused points come from (the progress bars are its own).
    tally = tally_reuse(stored, [k for k in keys if k in done], len(keys)) if stored is not None else None
    pending = {t: [v for v in configs if plan.key(v, t) not in done] for t in tokens}
    pending = {t: vs for t, vs in pending.items() if vs}
    return dataclasses.replace(plan, pending=pending, tally=broadcast(tally),
                               skipped=len(keys) - sum(len(vs) for vs in pending.values()))


def _claim_or_skip(store: SweepStore, plan: _Plan, t: int, todo: list[str], seen: set, progress: _Progress,
                   rank: int) -> tuple[dict, list[str]]:
    """Rank 0 claims the points at ``t`` (one measurement per point across concurrent sweeps of one store);
    every rank follows. ``(rank 0's claims, the variants claimed)``; those a concurrent sweep took are dropped
    from the plan and the bar."""
    claims = (store.claim_points({v: plan.key(v, t) for v in todo}, seen, plan.done, source=plan.base["source"])
              if rank == 0 else {})
    claimed = broadcast(list(claims) if rank == 0 else None)
    if len(claimed) < len(todo):
        progress.taken_elsewhere(len(todo) - len(claimed))
    return claims, claimed


def _measure_point(compiled: dict[str, Any], todo: list[str], input_ids: torch.Tensor, progress: _Progress,
                   **interleave_kwargs: Any) -> Iterator[dict[str, PointTiming]]:
    """Time the variants ``todo`` at one token count; yields their timings batch by batch, as measured.

    The variants whose range is compiled are measured first, interleaved. Each variant still to compile
    then compiles (the progress bar says which variant and range) and is measured at once, so a row
    reaches the screen after one compile instead of after every variant's. Every batch gets its share of
    the point's time budget.
    """
    t = int(input_ids.shape[0])
    pending = {v: _pending_compile(compiled[v], t) for v in todo}
    pending = broadcast(pending)  # every rank compiles and measures in rank 0's order
    ready = [v for v in todo if pending[v] is None]
    batches = ([ready] if ready else []) + [[v] for v in todo if pending[v] is not None]
    stop = interleave_kwargs.pop("stop")
    left = len(todo)
    for batch in batches:
        for v in batch:
            if pending[v] is not None:
                progress.doing(f"compiling {v} {pending[v]} for T={t}")
                with torch.no_grad():
                    compiled[v](input_ids)
        progress.doing(f"T={t}: {', '.join(batch)}")
        with torch.no_grad():
            yield interleave({v: functools.partial(compiled[v], input_ids) for v in batch}, stop=stop,
                             share=len(batch) / left, ends_point=len(batch) == left, **interleave_kwargs)
        left -= len(batch)


def _pending_compile(compiled: Any, num_tokens: int) -> str | None:
    """The label of the range a call at ``num_tokens`` would compile first (``"[16, 256]"``); None when none
    would (a compiler stand-in without ``pending_compile`` counts as compiled)."""
    pending = getattr(compiled, "pending_compile", None)
    rng = pending(num_tokens) if pending is not None else None
    return None if rng is None else rng.label


def _record_rows(store: SweepStore, base: dict[str, Any], plan: _Plan, compiled: dict[str, Any], t: int,
                 timings: dict[str, PointTiming], progress: _Progress,
                 on_row: Callable[[dict[str, Any]], None] | None, rank: int) -> list[dict[str, Any]]:
    """Rank 0 appends one row per variant timed (on disk before anyone hears of it); the rows written."""
    written = []
    for v, timing in timings.items():
        if rank == 0:
            row = _row(base, v, plan.configs[v], t, timing, compiled[v].report)
            store.append([row])
            written.append(row)
            if on_row is not None:
                on_row(row)
        progress.advance()
    return written


class _Progress:
    """The sweep's progress, on rank 0: a tqdm bar here, and the store's plan file for a watcher elsewhere
    (``launch_sweep``'s bar): every point of the sweep, how many were reused from which sweep, measured now or by
    a concurrent sweep (:class:`~sp_lab.bench.progress.SweepTally`), and what is going on (compiling what)."""

    def __init__(self, store: SweepStore, sweep_id: str, tally: SweepTally | None, *, enabled: bool, rank: int):
        self.store, self.sweep_id, self.rank = store, sweep_id, rank
        self.tally = tally or SweepTally(total=0)  # ranks other than 0 count nothing
        # The bar counts every point: a rerun's bar starts at the points it reuses, not at 0 of the rest.
        self.bar = _progress_bar(total=self.tally.total, enabled=enabled, initial=self.tally.reused)
        self._say()
        self._record()

    @property
    def elsewhere(self) -> int:
        return self.tally.elsewhere

    def _record(self, doing: str = "") -> None:
        if self.rank == 0:
            self.store.record_plan(self.sweep_id, self.tally.to_measure, doing=doing, tally=self.tally.to_dict())

    def _say(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self.tally.describe(), refresh=False)

    def doing(self, what: str) -> None:
        self._record(what)
        if self.bar is not None:
            self.bar.set_description(what)

    def taken_elsewhere(self, points: int) -> None:
        self.tally = dataclasses.replace(self.tally, elsewhere=self.tally.elsewhere + points)
        self._record()
        self._say()
        if self.bar is not None:
            self.bar.update(points)  # their rows are in the store: done, by another sweep

    def advance(self) -> None:
        self.tally = self.tally.with_measured(self.tally.measured + 1)
        self._say()
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _row(
    base: dict[str, Any],
    variant: str,
    cfg: LabConfig,
    num_tokens: int,
    timing: PointTiming,
    report: CompileReport,
) -> dict[str, Any]:
    """One store row: provenance + timing + what the compile report says ran at ``num_tokens``."""
    counts = report.op_counts(num_tokens)
    fired = bool(report.fusion_fired(num_tokens))
    rewrites = int(report.sp_rewrites(num_tokens))
    expect = expectation(cfg, num_tokens)
    missing_parts = []
    if expect.sp and rewrites == 0:
        missing_parts.append("SP expected but made no rewrite")
    if expect.fusion and not fired:
        missing_parts.append("AsyncTP fusion expected but did not fire")
    notes = [n for n in (expect.note, *missing_parts, timing.note) if n]
    return {
        **base,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
        "variant": variant,
        "reported_variant": variant + (FUSION_MISSING_SUFFIX if missing_parts else ""),
        "boundary": cfg.boundary,
        "num_tokens": num_tokens,
        "enable_sp": bool(cfg.enable_sp),
        "enable_async_tp": bool(cfg.enable_async_tp),
        "async_tp_min_tokens": int(cfg.async_tp_min_tokens),
        "config_hash": config_hash(cfg),
        "config_json": cfg.to_json(),
        **timing.summary(),
        "repeats": len(timing.samples_us),
        "timing_method": timing.method,
        "sp_rewrites": rewrites,
        "n_all_reduce": int(counts.get("all_reduce", 0)),
        "n_reduce_scatter": int(counts.get("reduce_scatter", 0)),
        "n_all_gather": int(counts.get("all_gather", 0)),
        "n_fused_ag_mm": int(counts.get("fused_all_gather_matmul", 0)),
        "n_fused_mm_rs": int(counts.get("fused_matmul_reduce_scatter", 0)),
        "sp_expected": expect.sp,
        "fusion_expected": expect.fusion,
        "fusion_fired": fired,
        "fusion_missing": bool(missing_parts),
        "note": "; ".join(notes) or None,
    }


def _progress_bar(*, total: int | None, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # A point's time is mostly the compile of its range on first use, then seconds: weigh the latest
    # intervals (smoothing 0.9, tqdm's default 0.3) so one compile does not drive the ETA for long.
    return tqdm(total=total, initial=initial, unit="pt", desc="sweep", dynamic_ncols=True, smoothing=0.9)


def _default_build(model_name: str, **kwargs: Any) -> torch.nn.Module:
    from sp_lab.models import build

    return build(model_name, **kwargs)


def _shared_captures(model: torch.nn.Module) -> SharedCaptures:
    from sp_lab.compiler.capture import SharedCaptures

    return SharedCaptures(model)


def _default_compile(model: torch.nn.Module, config: LabConfig, *, captures: SharedCaptures) -> CompiledModel:
    from sp_lab.compiler.backend import compile as compile_model

    return compile_model(model, config, captures=captures)


# ---------------------------------------------------------------------------------------------- launching
def check_sweep_arguments(model_name: str, world_size: int, token_counts: Sequence[int], variants: Sequence[str],
                          kwargs: Mapping[str, Any], *, store_dir: str | os.PathLike | None = None) -> None:
    """Refuse what every rank of a sweep would refuse, by the ranks' own checks (:func:`_checked`,
    :func:`_resolve_dtype`, the model's name, sizes and the tp sizes it can take), so that a bad argument fails in
    the calling cell before any rank starts (and a rerun is never told to resume a sweep that cannot start).

    ``kwargs``: what :func:`launch_sweep` passes on to :func:`run_sweep`. Raises :class:`SweepArgumentError` (or
    ``TypeError`` for an argument ``run_sweep`` does not take, the model registry's own error for a model that does
    not exist), naming the value and what would work. :func:`launch_sweep` and the tuner call it.
    """
    params = inspect.signature(run_sweep).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"launch_sweep: unknown arguments {unknown}; run_sweep takes {sorted(params)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SweepArgumentError(f"world_size (tp) = {world_size!r}: a sweep runs on a positive int number of ranks")
    args = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    args.update(kwargs)
    if args["tp_size"] is not None and args["tp_size"] != world_size:  # in the launcher's words: which argument
        raise SweepArgumentError(f"tp_size={args['tp_size']} but world_size={world_size}: TP spans the whole group; "
                                 f"pass world_size={args['tp_size']}")
    _checked(args["tp_size"], world_size, token_counts, variants, args["warmup"], args["repeats"],
             args["max_repeats"], args["ci_width"], args["budget_s"], args["config"])
    _resolve_dtype(args["dtype"])
    for name, path in (("store_dir", store_dir), ("reports_dir", args["reports_dir"])):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise SweepArgumentError(f"{name}={str(path)!r} is a file ({Path(path).resolve()}); it must be a directory "
                                     "(created if missing)")
    if args["build_fn"] is None:
        from sp_lab.models.registry import resolve_config

        spec = resolve_config(model_name, num_layers=args["num_layers"], **dict(args["model_overrides"] or {}))
        try:
            spec.check_tp_size(world_size)
        except ValueError as e:
            raise SweepArgumentError(f"{model_name!r} cannot run on {world_size} ranks: {e}") from None


def launch_sweep(
    model_name: str,
    *,
    world_size: int = 2,
    backend: str = "auto",
    timeout: float = 3600.0,
    store_dir: str | os.PathLike,
    token_counts: Sequence[int],
    variants: Sequence[str] = DEFAULT_VARIANTS,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    on_tally: Callable[[SweepTally], None] | None = None,
    progress: bool = True,
    poll_s: float = 0.2,
    **kwargs: Any,
) -> SweepResult:
    """Run :func:`run_sweep` on ``world_size`` fresh ranks (:func:`sp_lab.launch`) from this process.

    ``on_row`` and the progress bar run *here*, not in the ranks: a watcher thread follows the store
    and reports each row of this sweep as soon as rank 0 has put it on disk, so a notebook can update a
    live plot while the ranks work. (``on_row`` is therefore called from that watcher thread.) Ctrl-C
    stops the ranks; the rows already measured stay in the store and a rerun resumes.

    The bar and ``on_tally`` (watcher thread too, whenever it changes) count every point of the sweep: those
    reused from the store, by the sweep they come from, and those measured now (:class:`SweepTally`), so a
    rerun that reuses 4 of 6 points reads "4 of 6 points from the sweep of <when>, 2 measured now".

    ``kwargs`` go to :func:`run_sweep` (``config``, ``dtype``, ``warmup``, ``repeats``, ...).
    Returns rank 0's :class:`SweepResult`.
    """
    from sp_lab.distributed.launch import launch

    check_sweep_arguments(model_name, world_size, token_counts, variants, kwargs, store_dir=store_dir)
    sweep_id = kwargs.pop("sweep_id", None) or uuid.uuid4().hex
    store = SweepStore(Path(store_dir))
    seen = set(store.parts())
    # The tally (every point, the reused ones and where from) is rank 0's, read from the store's plan file as
    # rank 0 writes it; unknown until the ranks are up.
    bar = _progress_bar(total=None, enabled=progress)
    stop = threading.Event()
    watcher_error: list[BaseException] = []
    measured, told = [0], [None]  # rows of this sweep delivered; the tally last told

    def deliver() -> None:
        doing = store.plan_doing(sweep_id) if bar is not None else None
        if doing:
            bar.set_description(doing, refresh=False)
        new = store.read_new(seen)
        for row in new.filter(new["sweep_id"] == sweep_id).iter_rows(named=True):
            measured[0] += 1
            if bar is not None:
                bar.set_description(f"{row['variant']} T={row['num_tokens']}", refresh=False)
            if on_row is not None:
                on_row(row)
        planned = store.plan_tally(sweep_id)
        if planned is None:
            return
        tally = SweepTally.from_dict(planned).with_measured(measured[0])
        if tally == told[0]:
            return  # nothing new: no redraw (a bar redrawn every poll floods a log)
        told[0] = tally
        if bar is not None:
            if bar.total != tally.total:
                bar.reset(total=tally.total)  # the clock starts when measuring starts, not at rank start-up
            bar.set_postfix_str(tally.describe(), refresh=False)
            if tally.done > bar.n:
                bar.update(tally.done - bar.n)
            else:
                bar.refresh()
        if on_tally is not None:
            on_tally(tally)

    def watch() -> None:
        try:
            while not stop.wait(poll_s):
                deliver()
        except BaseException as e:  # noqa: BLE001 - surfaced after the launch; never kill the ranks from here
            watcher_error.append(e)

    thread = threading.Thread(target=watch, name="sp_lab-sweep-watcher", daemon=True)
    thread.start()
    try:
        results = launch(
            run_sweep,
            model_name,
            world_size=world_size,
            backend=backend,
            timeout=timeout,
            store_dir=str(store_dir),
            token_counts=list(token_counts),
            variants=list(variants),
            progress=False,
            sweep_id=sweep_id,
            **kwargs,
        )
    finally:
        stop.set()
        thread.join()
        if not watcher_error:
            deliver()  # rows that landed after the watcher's last look
        store.forget_plan(sweep_id)
        if bar is not None:
            bar.close()
    if watcher_error:
        raise RuntimeError(f"on_row callback failed: {watcher_error[0]!r}") from watcher_error[0]
    result: SweepResult = results[0]
    if on_tally is not None and result.tally is not None and result.tally != told[0]:
        on_tally(result.tally)  # the last word is rank 0's own count
    if bar is not None and result.tally is not None and (result.skipped or result.elsewhere):
        print(f"{result.tally.describe()} (store {store.path})")
    return result


LAUNCHER_ARGUMENTS = frozenset(inspect.signature(launch_sweep).parameters) - {"kwargs"}
"""What :func:`launch_sweep` takes for itself (``backend``, ``timeout``, ...), not passed on to the ranks'
:func:`run_sweep`: a caller that holds both kinds checks only the others with :func:`check_sweep_arguments`."""
