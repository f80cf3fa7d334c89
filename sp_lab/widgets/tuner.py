"""The ``async_tp_min_tokens`` tuner for JupyterLab: ``sp_lab.tune(...)``.

Two layers, so that everything but the drawing is testable without a browser:

- :class:`TunerState` holds the rows (live, replayed or simulated), the chosen threshold and the
  setup, and answers every question the view asks: the gated curve, its regret against the best
  variant at each token count, the recommended threshold, vLLM's reference threshold, the tuned
  :class:`~sp_lab.config.LabConfig` and its export. It calls :mod:`sp_lab.tuning.threshold`,
  :mod:`sp_lab.bench.sweep` and :mod:`sp_lab.config`; it owns no latency logic of its own.
- :class:`Tuner` is the ipywidgets view: controls, a plotly ``FigureWidget`` refreshed with
  :func:`sp_lab.viz.latency.update_latency_figure` as rows arrive, a threshold slider, the regret
  table and an Export button.

Sources of rows: a live sweep (:meth:`TunerState.run_sweep`, ranks started with
:func:`sp_lab.bench.sweep.launch_sweep`: CPU gloo ranks here, one GPU per rank where there are
enough), or a replay (:meth:`TunerState.replay`) of a recorded store / parquet file, or, when no
recorded GPU sweep exists, the what-if model's prediction from the H200 matmul data in ``sp_lab/data/h200``
(``source="simulated"``, labelled so everywhere).

    import sp_lab
    tuner = sp_lab.tune("toy", tp=2, token_counts=[3, 16, 64])
    tuner                      # shows the widget
    tuner.run_sweep()          # points appear as they are measured (blocking; the button runs it in a thread)
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from sp_lab.tuning.threshold import ABOVE, BELOW, gated_curve, recommend_threshold, regret_table

GATE = (BELOW, ABOVE)
"""(variant below ``async_tp_min_tokens``, variant at or above it): what ``LabConfig`` gating runs."""

DEFAULT_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token counts a live sweep measures unless told otherwise."""

# What the latency plot needs that the what-if model does not produce (it has no spread, no torch run).
_SIMULATED_FILL = {"p10_us": None, "p90_us": None, "torch_version": "n/a (simulated)", "boundary": "sharded"}


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype).removeprefix("torch."), 2)


def simulated_rows(model: str, tp: int, token_counts: Sequence[int], *, num_layers: int | None = None,
                   variants: Sequence[str] = ("baseline", "sp", "sp+async_tp")) -> pl.DataFrame:
    """The what-if model's sweep (:func:`sp_lab.tuning.simulate.predict_sweep`) in sweep-row columns.

    Rows say ``source="simulated"``; ``p10_us``/``p90_us`` equal the prediction (no spread).
    """
    from sp_lab.tuning.simulate import predict_sweep

    df = predict_sweep(model, tp, token_counts, num_layers=num_layers)
    df = df.filter(pl.col("variant").is_in(list(variants)))
    fill = {k: (pl.col("latency_us") if v is None else pl.lit(v)) for k, v in _SIMULATED_FILL.items()}
    return df.with_columns(**fill)


