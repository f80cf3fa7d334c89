"""The policy tuner for JupyterLab: ``sp_lab.tune(...)``: which program below / above ``async_tp_min_tokens``.

Two layers, so that everything but the drawing is testable without a browser:

- :class:`TunerState` holds the rows (live, replayed, or a predicted demo), the chosen policy (which variant
  below and above the threshold, and the threshold or "never") and the setup, and answers every
  question the view asks: the config's curve and regret (:func:`sp_lab.tuning.regret.regret_table`,
  the one regret; with a workload chosen, also weighted by that traffic's share of step time per token count,
  :func:`sp_lab.serving.on_rows.weighted_regret`), the recommendation with its confidence
  (:func:`sp_lab.tuning.policy.recommend`),
  vLLM's reference threshold, the tuned :class:`~sp_lab.config.LabConfig` and its export
  (:func:`sp_lab.tuning.export.export_config`). It owns no latency logic of its own.
- :class:`Tuner` is the ipywidgets view: controls, the latency figure redrawn (a
  :class:`~sp_lab.viz.live_figure.LiveFigure`, which every view draws whatever its timing) as each row
  arrives, the policy and threshold controls, the regret table and an Export button.

Sources of rows, one at a time (a live sweep starts from its own rows, never merged with what was shown): a
live sweep (:meth:`TunerState.run_sweep`, ranks started with :func:`sp_lab.bench.sweep.launch_sweep`: CPU gloo
ranks here, one GPU per rank where there are enough), or a replay (:meth:`TunerState.replay`) of a recorded
store / parquet file (its timings labelled ``replayed``, as ``python -m sp_lab replay`` imports them), or, when
no recorded GPU sweep exists, a demo made wholly of the performance model's rows for a preset on ``tp`` H200s
(:func:`predicted_rows`, ``source="predicted"``; the "Predicted demo (H200)" button: labelled so in the legend,
the title, the status line and the recommendation; never mixed with measured rows, and exporting them is
refused). Every figure names the rows' model, tp, device and torch under its title. Separately,
:meth:`Tuner.overlay_prediction` draws the model's curves for a chosen preset and GPU beside measured rows
(dashed, "predicted" legend group), never mixed into the rows, the regret or the recommendation.

    import sp_lab
    tuner = sp_lab.tune("toy", tp=2, token_counts=[3, 16, 64])
    tuner                      # shows the widget
    tuner.run_sweep()          # points appear as they are measured (blocking; the button runs it in a thread)
"""

from __future__ import annotations

import dataclasses
import html
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from sp_lab.bench.store import data_hash
from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.tuning.export import describe_file, export_config, threshold_text
from sp_lab.tuning.policy import Policy, Recommendation, recommend
from sp_lab.tuning.regret import REGRET_COLUMNS, REGRET_HEADERS, one_source, regret_table
from sp_lab.vocabulary import (
    BASELINE,
    DEFAULT_OUT,
    DEFAULT_STORE,
    MEASURED,
    NEVER,
    PREDICTED,
    SP,
    SP_ASYNC_TP,
    TUNED,
    describe_threshold,
)

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from sp_lab.bench.progress import SweepTally
    from sp_lab.bench.setups import Setup, SetupChoice
    from sp_lab.bench.sweep import SweepResult
    from sp_lab.config import LabConfig
    from sp_lab.serving.on_rows import WeightedRegret

SHAPES = {f"{BASELINE} -> {SP_ASYNC_TP}": (BASELINE, SP_ASYNC_TP), f"{BASELINE} -> {SP}": (BASELINE, SP),
          f"{SP} -> {SP_ASYNC_TP}": (SP, SP_ASYNC_TP)}
"""The one-threshold policies a LabConfig can express: (variant below the threshold, variant from it on)."""

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token counts a live sweep measures unless told otherwise."""

PER_COUNT = "per token count"
"""The workload control's choice that weights no traffic: the regret per token count only."""

_RUN_FIRST = "tuner.run_sweep() or the Run sweep button; or replay recorded rows: tuner.replay(STORE_DIR)"

# What the latency plot needs that the performance model does not produce (it has no spread, no torch run).
_PREDICTED_FILL = {"p10_us": None, "p90_us": None, "torch_version": "n/a (predicted)", "boundary": "sharded"}
DEMO_GPU = "h200"
"""The GPU a demo replay (``replay(None)``) is predicted for: the one the kernel tables were measured on."""


