"""The HTML report of a sweep: the recommendation and its confidence first, then the figures and tables.

One page, readable without plotly's toolbar: the policy to run and why (regret with 95% intervals, what
the noise leaves open, what a second threshold would gain), the regret table behind it (the same
:func:`sp_lab.tuning.regret.regret_table` the tuner and the exported file show), the latency figure with
intervals, what actually ran (SP rewrites, fused ops, fusion that did not fire) and the provenance of
every row. The page records which store it was made from (``<meta name="sp_lab-store">``) so that a
later report never silently replaces the report of another run.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.tuning.regret import REGRET_COLUMNS, REGRET_HEADERS
from sp_lab.vocabulary import PREDICTED, PROVENANCE_COLUMNS, REHEARSAL, SIMULATED, TUNED

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sp_lab.bench.setups import Setup, SetupChoice
    from sp_lab.config import LabConfig
    from sp_lab.tuning.policy import Recommendation

_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}"
    "table{border-collapse:collapse;font-size:13px;margin:.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
    "td:first-child,th:first-child{text-align:left}"
    ".warn{background:#fff3cd;padding:.5em 1em;border-left:4px solid #e0a800}"
    ".rec{background:#eef6ee;padding:.6em 1em;border-left:4px solid #2ca02c;font-size:15px}"
)
_STORE_META = re.compile(r'<meta name="sp_lab-store" content="([^"]*)">')


class ReportOverwriteError(FileExistsError):
    """The output file is the report of another store's rows; the message says how to keep both."""


def report_store(path: str | Path) -> str | None:
    """The store an existing report was made from (``None``: not an sp_lab report, or written before)."""
    try:
        match = _STORE_META.search(Path(path).read_text(encoding="utf-8", errors="replace")[:4096])
    except OSError:
        return None
    return html.unescape(match.group(1)) if match else None


def tuned_drift(rows: pl.DataFrame, config: LabConfig) -> float | None:
    """Median over token counts of (tuned latency / latency of the variant ``config`` runs there), or ``None``
    without tuned rows. The tuned rows run that very program, so away from 1 the factor measures the drift of the
    machine between the reference sweep and the later tuned sweep."""
    from sp_lab.tuning.regret import regret_table

    tuned = rows.filter(pl.col("variant") == TUNED)
    if not tuned.height:
        return None
    try:
        runs = regret_table(rows.filter(pl.col("variant") != TUNED), config, warn=False)
    except ValueError:
        return None
    ratio = (tuned.group_by("num_tokens").agg(tuned_us=pl.col("latency_us").median())
             .join(runs.select("num_tokens", "latency_us"), on="num_tokens")
             .select(pl.col("tuned_us") / pl.col("latency_us")))
    return float(ratio.to_series().median()) if ratio.height else None


def html_table(df: pl.DataFrame, *, percent: Sequence[str] = (), digits: int = 1) -> str:
    """``df`` as an HTML table; floats with ``digits`` decimals, ``percent`` columns as percentages."""
    def cell(column: str, value: object) -> str:
        if value is None:
            return ""
        if column in percent and isinstance(value, float):
            return f"{100 * value:.{digits}f}%"
        if isinstance(value, float):
            return f"{value:.{digits}f}"
        return html.escape(str(value))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(c, v)}</td>" for c, v in zip(df.columns, row, strict=True))
                   + "</tr>" for row in df.iter_rows())
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_HEADING_SETUP = ("model", "tp", "dtype", "device_name")
"""What the page heading names of each setup in the rows (all of them are in the provenance table)."""


def _heading(rows: pl.DataFrame) -> str:
    """The page heading, from every row: the one setup (write_report keeps one), or each of several."""
    setups = rows.select(_HEADING_SETUP).unique().sort(_HEADING_SETUP).iter_rows(named=True)
    named = [f"{s['model']}, tp={s['tp']}, {s['dtype']}, {s['device_name']}" for s in setups]
    text = named[0] if len(named) == 1 else f"{len(named)} setups ({'; '.join(named)})"
    return f"<h1>sp_lab report: {html.escape(text)}</h1>"