@dataclasses.dataclass(kw_only=True)
class TunerState:
    """Everything the tuner shows, as plain data (no widgets): rows, threshold, setup and derived tables."""

    model: str = "toy"
    """Model name for a live sweep (``sp_lab.models.build``); replayed rows carry their own."""
    tp: int = 2
    """Tensor-parallel ranks of a live sweep."""
    token_counts: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_TOKEN_COUNTS))
    """Token counts a live sweep measures."""
    variants: list[str] = dataclasses.field(default_factory=lambda: ["baseline", "sp", "sp+async_tp"])
    """Variants a live sweep measures (the gate needs ``baseline`` and ``sp+async_tp``)."""
    num_layers: int | None = None
    """Decoder layers of the live-sweep model (``None``: the model's own)."""
    store_dir: str | None = None
    """Sweep store of a live sweep (rows persist there and a rerun resumes)."""
    config: Any = None
    """Base :class:`~sp_lab.config.LabConfig` (default ``LabConfig(tp_size=tp)``); the export gates it."""
    sweep_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra arguments for :func:`~sp_lab.bench.sweep.run_sweep` (``warmup``, ``repeats``, ``dtype``, ...)."""
    threshold: int = 128
    """The current ``async_tp_min_tokens`` (the slider)."""
    rows: pl.DataFrame = dataclasses.field(default_factory=pl.DataFrame)
    """All rows shown, one source at a time (measured, replayed or simulated)."""
    running: bool = False
    """A live sweep is in progress."""
    done: int = 0
    """Points measured by the current live sweep."""

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
        """Show exactly ``rows`` (one source; several sources are refused: never compared unlabelled)."""
        if rows.height and "source" in rows.columns and rows["source"].n_unique() > 1:
            raise ValueError(
                f"rows mix sources {sorted(rows['source'].unique().to_list())}; filter to one first, e.g. "
                "rows.filter(pl.col('source') == 'replayed')"
            )
        with self._lock:
            self.rows = rows

    def replay(self, source: str | Path | pl.DataFrame | None = None) -> str:
        """Show recorded rows; returns a line saying what was loaded.

        ``source``: a sweep store directory, a ``.parquet`` file or a DataFrame of sweep rows. ``None``
        uses the what-if model's prediction for this model and tp from the measured H200 matmul data
        (``sp_lab/data/h200``): the only GPU data shipped with sp_lab until multi-GPU sweeps are recorded.
        """
        if source is None:
            rows = simulated_rows(self.model, self.tp, self.token_counts, num_layers=self.num_layers,
                                  variants=[v for v in self.variants if v != "tuned"])
            what = f"simulated from measured H200 matmuls ({rows.height} rows; no recorded multi-GPU sweep)"
        elif isinstance(source, pl.DataFrame):
            rows, what = source, f"{source.height} rows"
        else:
            path = Path(source)
            if path.is_dir():
                from sp_lab.bench.store import SweepStore

                rows = SweepStore(path).read()
            elif path.suffix == ".parquet":
                rows = pl.read_parquet(path)
            else:
                raise ValueError(f"cannot replay {str(path)!r}: expected a sweep store directory or a .parquet file")
            what = f"{rows.height} rows from {path}"
        if not rows.height:
            raise ValueError(f"nothing to replay: {what}")
        self.set_rows(rows)
        self.threshold = self.recommendation().threshold if self.can_recommend() else self.threshold
        return f"replayed {what}; source={self.source!r}"

    # ------------------------------------------------------------------ live sweep
    def run_sweep(self, on_row: Any = None, *, progress: bool = False) -> Any:
        """Measure this setup on ``tp`` fresh ranks; ``on_row(row)`` after each row lands (watcher thread).

        Rows of an earlier source are cleared first. Returns the :class:`~sp_lab.bench.sweep.SweepResult`.
        """
        from sp_lab.bench.sweep import launch_sweep

        if self.store_dir is None:
            raise ValueError("store_dir is None: a live sweep needs a sweep store directory (e.g. 'data/sweeps')")
        if self.source not in (None, "measured"):
            self.set_rows(pl.DataFrame())

        def deliver(row: Mapping[str, Any]) -> None:
            self.add_row(row)
            if on_row is not None:
                on_row(row)

        self.running, self.done = True, 0
        try:
            return launch_sweep(
                self.model, world_size=self.tp, store_dir=self.store_dir, token_counts=list(self.token_counts),
                variants=list(self.variants), on_row=deliver, progress=progress, config=self.config,
                num_layers=self.num_layers, **self.sweep_kwargs,
            )
        finally:
            self.running = False

    # ------------------------------------------------------------------ derived tables
    def _tuning_rows(self) -> pl.DataFrame:
        with self._lock:
            return self.rows

    def _gate_rows(self) -> pl.DataFrame:
        """Rows at token counts where both gated variants exist (a sweep in progress has half-done ones)."""
        rows = self._tuning_rows()
        if not rows.height:
            return rows
        complete = (rows.filter(pl.col("variant").is_in(list(GATE))).group_by("num_tokens")
                    .agg(pl.col("variant").n_unique().alias("n")).filter(pl.col("n") == len(GATE)))
        return rows.filter(pl.col("num_tokens").is_in(complete["num_tokens"].implode()))

    def can_recommend(self) -> bool:
        """Both gated variants have rows at one token count at least."""
        return self._gate_rows().height > 0

    def gated(self) -> pl.DataFrame:
        """``num_tokens, latency_us, variant`` of the gated curve at the current threshold (empty if unknown)."""
        if not self.can_recommend():
            return pl.DataFrame(schema={"num_tokens": pl.Int64, "latency_us": pl.Float64, "variant": pl.String})
        return gated_curve(self._gate_rows(), self.threshold)

    def regret(self) -> pl.DataFrame:
        """Per token count: ``gated_us, best_us, best_variant, regret_us, regret_rel`` at the current threshold."""
        if not self.can_recommend():
            return pl.DataFrame()
        return regret_table(self._gate_rows(), self.threshold)

    def recommendation(self) -> Any:
        """The least-regret threshold (:class:`~sp_lab.tuning.threshold.Recommendation`) over the rows so far."""
        return recommend_threshold(self._gate_rows())

    def _setup(self) -> dict[str, Any]:
        """hidden size, dtype and tp of the rows (or of the live-sweep model before any row)."""
        rows = self._tuning_rows()
        if rows.height and {"hidden_size", "dtype", "tp"} <= set(rows.columns):
            r = rows.row(0, named=True)
            return {"hidden_size": int(r["hidden_size"]), "dtype": str(r["dtype"]), "tp": int(r["tp"])}
        from sp_lab.models.registry import resolve_config

        cfg = resolve_config(self.model, num_layers=self.num_layers)
        return {"hidden_size": cfg.hidden_size, "dtype": str(self.sweep_kwargs.get("dtype", "float32")),
                "tp": self.tp}

    def vllm_threshold(self, capability: tuple[int, int] = (9, 0)) -> int | None:
        """vLLM's bytes-per-GPU SP threshold for this setup on Hopper (``None``: vLLM leaves SP off)."""
        from sp_lab.tuning.threshold import vllm_reference_threshold

        s = self._setup()
        return vllm_reference_threshold(s["hidden_size"], _dtype_bytes(s["dtype"]), s["tp"], capability)

    # ------------------------------------------------------------------ export
    def tuned_config(self) -> Any:
        """The base config gated at the current threshold (SP + AsyncTP from it on).

        At the recommended threshold of a "never fuse" recommendation, SP and AsyncTP are switched off
        rather than gated just past the largest measured token count.
        """
        from sp_lab.cli import tuned_config

        rec = self.recommendation() if self.can_recommend() else None
        never = rec is not None and rec.never_fuse and self.threshold == rec.threshold
        return tuned_config(self.config, self.threshold, never_fuse=never, tp_size=self._setup()["tp"])

    def data_hash(self) -> str:
        """Hash of the rows the threshold was chosen on (row ids when present, else the rows' content)."""
        rows = self._tuning_rows()
        if "row_id" in rows.columns and rows["row_id"].null_count() == 0:
            text = "\n".join(sorted(rows["row_id"].to_list()))
        else:
            text = "\n".join(sorted(map(str, rows.select(sorted(rows.columns)).iter_rows())))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def export(self, directory: str | Path) -> Path:
        """Write the tuned config (one JSON per device / tp / model / dtype, with provenance); return its path."""
        from sp_lab.config import export_tuned_config

        rows = self._tuning_rows()
        if not rows.height:
            raise ValueError("no rows yet: run a sweep or replay recorded rows before exporting")
        r = rows.row(0, named=True)
        extra = {"source": r.get("source"), "sweep_rows": rows.height, "chosen_in": "sp_lab.tune widget"}
        if self.can_recommend():
            rec = self.recommendation()
            extra["recommended_async_tp_min_tokens"] = rec.threshold
        return export_tuned_config(
            self.tuned_config(), directory=directory, device_name=str(r["device_name"]),
            model_spec={"name": str(r["model"]), "hidden_size": int(r["hidden_size"]),
                        "num_layers": int(r["num_layers"])},
            dtype=str(r["dtype"]), data_hash=self.data_hash(), extra_provenance=extra,
        )