def _activation_bytes(dtype: str) -> int:
    """Bytes of one activation element of a model of ``dtype``, which vLLM sizes its SP threshold by: an FP8
    model (``fp8-rowwise``) keeps bf16 activations, so 2 (not its matmuls' operand width,
    :func:`sp_lab.tuning.predict.kernels.dtype_bytes`)."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype).removeprefix("torch."), 2)


def predicted_rows(model: str, tp: int, token_counts: Sequence[int], *, num_layers: int | None = None,
                   variants: Sequence[str] = REFERENCE_VARIANTS) -> pl.DataFrame:
    """The performance model's sweep (:func:`sp_lab.tuning.predict.layer.predict_layers`: whole layers on ``tp``
    H200s, graph timing) in sweep-row columns: the tuner's demo when no recorded GPU sweep exists.

    Rows say ``source="predicted"``; ``p10_us``/``p90_us`` equal the prediction (no spread).
    """
    from sp_lab.tuning.predict.layer import predict_layers

    df = predict_layers(model, tp, token_counts, DEMO_GPU, num_layers=num_layers, full_layer=True)
    df = df.filter(pl.col("variant").is_in(list(variants)))
    fill = {k: (pl.col("latency_us") if v is None else pl.lit(v)) for k, v in _PREDICTED_FILL.items()}
    return df.with_columns(**fill)


@dataclasses.dataclass(kw_only=True)
class TunerState:
    """Everything the tuner shows, as plain data (no widgets): rows, policy, setup and derived tables."""

    model: str = "toy"
    """Model name for a live sweep (``sp_lab.models.build``); replayed rows carry their own."""
    tp: int = 2
    """Tensor-parallel ranks of a live sweep."""
    token_counts: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_TOKEN_COUNTS))
    """Token counts a live sweep measures."""
    variants: list[str] = dataclasses.field(default_factory=lambda: list(REFERENCE_VARIANTS))
    """Variants a live sweep measures (a policy needs ``baseline`` and another reference variant)."""
    num_layers: int | None = None
    """Decoder layers of the live-sweep model (``None``: the model's own)."""
    store_dir: str | None = None
    """Sweep store of a live sweep (rows persist there and a rerun resumes)."""
    config: LabConfig | None = None
    """Base :class:`~sp_lab.config.LabConfig` (default ``LabConfig(tp_size=tp)``); the policy gates it."""
    sweep_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra arguments for :func:`~sp_lab.bench.sweep.run_sweep` (``warmup``, ``repeats``, ``budget_s``, ...)."""
    shape: tuple[str, str] = (BASELINE, SP_ASYNC_TP)
    """(variant below the threshold, variant from it on): one of :data:`SHAPES`."""
    threshold: int | None = 128
    """The threshold (the slider); ``None`` is "never": the ``shape[0]`` variant everywhere."""
    rows: pl.DataFrame = dataclasses.field(default_factory=pl.DataFrame)
    """All rows shown, one source at a time (measured, replayed, rehearsal or a predicted demo)."""
    running: bool = False
    """A live sweep is in progress."""
    done: int = 0
    """Points measured by the current live sweep."""
    tally: SweepTally | None = None
    """The current live sweep's account of its points (reused from which sweep, measured now), once its ranks
    have planned."""
    setup: Setup | Mapping[str, Any] | None = None
    """The setup a replay shows (a :class:`~sp_lab.bench.setups.Setup` or some of its fields); ``None``: the newest
    setup of the rows replayed."""
    choice: SetupChoice | None = None
    """Which setup the last replay chose, and the others its rows hold."""
    predicted: pl.DataFrame = dataclasses.field(default_factory=pl.DataFrame)
    """Predicted curves drawn beside the rows (``source="predicted"``); never in the regret or recommendation."""
    workload: str | None = None
    """A named workload (:mod:`sp_lab.serving.workloads`) the regret is also weighted by
    (:meth:`traffic_regret`); ``None``: the regret per token count only."""

    def __post_init__(self) -> None:
        if self.config is None:
            from sp_lab.config import LabConfig

            self.config = LabConfig(tp_size=self.tp)
        self._lock = threading.Lock()  # rows arrive on the sweep's watcher thread

    # ------------------------------------------------------------------ rows
    @property
    def total(self) -> int:
        """Points a live sweep of this setup measures."""
        return len(set(self.token_counts)) * len(self.variants)

    @property
    def source(self) -> str | None:
        """The single source of the rows shown (``None`` before any row)."""
        if not self.rows.height or "source" not in self.rows.columns:
            return None
        return self.rows["source"][0]

    def add_row(self, row: Mapping[str, Any]) -> None:
        """Append one measured row (the sweep's ``on_row``); thread-safe."""
        frame = pl.DataFrame([dict(row)])
        with self._lock:
            self.rows = pl.concat([self.rows, frame], how="diagonal_relaxed") if self.rows.height else frame
            self.done += 1

    def set_rows(self, rows: pl.DataFrame) -> None:
        """Show exactly ``rows`` (one source and one setup; several are refused: never compared unlabelled)."""
        if rows.height:
            from sp_lab.bench.setups import one_setup

            one_source(rows)  # several sources are refused, naming them
            one_setup(rows, "the tuner's view")  # replay() chooses one setup; rows given here must be one
        with self._lock:
            self.rows = rows

    def snapshot(self) -> pl.DataFrame:
        """The rows now (a consistent copy while a sweep adds rows)."""
        with self._lock:
            return self.rows

    def provenance(self) -> str:
        """Where the rows shown come from, in one line (model, tp, device, torch, boundary, dtype, source): what the
        figure says under its title, for printing beside a recommendation or a regret."""
        from sp_lab.viz.latency import provenance_line

        return provenance_line(self.snapshot())

    def replay(self, source: str | Path | pl.DataFrame | None = None, *,
               setup: Setup | Mapping[str, Any] | None = None) -> str:
        """Show recorded rows of one setup and select their recommended policy; returns what was loaded and which
        setup of the rows it shows (:func:`~sp_lab.bench.setups.select_setup`: ``setup``, else :attr:`setup`, else
        the newest), with the other setups there and their row counts.

        ``source``: a sweep store directory or a ``.parquet`` / ``.csv`` file, read as ``python -m sp_lab
        replay`` imports it (:func:`~sp_lab.bench.replay.read_as_replayed`: timings measured elsewhere are labelled
        ``replayed``); or a DataFrame of sweep rows, shown with the sources it carries (e.g. this session's own
        measured rows).
        ``None`` shows a demo made wholly of the performance model's rows for this model (a preset) and tp on
        H200s (:func:`predicted_rows`, ``source="predicted"``): sp_lab ships no recorded multi-GPU sweep. The
        recommendation is then the model's, said so; exporting it is refused (``export_config``).
        """
        if source is None:
            try:
                rows = predicted_rows(self.model, self.tp, self.token_counts, num_layers=self.num_layers,
                                      variants=[v for v in self.variants if v != TUNED])
            except ValueError as e:
                raise ValueError(
                    f"no predicted demo for {self.model!r} at tp={self.tp}: {e}. The performance model predicts "
                    "the presets on H200s: pick one and a tp that divides its heads (e.g. llama-3-70b, tp 8), or "
                    f"run a live sweep of {self.model!r}") from e
            what = (f"a demo: {rows.height} rows {PREDICTED} by the performance model for {self.tp}x H200 from "
                    "single-H200 kernel tables (no multi-GPU run; not measured)")
        elif isinstance(source, pl.DataFrame):
            rows, what = source, f"{source.height} rows"
        else:
            from sp_lab.bench.replay import read_as_replayed

            rows = read_as_replayed(source)
            what = f"{rows.height} rows recorded in {source}"
        if not rows.height:
            raise ValueError(f"nothing to replay: {what}")
        from sp_lab.bench.setups import select_setup

        shown, self.choice = select_setup(rows, setup if setup is not None else self.setup)
        self.set_rows(shown)
        self.use_recommended()
        return f"replayed {what}; source={self.source!r}; {self.choice.message()}"

    def overlay_prediction(self, model: str, gpu: str = "h200", tp: int = 8) -> str:
        """Draw the performance model's curves for ``model`` on ``tp`` x ``gpu`` beside the rows (``None``-like
        ``model=""`` clears them). They stay in :attr:`predicted`, apart from :attr:`rows`."""
        if not model:
            self.predicted = pl.DataFrame()
            return "predicted overlay cleared"
        from sp_lab.tuning.predict.advice import predict

        p = predict(model, tp, gpu, tokens=sorted(set(self.token_counts) | {1024, 4096, 16384}))
        self.predicted = p.rows
        return f"predicted overlay: {model}, {tp}x {p.target.gpu.label} (crossover {p.async_tp.describe()})"

    # ------------------------------------------------------------------ live sweep
    def check_sweep(self) -> None:
        """Refuse, before any rank starts, what the live sweep's ranks would refuse: a tp the model cannot take, a
        model that does not exist, token counts, variants or sweep arguments it cannot run
        (:func:`~sp_lab.bench.sweep.check_sweep_arguments`; raises ``SweepArgumentError``, ``TypeError`` or the
        model's own error, naming the value and what would work)."""
        from sp_lab.bench.sweep import LAUNCHER_ARGUMENTS, check_sweep_arguments

        passed = {k: v for k, v in self.sweep_kwargs.items() if k not in LAUNCHER_ARGUMENTS}  # backend, timeout
        check_sweep_arguments(self.model, self.tp, self.token_counts, self.variants,
                              {"config": self.config, "num_layers": self.num_layers, **passed},
                              store_dir=self.store_dir)

    def run_sweep(self, on_row: Callable[[Mapping[str, Any]], None] | None = None, *,
                  on_tally: Callable[[SweepTally], None] | None = None, progress: bool = False) -> SweepResult:
        """Measure this setup on ``tp`` fresh ranks; ``on_row(row)`` after each row lands and ``on_tally(tally)``
        when the count of points changes (reused from the store, measured now; both on the watcher thread).

        The sweep starts from its own rows: whatever was shown (a replay, the demo, another setup's sweep) is
        cleared first, never merged with this machine's new measurements; points the store already holds for
        this setup and machine are shown again at the end. Returns the :class:`~sp_lab.bench.sweep.SweepResult`.
        """
        from sp_lab.bench.sweep import launch_sweep

        if self.store_dir is None:
            raise ValueError(f"store_dir is None: a live sweep needs a sweep store directory (e.g. {DEFAULT_STORE!r})")
        self.check_sweep()  # before the rows shown are cleared: a refused sweep leaves the view as it was
        self.set_rows(pl.DataFrame())
        self.choice = None

        def count(tally: SweepTally) -> None:
            self.tally = tally
            if on_tally is not None:
                on_tally(tally)

        def deliver(row: Mapping[str, Any]) -> None:
            self.add_row(row)
            if on_row is not None:
                on_row(row)

        self.running, self.done, self.tally = True, 0, None
        try:
            result = launch_sweep(
                self.model, world_size=self.tp, store_dir=self.store_dir, token_counts=list(self.token_counts),
                variants=list(self.variants), on_row=deliver, on_tally=count, progress=progress,
                config=self.config, num_layers=self.num_layers, **self.sweep_kwargs,
            )
        finally:
            self.running = False
        if result.skipped:  # points measured by an earlier run: shown too, so a rerun is not an empty plot
            self._add_resumed_rows(result)
        return result

    def _add_resumed_rows(self, result: SweepResult) -> None:
        """Rows of the sweep's setup (:attr:`SweepResult.setup`: model, sizes, dtype, tp, device, backend, torch,
        compile settings) already in the store at its variants and token counts, not shown yet: the points the
        sweep reused (a store shared with other setups and devices holds their rows too: never merged with these)."""
        from sp_lab.bench.setups import SetupNotFoundError, select_setup
        from sp_lab.bench.store import SweepStore

        if result.setup is None:
            return
        stored = SweepStore(self.store_dir).read(skip_corrupt=True)
        stored = stored.filter(pl.col("source") == MEASURED, pl.col("variant").is_in(list(self.variants)),
                               pl.col("num_tokens").is_in(list(self.token_counts)))
        if not stored.height:
            return
        try:
            mine, _ = select_setup(stored, result.setup)
        except SetupNotFoundError:
            return
        shown = self.snapshot()
        if shown.height and "row_id" in shown.columns:
            mine = mine.filter(~pl.col("row_id").is_in(shown["row_id"].to_list()))
        if mine.height:
            with self._lock:
                self.rows = pl.concat([shown, mine], how="diagonal_relaxed") if shown.height else mine

    # ------------------------------------------------------------------ policy and derived tables
    def _reference_rows(self) -> pl.DataFrame:
        rows = self.snapshot()
        return rows.filter(pl.col("variant").is_in(list(REFERENCE_VARIANTS))) if rows.height else rows

    def policy(self) -> Policy:
        """The policy the controls select."""
        return Policy.gate(*self.shape, self.threshold)

    def tuned_config(self) -> LabConfig:
        """The base config gated to run :meth:`policy` (at the rows' tp once there are rows)."""
        rows = self.snapshot()
        tp = int(rows["tp"][0]) if rows.height and "tp" in rows.columns else self.tp
        return self.policy().to_config(dataclasses.replace(self.config, tp_size=tp))

    def regret(self) -> pl.DataFrame:
        """:func:`~sp_lab.tuning.regret.regret_table` of the tuned config (empty until a policy can be scored)."""
        try:
            return regret_table(self._reference_rows(), self.tuned_config(), warn=False)
        except ValueError:  # no rows yet, or the policy runs a variant not measured (yet)
            return pl.DataFrame()

    def traffic_regret(self) -> WeightedRegret:
        """The regret of the tuned config weighted by :attr:`workload` scheduled on the rows
        (:func:`sp_lab.serving.on_rows.weighted_regret`: each token count by its share of baseline's step time, the
        budget the largest count the rows cover). ``ValueError`` saying why there is none: no workload chosen, no
        regret yet, or rows that cannot price a serving step."""
        from sp_lab.serving.on_rows import weighted_regret

        if self.workload is None:
            raise ValueError("no workload chosen: pick one (workload='chat', ...) to weight the regret by its traffic")
        return weighted_regret(self._reference_rows(), self.regret(), self.workload)

    def gated(self) -> pl.DataFrame:
        """``num_tokens, latency_us, variant_run``: what the tuned config runs at each measured token count."""
        table = self.regret()
        if not table.height:
            return pl.DataFrame(schema={"num_tokens": pl.Int64, "latency_us": pl.Float64, "variant_run": pl.String})
        return table.select("num_tokens", "latency_us", "variant_run")

    def recommendation(self) -> Recommendation:
        """The recommended policy with its confidence over the rows so far.

        Raises ``ValueError`` saying what is missing: no rows yet (run a sweep first), or rows of one variant only.
        """
        if not self.snapshot().height:
            raise ValueError(f"no rows yet: run a sweep first ({_RUN_FIRST}), then ask again")
        try:
            return recommend(self._reference_rows(), self.config)
        except ValueError as e:
            raise ValueError(f"no recommendation from these rows yet: {e}") from e

    def recommendation_or_none(self) -> Recommendation | None:
        """:meth:`recommendation`, or ``None`` while the rows cannot make one (what the live view shows)."""
        try:
            return self.recommendation()
        except ValueError:
            return None

    def use_recommended(self) -> Recommendation | None:
        """Select the recommended policy (its shape and threshold); returns it (``None``: none can be made yet)."""
        rec = self.recommendation_or_none()
        if rec is None:
            return None
        steps = rec.policy.steps
        if len(steps) == 1:  # one program everywhere: "never" for a shape that starts with it
            variant = steps[0][1]
            self.shape = next((s for s in SHAPES.values() if s[0] == variant), (BASELINE, variant))
            self.threshold = None if self.shape[0] == variant else 1
        else:
            self.shape, self.threshold = (steps[0][1], steps[1][1]), steps[1][0]
        return rec

    def _setup(self) -> dict[str, Any]:
        """hidden size, dtype and tp of the rows (or of the live-sweep model before any row)."""
        rows = self.snapshot()
        if rows.height and {"hidden_size", "dtype", "tp"} <= set(rows.columns):
            r = rows.row(0, named=True)
            return {"hidden_size": int(r["hidden_size"]), "dtype": str(r["dtype"]), "tp": int(r["tp"])}
        from sp_lab.models.registry import resolve_config

        cfg = resolve_config(self.model, num_layers=self.num_layers)
        return {"hidden_size": cfg.hidden_size, "dtype": str(self.sweep_kwargs.get("dtype", "float32")),
                "tp": self.tp}

    def vllm_threshold(self, capability: tuple[int, int] = (9, 0)) -> int | None:
        """vLLM's bytes-per-GPU SP threshold for this setup on Hopper (``None``: vLLM leaves SP off)."""
        from sp_lab.vllm_releases import vllm_sp_min_token_num

        s = self._setup()
        return vllm_sp_min_token_num(s["hidden_size"], _activation_bytes(s["dtype"]), s["tp"], capability)

    # ------------------------------------------------------------------ export
    def data_hash(self) -> str:
        """:func:`sp_lab.bench.store.data_hash` of the rows shown."""
        return data_hash(self.snapshot())

    def export(self, directory: str | Path, *, allow_predicted: bool = False) -> Path:
        """Write the tuned config (one JSON per device / tp / model / dtype, with provenance); return its path.

        Rows of the demo replay are predicted: refused unless ``allow_predicted`` (the file then says
        ``source: predicted``)."""
        rows = self.snapshot()
        if not rows.height:
            raise ValueError(f"nothing to export: no rows yet; run a sweep first ({_RUN_FIRST})")
        rec = self.recommendation_or_none()
        return export_config(rows, self.tuned_config(), directory, chosen_in="sp_lab.tune widget",
                             recommendation=rec, allow_predicted=allow_predicted)


# ============================================================================================ the view
class Tuner:
    """The widget: setup controls, live latency plot with progress, policy and threshold, regret, Export.

    ``state`` (:class:`TunerState`) holds the data; ``plot`` is the live figure widget and ``figure`` the
    ``go.Figure`` it shows now.
    Display it as the last expression of a cell (or ``display(tuner)``).
    """

    def __init__(self, state: TunerState, *, export_dir: str | Path = DEFAULT_OUT) -> None:
        import ipywidgets as w

        from sp_lab.models.registry import available
        from sp_lab.viz.live_figure import LiveFigure

        self.state = state
        self._thread: threading.Thread | None = None
        self.model = w.Dropdown(options=sorted({*available(), state.model}), value=state.model, description="model")
        self.tp = w.BoundedIntText(value=state.tp, min=1, max=64, description="tp")
        self.tokens = w.Text(value=",".join(map(str, state.token_counts)), description="tokens")
        self.variants = w.SelectMultiple(options=list(REFERENCE_VARIANTS) + [TUNED], value=tuple(state.variants),
                                         description="variants", rows=4)
        # A button is as wide as its text and never shrinks below it (a row too narrow for its widgets squeezed "Use
        # recommended" to "Use recommend..."); rows wrap instead, at any notebook width.
        button = {"width": "auto", "flex": "0 0 auto"}
        wrap = {"flex_flow": "row wrap", "align_items": "center"}
        self.run_button = w.Button(description="Run sweep", button_style="primary", icon="play", layout=w.Layout(**button))
        # What it shows: the performance model's rows, not a recording (replay(path) replays recorded rows).
        self.demo_button = w.Button(description="Predicted demo (H200)", icon="calculator",
                                    tooltip="the performance model's predicted rows for the model and tp above on "
                                            "H200s: not measured", layout=w.Layout(**button))
        self.progress = w.IntProgress(value=0, min=0, max=max(state.total, 1), description="0 / 0")
        self.shape = w.Dropdown(options=list(SHAPES), value=self._shape_label(), description="policy")
        from sp_lab.serving.workloads import workload_names

        self.workload = w.Dropdown(options=[(PER_COUNT, ""), *((n, n) for n in workload_names())],
                                   value=state.workload or "", description="regret on",
                                   tooltip="weight the regret by a workload's share of step time per token count")
        self.slider = w.SelectionSlider(options=self._slider_options(), value=self._slider_value(),
                                        description="async_tp_min_tokens", continuous_update=False,
                                        style={"description_width": "initial"},
                                        layout=w.Layout(width="auto", flex="1 1 420px", min_width="320px"))
        self.recommend_button = w.Button(description="Use recommended", icon="star", layout=w.Layout(**button))
        self.export_dir = w.Text(value=str(export_dir), description="export to")
        self.export_button = w.Button(description="Export config", icon="download", layout=w.Layout(**button))
        self.status = w.HTML()
        self.regret_html = w.HTML()
        self.plot = LiveFigure()
        self.run_button.on_click(lambda _b: self.start_sweep())
        self.demo_button.on_click(lambda _b: self._demo_clicked())
        self.recommend_button.on_click(lambda _b: self.use_recommended())
        self.export_button.on_click(lambda _b: self._export_clicked())
        self._syncing = False  # the controls are being set from the state, not by the user
        self.slider.observe(lambda change: None if self._syncing else self.set_threshold(change["new"]), names="value")
        self.shape.observe(lambda change: self.set_shape(SHAPES[change["new"]]), names="value")
        self.workload.observe(lambda change: self.set_workload(change["new"] or None), names="value")
        setup = w.HBox([w.VBox([self.model, self.tp, self.tokens]), self.variants,
                        w.VBox([self.run_button, self.demo_button, self.progress])], layout=w.Layout(**wrap))
        tuning = w.HBox([self.shape, self.slider, self.recommend_button, self.workload], layout=w.Layout(**wrap))
        export = w.HBox([self.export_dir, self.export_button], layout=w.Layout(**wrap))
        self.widget = w.VBox([setup, self.plot, tuning, self.regret_html, export, self.status])
        self.redraw()

    @property
    def figure(self) -> go.Figure:
        """The latency figure shown now (what every view of :attr:`plot` draws)."""
        return self.plot.current

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # ------------------------------------------------------------------ controls <-> state
    def _shape_label(self) -> str:
        return next(k for k, v in SHAPES.items() if v == tuple(self.state.shape))

    def _slider_options(self) -> list[str]:
        rows = self.state.snapshot()
        measured = set(rows["num_tokens"].to_list()) if rows.height else set()
        # The threshold in force is an option, so the slider says what the config's legend entry says: before a
        # sweep the default (128) need not be a token count of the sweep, and the slider read "never".
        chosen = {self.state.threshold} if self.state.threshold is not None else set()
        return [str(t) for t in sorted(measured | set(self.state.token_counts) | chosen)] + [NEVER]

    def _slider_value(self) -> str:
        options = self._slider_options()
        value = describe_threshold(self.state.threshold)
        if value in options:
            return value
        # a threshold between measured counts acts like the next measured count above it
        above = [o for o in options[:-1] if int(o) >= int(value)]
        return above[0] if above else NEVER

    def _sync_controls(self) -> None:
        options, value = self._slider_options(), self._slider_value()
        if list(self.slider.options) != options:
            # New options move the slider to the first one, which would reach set_threshold as a user's choice.
            self._syncing = True
            try:
                self.slider.options = options
            finally:
                self._syncing = False
        self.slider.value = value
        self.shape.value = self._shape_label()

    # ------------------------------------------------------------------ actions
    def _read_setup(self) -> None:
        tokens = [int(t) for t in self.tokens.value.replace(" ", "").split(",") if t]
        if not tokens or min(tokens) < 1:
            raise ValueError(f"tokens: expected comma-separated positive ints, got {self.tokens.value!r}")
        self.state.model, self.state.tp = self.model.value, int(self.tp.value)
        self.state.token_counts, self.state.variants = sorted(set(tokens)), list(self.variants.value)
        if self.state.config.tp_size != self.state.tp:
            self.state.config = dataclasses.replace(self.state.config, tp_size=self.state.tp)

    def run_sweep(self) -> SweepResult:
        """Run the live sweep in this thread (blocking); the plot and progress update per row.

        A mistake knowable before the ranks start (a tp the model cannot take, a bad token count) is raised here at
        once; whatever fails, the status line says so (it never stays at "sweeping ...")."""
        try:
            self._read_setup()
            self.state.check_sweep()
            self.progress.max, self.progress.value = max(self.state.total, 1), 0
            self._sync_controls()
            self._say(f"sweeping {self.state.model} on {self.state.tp} ranks ...")
            result = self.state.run_sweep(on_row=lambda _row: self.redraw(), on_tally=lambda _t: self._show_tally())
        except Exception as e:
            self.redraw()
            self._say(f"sweep failed: {type(e).__name__}: {html.escape(str(e))}", error=True)
            raise
        self.redraw()
        tally = self.state.tally
        done = tally.describe() if tally is not None else f"{len(result.rows)} new rows, {result.skipped} reused"
        self._say(f"sweep done: {done} (store {result.store_dir})")
        return result

    def _show_tally(self) -> None:
        """The sweep's count of points (reused from which sweep, measured now) in the bar and the status line."""
        tally = self.state.tally
        if tally is not None and self.state.running:
            self._update_progress()
            self._say(f"sweeping {self.state.model} on {self.state.tp} ranks: {tally.describe()}")

    def _update_progress(self) -> None:
        """The bar counts every point of the sweep: reused ones too (the status line says from where)."""
        state, tally = self.state, self.state.tally
        done, total = (tally.reused + tally.elsewhere + state.done, tally.total) if tally is not None else (
            state.done, state.total)
        self.progress.max = max(total, 1)
        self.progress.value = min(done, self.progress.max)
        self.progress.description = f"{done} / {total}" if state.running or done else ""

    def start_sweep(self) -> None:
        """The Run button: :meth:`run_sweep` in a background thread so the notebook stays usable."""
        if self._thread is not None and self._thread.is_alive():
            self._say("a sweep is already running")
            return

        def work() -> None:
            try:
                self.run_sweep()
            except Exception:  # noqa: BLE001, S110 - run_sweep said it in the status line; a thread has no cell
                pass

        self._thread = threading.Thread(target=work, name="sp_lab-tuner-sweep", daemon=True)
        self._thread.start()

    def replay(self, source: str | Path | pl.DataFrame | None = None, *,
               setup: Setup | Mapping[str, Any] | None = None) -> None:
        """Show recorded rows of one setup (see :meth:`TunerState.replay`) and select their recommended policy;
        the status line says which setup it shows and lists the others with their row counts."""
        self._read_setup()
        message = self.state.replay(source, setup=setup)
        self._sync_controls()
        self.redraw()
        self._say(html.escape(message).replace("\n", "<br>"))

    def _demo_clicked(self) -> None:
        """The "Predicted demo (H200)" button: a click has no cell to raise into; the status line shows the error."""
        try:
            self.replay(None)
        except Exception as e:  # noqa: BLE001 - shown in the widget, as start_sweep does
            self._say(f"predicted demo failed: {type(e).__name__}: {e}", error=True)

    def overlay_prediction(self, model: str, gpu: str = "h200", tp: int = 8) -> None:
        """Overlay predicted curves for ``model`` on ``tp`` x ``gpu`` (``model=""`` clears them) and redraw."""
        try:
            self._say(self.state.overlay_prediction(model, gpu, tp))
        except ValueError as e:
            self._say(str(e), error=True)
        self.redraw()

    def set_threshold(self, value: int | str | None) -> None:
        """Move the threshold (the slider calls this; ``"never"`` or ``None``): redraw curve and regret."""
        self.state.threshold = None if value in (None, NEVER) else int(value)
        if self.slider.value != self._slider_value():
            self.slider.value = self._slider_value()
        self.redraw()

    def set_shape(self, shape: tuple[str, str]) -> None:
        """Choose which variants run below / from the threshold: redraw curve and regret."""
        self.state.shape = tuple(shape)
        self.redraw()

    def set_workload(self, name: str | None) -> None:
        """Weight the regret by a named workload (``None``: per token count only); an unknown name is refused,
        naming the workloads. Redraws the regret panel."""
        if name is not None:
            from sp_lab.serving.workloads import workload

            workload(name)
        self.state.workload = name
        if (self.workload.value or None) != name:
            self.workload.value = name or ""
        self.redraw()

    def use_recommended(self) -> None:
        """Select the recommended policy (shape and threshold)."""
        if self.state.use_recommended() is not None:
            self._sync_controls()
            self.redraw()

    def export(self, *, allow_predicted: bool = False) -> Path:
        """Write the tuned config to the export directory; the status line says what the file says.

        Raises ``ValueError`` in the calling cell when there is nothing to export (it says to run a sweep first),
        or when the rows are the demo's predicted ones and ``allow_predicted`` is not given.
        """
        try:
            path = self.state.export(self.export_dir.value, allow_predicted=allow_predicted)
        except ValueError as e:
            self._say(f"export failed: {e}", error=True)
            raise
        config = self.state.tuned_config()
        said = f" (from {PREDICTED} rows: not measured)" if self.state.source == PREDICTED else ""
        self._say(f"exported {Policy.of(config).name} (async_tp_min_tokens={threshold_text(config)}){said} "
                  f"to <code>{path}</code>")
        print(describe_file(path))  # what the file does in vLLM, model code and torch.compile, in the cell
        return path

    def _export_clicked(self) -> None:
        """The Export button: a click has no cell to raise into; the status line shows the error."""
        try:
            self.export()
        except ValueError:
            pass  # already said in the status line

    # ------------------------------------------------------------------ drawing
    def _vllm(self) -> int | None:
        if not self._on_gpu():  # a CPU toy: vLLM's bytes-per-GPU rule says nothing about it
            return None
        try:
            return self.state.vllm_threshold()
        except (ValueError, OSError):
            return None

    def _title(self) -> str | None:
        """With rows: the figure's own title, under which it names their model, tp, device, torch and source
        (from the rows, not from the setup controls, which a replay does not change). Before any row: the setup."""
        if self.state.snapshot().height:
            return None
        return f"{self.state.model} tp={self.state.tp}: forward latency vs tokens (no rows yet)"

    def _say(self, text: str, *, error: bool = False) -> None:
        self.status.value = f"<span style='color:{'#b00' if error else '#333'}'>{text}</span>"

    def redraw(self) -> None:
        """Refresh plot, progress, recommendation and regret table from :attr:`state`."""
        from sp_lab.viz.latency import plot_latency

        state = self.state
        try:
            rec, why = state.recommendation(), ""
        except ValueError as e:  # what is missing, in the regret panel's place
            rec, why = None, str(e)
        fig = plot_latency(state.snapshot(), config=state.tuned_config(), vllm_min_tokens=self._vllm(),
                           title=self._title())
        if rec is not None and rec.policy != state.policy():
            for t in rec.policy.thresholds:
                fig.add_shape(type="line", x0=t, x1=t, y0=0, y1=1, xref="x", yref="y domain",
                                      name="recommended", line={"color": "#2ca02c", "dash": "dashdot", "width": 1.5})
        if state.predicted.height:  # drawn apart (dashed, own legend group), not part of the regret above
            from sp_lab.viz.predicted import add_predicted_curves

            add_predicted_curves(fig, state.predicted)
        self.plot.show(fig)
        self._update_progress()
        self.regret_html.value = self._regret_html(rec, why)

    def _regret_html(self, rec: Recommendation | None, why: str = "") -> str:
        if rec is None:
            return f"<i>{html.escape(why)}</i>"
        table = self.state.regret()
        right = "style='text-align:right;padding:1px 10px'"
        left = "style='text-align:left;padding:1px 10px'"
        weighted, traffic_line = self._traffic_regret()
        share = {} if weighted is None else weighted.weights
        cells = "".join(
            f"<tr><td {right}>{r['num_tokens']}</td><td {left}>{r['variant_run']}</td>"
            f"<td {right}>{r['latency_us']:.1f}</td><td {left}>{r['best_variant']}</td>"
            f"<td {right}>{r['best_us']:.1f}</td><td {right}>{100 * r['regret_rel']:.1f}%</td>"
            + (f"<td {right}>{100 * share.get(r['num_tokens'], 0.0):.1f}%</td>" if share else "") + "</tr>"
            for r in table.iter_rows(named=True))
        heads = "".join(f"<th {right if i in (0, 2, 4, 5) else left}>{REGRET_HEADERS[c]}</th>"
                        for i, c in enumerate(REGRET_COLUMNS))
        if weighted is not None:
            heads += f"<th {right}>share of {weighted.priced.workload} step time</th>"
        total = float(table["regret_rel"].sum()) if table.height else float("nan")
        worst = float(table["regret_rel"].max()) if table.height else float("nan")
        said = (" <b>(from predicted rows: the performance model's choice, not measured)</b>"
                if self.state.source == PREDICTED else "")
        return (f"<b>recommended:</b> {rec.summary()}{said}<br><i>{rec.noise_line()}</i><br>"
                f"<b>rows:</b> {html.escape(self.state.provenance())}<br>"
                f"<b>selected ({self.state.policy().name}):</b> worst regret {100 * worst:.1f}%, summed over the "
                f"token counts {100 * total:.1f}%{self._vllm_line()}{traffic_line}"
                "<table style='border-collapse:collapse;margin-top:4px'>"
                f"<tr style='border-bottom:1px solid #999'>{heads}</tr>{cells}</table>")

    def _traffic_regret(self) -> tuple[WeightedRegret | None, str]:
        """The regret weighted by the chosen workload and its line for the panel ("" without a workload)."""
        if self.state.workload is None:
            return None, ""
        try:
            weighted = self.state.traffic_regret()
        except ValueError as e:
            return None, f"<br><b>on {self.state.workload} traffic:</b> <i>not weighted: {html.escape(str(e))}</i>"
        return weighted, f"<br><b>weighted by traffic:</b> {html.escape(weighted.describe())}"

    def _vllm_line(self) -> str:
        """vLLM's own SP rule for comparison, only where it means something: GPU rows (measured or predicted)."""
        vllm = self._vllm()
        if not self._on_gpu():
            return ""
        rule = f"SP from {vllm} tokens" if vllm is not None else "SP off (hidden size below its limit)"
        return f"; vLLM's own rule on Hopper for this model and tp: {rule}"

    def _on_gpu(self) -> bool:
        """The rows shown come from (or predict) a GPU: vLLM's Hopper rule applies to them."""
        rows = self.state.snapshot()
        if not rows.height or "device_name" not in rows.columns:
            return False
        return self.state.source == PREDICTED or not str(rows["device_name"][0]).lower().startswith("cpu")


def tune(model: str = "toy", *, tp: int = 2, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
         variants: Sequence[str] = REFERENCE_VARIANTS, num_layers: int | None = None,
         store_dir: str | Path | None = DEFAULT_STORE, config: LabConfig | None = None,
         threshold: int | None = None, export_dir: str | Path = DEFAULT_OUT,
         replay: str | Path | pl.DataFrame | bool | None = None, setup: Setup | Mapping[str, Any] | None = None,
         workload: str | None = None, **sweep_kwargs: Any) -> Tuner:
    """The policy tuner widget (see the module docstring).

    Mistakes knowable now are refused here, in the calling cell, not when the sweep starts: a model that does not
    exist (a checkpoint path: "not found" with the path resolved), a tp it cannot take, token counts, variants or
    sweep arguments the ranks would refuse (:meth:`TunerState.check_sweep`).

    Args:
        model, tp, token_counts, variants, num_layers: the live sweep's setup (editable in the widget).
        store_dir: sweep store of live rows (a rerun resumes from it). The default is the CLI's store in the
            project (:func:`sp_lab.paths.default_store`), wherever the kernel runs; ``None``: no live sweep.
        config: base ``LabConfig`` the policy gates (default ``LabConfig(tp_size=tp)``).
        threshold: initial threshold (default: the config's ``async_tp_min_tokens``).
        export_dir: where Export writes the tuned config (default: the project's ``out/``, as the CLI).
        replay: rows to show at once: a store dir or a parquet file (recorded rows, labelled ``replayed``), a
            DataFrame, or ``True`` for a demo of the performance model's rows on H200s (``source="predicted"``;
            a preset only). ``None`` starts empty (run a sweep, or press "Predicted demo (H200)" for the demo).
        setup: which setup of the replayed rows to show (a store holds many): some of its fields
            (``{"dtype": "bfloat16", "num_layers": 1}``, :data:`sp_lab.bench.setups.SETUP_FIELDS`); ``None``: the
            newest. The status line says which it shows and lists the others with their row counts.
        workload: a named workload (``"chat"``, ``"summarization"``, ...: :mod:`sp_lab.serving.workloads`) the
            regret panel also weighs the regret by: each token count by its share of baseline's step time when the
            workload is scheduled on the rows (budget: the largest count they cover). ``None``: per token count only.
        **sweep_kwargs: passed to :func:`sp_lab.bench.sweep.run_sweep` (``warmup``, ``repeats``, ``budget_s``, ...).
    """
    from sp_lab.models.registry import resolve_config
    from sp_lab.paths import default_out, default_store

    # The default spellings mean the project's folders, not the kernel's directory (notebooks/).
    store_dir = default_store() if store_dir == DEFAULT_STORE else store_dir
    export_dir = default_out() if export_dir == DEFAULT_OUT else export_dir
    state = TunerState(model=model, tp=tp, token_counts=sorted(set(token_counts)), variants=list(variants),
                       num_layers=num_layers, store_dir=None if store_dir is None else str(store_dir),
                       config=config, sweep_kwargs=dict(sweep_kwargs), setup=setup)
    if store_dir is not None:  # a live sweep can start: refuse now what its ranks would refuse
        state.check_sweep()
    else:  # replay only: the model must still exist ("did you mean", a checkpoint path not found)
        resolve_config(model, num_layers=num_layers)
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
        raise ValueError(f"threshold={threshold!r}: give a token count >= 1 (the first that runs the variant above "
                         "it), or None for the config's async_tp_min_tokens")
    if Path(export_dir).exists() and not Path(export_dir).is_dir():
        raise ValueError(f"export_dir={str(export_dir)!r} is a file ({Path(export_dir).resolve()}); give a directory "
                         "(created on the first export)")
    if setup is not None:
        from sp_lab.bench.setups import check_query

        check_query(setup.to_dict() if hasattr(setup, "to_dict") else setup)  # a misspelt field, named now
    if workload is not None:
        from sp_lab.serving.workloads import workload as named_workload

        named_workload(workload)  # an unknown name, with the names that exist
    state.workload = workload
    state.threshold = threshold if threshold is not None else state.config.async_tp_min_tokens
    tuner = Tuner(state, export_dir=export_dir)
    if replay is not None and replay is not False:
        tuner.replay(None if replay is True else replay)
    return tuner


__all__ = ["SHAPES", "Tuner", "TunerState", "predicted_rows", "tune"]