def _summary(rows: pl.DataFrame, store: str | Path, sources: Sequence[str]) -> str:
    """How many rows of which source, from where and when: "measured" only for rows that were."""
    counts = dict(rows.group_by("source").len().iter_rows())
    of = ", ".join(f"{counts[s]} {s}" for s in sources)
    return (f"<p>{rows.height} rows ({html.escape(of)}) from <code>{html.escape(str(store))}</code>, timestamped "
            f"{rows['timestamp'].min()} to {rows['timestamp'].max()}.</p>")


def _setups_html(choice: SetupChoice) -> str:
    """Which setup of the rows the page shows and the others they hold, with their row counts ("" for one)."""
    if not choice.others:
        return ""
    lines = html.escape(choice.message("cli")).replace("\n", "<br>")
    return f"<p class='warn'>This report shows one setup of the {1 + len(choice.others)} the rows hold. {lines}</p>"


def _recommendation_html(rec: Recommendation) -> str:
    s = rec.second_threshold
    second = ""
    if s is not None:
        noise = "rows carry no interval" if not rec.noise_known else "beyond noise" if s.beyond_noise else "within noise"
        second = ("<li>A second threshold would gain nothing.</li>" if s.gain <= 0 else
                  f"<li>A second threshold ({html.escape(s.policy.name)}) would lower the summed regret by "
                  f"{100 * s.gain:.1f} points ({noise}); vLLM gates SP and AsyncTP at one token count, so it is not "
                  "recommended.</li>")
    lo_w, hi_w = rec.worst_interval
    lo_t, hi_t = rec.total_interval
    table = rec.table.with_columns(pl.col("num_tokens").cast(pl.String))
    return (
        f"<div class='rec'><b>Run: {html.escape(rec.policy.name)}</b></div><ul>"
        f"<li>Worst regret {100 * rec.worst_regret:.1f}% (95% interval {100 * lo_w:.1f}-{100 * hi_w:.1f}%), "
        f"summed over the {rec.table.height} token counts {100 * rec.total_regret:.1f}% "
        f"({100 * lo_t:.1f}-{100 * hi_t:.1f}%).</li>"
        f"<li>Confidence: {html.escape(rec.noise_line())}.</li>{second}</ul>"
        "<h3>Regret of the recommended config at each token count</h3>"
        + html_table(table.select(REGRET_COLUMNS).rename(REGRET_HEADERS), percent=(REGRET_HEADERS["regret_rel"],))
    )