# ============================================================================================ the view
def _gated_trace_data(state: TunerState) -> tuple[list, list]:
    g = state.gated()
    return g["num_tokens"].to_list(), g["latency_us"].to_list()


class Tuner:
    """The widget: setup controls, live latency plot with progress, threshold slider, regret, Export.

    ``state`` (:class:`TunerState`) holds the data; ``figure`` is the plotly ``FigureWidget``.
    Display it as the last expression of a cell (or ``display(tuner)``).
    """

    def __init__(self, state: TunerState, *, export_dir: str | Path = "configs") -> None:
        import ipywidgets as w

        from sp_lab.models.registry import available
        from sp_lab.viz.latency import plot_latency

        self.state = state
        self._thread: threading.Thread | None = None
        models = available()
        self.model = w.Dropdown(options=sorted({*models, state.model}), value=state.model, description="model")
        self.tp = w.BoundedIntText(value=state.tp, min=1, max=64, description="tp")
        self.tokens = w.Text(value=",".join(map(str, state.token_counts)), description="tokens")
        self.variants = w.SelectMultiple(options=["baseline", "sp", "sp+async_tp", "tuned"],
                                         value=tuple(state.variants), description="variants", rows=4)
        self.run_button = w.Button(description="Run sweep", button_style="primary", icon="play")
        self.replay_button = w.Button(description="Replay recorded", icon="history")
        self.progress = w.IntProgress(value=0, min=0, max=max(state.total, 1), description="0 / 0")
        hi = max(state.token_counts) + 1
        self.slider = w.IntSlider(value=min(state.threshold, hi), min=1, max=hi, description="async_tp_min_tokens",
                                  continuous_update=False, style={"description_width": "initial"},
                                  layout=w.Layout(width="520px"))
        self.recommend_button = w.Button(description="Use recommended", icon="star")
        self.export_dir = w.Text(value=str(export_dir), description="export to")
        self.export_button = w.Button(description="Export config", icon="download")
        self.status = w.HTML()
        self.regret_html = w.HTML()
        self.figure = plot_latency(state.rows, async_tp_min_tokens=state.threshold, gate=GATE,
                                   vllm_min_tokens=self._vllm(), widget=True, title=self._title())
        # The gated curve itself (the regret subplot shows only its regret), on the latency axes.
        self.figure.add_scatter(x=[], y=[], name="gated", meta="gated", mode="lines", xaxis="x", yaxis="y",
                                line={"color": "black", "width": 3})
        self.run_button.on_click(lambda _b: self.start_sweep())
        self.replay_button.on_click(lambda _b: self.replay())
        self.recommend_button.on_click(lambda _b: self.use_recommended())
        self.export_button.on_click(lambda _b: self.export())
        self.slider.observe(lambda change: self.set_threshold(change["new"]), names="value")
        setup = w.HBox([w.VBox([self.model, self.tp, self.tokens]), self.variants,
                        w.VBox([self.run_button, self.replay_button, self.progress])])
        tuning = w.HBox([self.slider, self.recommend_button])
        export = w.HBox([self.export_dir, self.export_button])
        self.widget = w.VBox([setup, self.figure, tuning, self.regret_html, export, self.status])
        self.redraw()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # ------------------------------------------------------------------ actions
    def _read_setup(self) -> None:
        tokens = [int(t) for t in self.tokens.value.replace(" ", "").split(",") if t]
        if not tokens or min(tokens) < 1:
            raise ValueError(f"tokens: expected comma-separated positive ints, got {self.tokens.value!r}")
        self.state.model, self.state.tp = self.model.value, int(self.tp.value)
        self.state.token_counts, self.state.variants = sorted(set(tokens)), list(self.variants.value)
        if self.state.config.tp_size != self.state.tp:
            self.state.config = dataclasses.replace(self.state.config, tp_size=self.state.tp)

    def run_sweep(self) -> Any:
        """Run the live sweep in this thread (blocking); the plot and progress update per row."""
        self._read_setup()
        self.progress.max, self.progress.value = max(self.state.total, 1), 0
        self.slider.max = max(self.state.token_counts) + 1
        self._say(f"sweeping {self.state.model} on {self.state.tp} ranks ...")
        result = self.state.run_sweep(on_row=lambda _row: self.redraw())
        self.redraw()
        self._say(f"sweep done: {len(result.rows)} new rows, {result.skipped} already in {result.store_dir}")
        return result

    def start_sweep(self) -> None:
        """The Run button: :meth:`run_sweep` in a background thread so the notebook stays usable."""
        if self._thread is not None and self._thread.is_alive():
            self._say("a sweep is already running")
            return

        def work() -> None:
            try:
                self.run_sweep()
            except Exception as e:  # noqa: BLE001 - shown in the widget; a thread has no one to raise to
                self._say(f"sweep failed: {type(e).__name__}: {e}", error=True)

        self._thread = threading.Thread(target=work, name="sp_lab-tuner-sweep", daemon=True)
        self._thread.start()

    def replay(self, source: str | Path | pl.DataFrame | None = None) -> None:
        """Show recorded rows (see :meth:`TunerState.replay`) and jump to their recommended threshold."""
        self._read_setup()
        message = self.state.replay(source)
        tokens = sorted(set(self.state.rows["num_tokens"].to_list()))
        self.slider.max = tokens[-1] + 1
        self.slider.value = min(self.state.threshold, self.slider.max)
        self.redraw()
        self._say(message)

    def set_threshold(self, value: int) -> None:
        """Move the gate (the slider calls this): redraw the gated curve and its regret."""
        self.state.threshold = int(value)
        if self.slider.value != value:
            self.slider.value = int(value)
        self.redraw()

    def use_recommended(self) -> None:
        """Move the slider to the recommended threshold."""
        if self.state.can_recommend():
            self.set_threshold(min(self.state.recommendation().threshold, self.slider.max))

    def export(self) -> Path | None:
        """Write the tuned config to the export directory; the path is shown in the status line."""
        try:
            path = self.state.export(self.export_dir.value)
        except ValueError as e:
            self._say(f"export failed: {e}", error=True)
            return None
        self._say(f"exported async_tp_min_tokens={self.state.threshold} to <code>{path}</code>")
        return path

    # ------------------------------------------------------------------ drawing
    def _vllm(self) -> int | None:
        try:
            return self.state.vllm_threshold()
        except (ValueError, OSError):
            return None

    def _title(self) -> str:
        src = self.state.source or "no rows yet"
        return f"{self.state.model} tp={self.state.tp}: latency vs tokens ({src})"

    def _say(self, text: str, *, error: bool = False) -> None:
        self.status.value = f"<span style='color:{'#b00' if error else '#333'}'>{text}</span>"

    def redraw(self) -> None:
        """Refresh plot, progress, recommendation and regret table from :attr:`state`."""
        from sp_lab.viz.latency import update_latency_figure

        state = self.state
        rows = state._tuning_rows()
        rec = state.recommendation() if state.can_recommend() else None
        # Markers: the slider's threshold, the recommended one and vLLM's rule.
        update_latency_figure(self.figure, rows, async_tp_min_tokens=state.threshold, gate=GATE,
                              vllm_min_tokens=self._vllm(), title=self._title())
        if rec is not None and rec.threshold != state.threshold:
            self.figure.add_shape(type="line", x0=rec.threshold, x1=rec.threshold, y0=0, y1=1, xref="x",
                                  yref="y domain", name="recommended",
                                  line={"color": "#2ca02c", "dash": "dashdot", "width": 1.5})
        x, y = _gated_trace_data(state)
        gated = next(t for t in self.figure.data if t.meta == "gated")
        gated.update(x=x, y=y, name=f"gated (async_tp_min_tokens={state.threshold})")
        self.progress.value = min(state.done, self.progress.max)
        self.progress.description = f"{state.done} / {state.total}" if state.running or state.done else ""
        self.regret_html.value = self._regret_html(rec)

    def _regret_html(self, rec: Any) -> str:
        if rec is None:
            return "<i>the gate needs both baseline and sp+async_tp rows at some token count</i>"
        table = self.state.regret()
        cells = "".join(
            f"<tr><td>{r['num_tokens']}</td><td>{r['gated_us']:.1f}</td><td>{r['best_variant']}</td>"
            f"<td>{r['best_us']:.1f}</td><td>{100 * r['regret_rel']:.1f}%</td></tr>"
            for r in table.iter_rows(named=True))
        total = float(table["regret_rel"].sum())
        vllm = self._vllm()
        return (f"<b>recommended:</b> {rec.summary()}<br><b>at {self.state.threshold}:</b> total relative regret "
                f"{total:.4f}; vLLM's rule (Hopper): {vllm if vllm is not None else 'SP off (hidden < 8192)'}"
                "<table><tr><th>tokens</th><th>gated us</th><th>best</th><th>best us</th><th>regret</th></tr>"
                f"{cells}</table>")