def write_report(
    rows: pl.DataFrame,
    out: str | Path,
    *,
    store: str | Path,
    recommendation: Recommendation | None = None,
    config: LabConfig | None = None,
    compile_report: Path | None = None,
    include_plotlyjs: bool | str = True,
    overwrite: bool = False,
    predicted: bool = True,
    setup: Setup | Mapping[str, object] | None = None,
    traffic: bool = True,
) -> Path:
    """Write the report of one setup of ``rows`` (read from ``store``) to ``out``; returns the path.

    ``setup``: the setup to report (a :class:`~sp_lab.bench.setups.Setup` or some of its fields), else the newest
    of the rows (:func:`~sp_lab.bench.setups.select_setup`); the page names it and lists the others with their
    row counts. Rows of two setups never share a figure or a table.

    ``predicted``: add the "what this would be on 8x H200" section (the performance model's curves for the
    swept preset, or Llama-3-70B for a non-preset model), labelled predicted and kept apart from the rows.

    ``traffic``: add the "on serving traffic" section: chat-like traffic scheduled and priced from these rows
    (:func:`sp_lab.viz.traffic.traffic_section_html`), or the reason it cannot be.

    The regret panel draws ``recommendation.config`` (or ``config``). An existing report made from
    another store is kept unless ``overwrite``: :class:`ReportOverwriteError` names both stores.
    """
    from sp_lab.bench.setups import select_setup
    from sp_lab.viz.latency import plot_latency
    from sp_lab.vocabulary import FUSION_MISSING_SUFFIX

    rows, choice = select_setup(rows, setup, style="cli")
    out = Path(out)
    previous = report_store(out) if out.exists() else None
    if previous is not None and previous != str(store) and not overwrite:
        raise ReportOverwriteError(
            f"{out} is the report of the rows in {previous}, not {store}; pass another --out, or --force "
            "to replace it"
        )
    shown = recommendation.config if recommendation is not None else config
    sources = sorted(set(rows["source"].to_list()))
    drift = tuned_drift(rows, shown) if shown is not None else None
    drawn = rows
    if drift is not None:  # the tuned curve says in its legend entry that it comes from a later sweep
        drawn = rows.with_columns(variant=pl.when(pl.col("variant") == TUNED)
                                  .then(pl.lit(f"{TUNED} (later sweep: {drift:.2f}x the program it runs)"))
                                  .otherwise(pl.col("variant")))
    figures = [plot_latency(drawn, config=shown)]  # titled with the rows' provenance (source, device, torch, ...)
    if compile_report is not None:
        from sp_lab.viz.explorer import load_report, plot_overview

        figures.append(plot_overview(load_report(compile_report)))
    divs = [f.to_html(full_html=False, include_plotlyjs=include_plotlyjs if i == 0 else False)
            for i, f in enumerate(figures)]
    columns = list(PROVENANCE_COLUMNS)
    provenance = rows.group_by(columns).agg(pl.len().alias("rows")).sort(columns)
    ran = (rows.group_by("reported_variant", "source")
           .agg(pl.len().alias("rows"), pl.col("sp_rewrites").max().alias("SP rewrites (max)"),
                pl.col("n_fused_ag_mm").max().alias("fused AG+mm (max)"),
                pl.col("n_fused_mm_rs").max().alias("fused mm+RS (max)"),
                pl.col("fusion_missing").sum().alias("fusion missing"))
           .sort("reported_variant"))
    parts = [_heading(rows), _summary(rows, store, sources), _setups_html(choice)]
    if recommendation is not None:
        parts += ["<h2>Recommendation</h2>", _recommendation_html(recommendation)]
    else:
        parts.append("<p class='warn'>No recommendation: the rows do not let one be made (see the command's "
                     "note).</p>")
    missing = int(rows["fusion_missing"].sum())
    if missing:
        parts.append(f"<p class='warn'>{missing} row(s) expected SP or AsyncTP fusion that did not run. They are "
                     f"drawn and listed as '&lt;variant&gt;{html.escape(FUSION_MISSING_SUFFIX)}', never as the "
                     "variant they were asked to be.</p>")
    if TUNED in set(rows["variant"].to_list()):
        measured = (f" Here they ran <b>{drift:.2f}x</b> the latency of the variant the config runs at the same "
                    "token counts (median over the counts): the same program, so that factor is the machine's "
                    "drift between the two sweeps, not a gain or a loss of tuning. Compare the tuned curve with "
                    "the black config curve only after dividing by it." if drift is not None else "")
        parts.append("<p class='warn'>The <b>tuned</b> rows were measured in a later sweep than the reference "
                     f"variants, not interleaved with them.{measured}</p>")
    for source, what in ((PREDICTED, "predicted by the performance model (sp_lab.tuning.predict), not measured"),
                         (SIMULATED, "simulated (the retired what-if model of an older sp_lab), not measured"),
                         (REHEARSAL, "rehearsal (several ranks on one GPU): code paths, not multi-GPU latency")):
        if source in sources:
            parts.append(f"<p class='warn'>Some rows are <b>{what}</b>.</p>")
    parts += ["<h2>Latency and regret</h2>", divs[0]]
    if compile_report is not None:  # its own heading: under the latency figure's it read as part of that section
        what = (f"<p>The overview of <code>{html.escape(str(compile_report))}</code>: the pieces of the first range "
                "with SP, what crosses each boundary (bytes per token on one rank) and what got fused.</p>")
        parts += ["<h2>Compiled pieces and boundaries</h2>", what, divs[1]]
    if predicted:
        from sp_lab.viz.predicted import predicted_section_html

        parts.append(predicted_section_html(str(rows["model"][0])))
    if traffic:
        from sp_lab.viz.traffic import traffic_section_html

        parts.append(traffic_section_html(rows))
    parts += ["<h2>What ran</h2>", html_table(ran),
              "<h2>Provenance</h2>", html_table(provenance)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f'<meta name="sp_lab-store" content="{html.escape(str(store))}">'
        f"<title>sp_lab report</title><style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n",
        encoding="utf-8",
    )
    return out