def tune(model: str = "toy", *, tp: int = 2, token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
         variants: Sequence[str] = ("baseline", "sp", "sp+async_tp"), num_layers: int | None = None,
         store_dir: str | Path | None = "data/sweeps", config: Any = None, threshold: int | None = None,
         export_dir: str | Path = "configs", replay: str | Path | pl.DataFrame | bool | None = None,
         **sweep_kwargs: Any) -> Tuner:
    """The tuner widget for ``async_tp_min_tokens`` (see the module docstring).

    Args:
        model, tp, token_counts, variants, num_layers: the live sweep's setup (editable in the widget).
        store_dir: sweep store of live rows (a rerun resumes from it).
        config: base ``LabConfig`` the export gates (default ``LabConfig(tp_size=tp)``).
        threshold: initial slider value (default: the config's ``async_tp_min_tokens``).
        export_dir: where Export writes the tuned config.
        replay: rows to show at once: a store dir, a parquet file, a DataFrame, or ``True`` for the
            simulated prediction from the recorded H200 data. ``None`` starts empty (run a sweep or
            press "Replay recorded").
        **sweep_kwargs: passed to :func:`sp_lab.bench.sweep.run_sweep` (``warmup``, ``repeats``, ``dtype``, ...).
    """
    state = TunerState(model=model, tp=tp, token_counts=sorted(set(token_counts)), variants=list(variants),
                       num_layers=num_layers, store_dir=None if store_dir is None else str(store_dir),
                       config=config, sweep_kwargs=dict(sweep_kwargs))
    state.threshold = threshold if threshold is not None else state.config.async_tp_min_tokens
    tuner = Tuner(state, export_dir=export_dir)
    if replay is not None and replay is not False:
        tuner.replay(None if replay is True else replay)
    return tuner


__all__ = ["GATE", "Tuner", "TunerState", "simulated_rows", "tune"]
