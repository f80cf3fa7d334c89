"""Time the split-graph explorer on a REAL 80-layer Llama-3-70B report at tp 8 (targets: overview < 0.5 s,
any piece drill-down < 1 s, on 2 CPU cores).

    python benchmarks/bench_explorer.py                        # the committed real report
    python benchmarks/bench_explorer.py --regenerate           # compile it again first (format change)
    python benchmarks/bench_explorer.py --report path/to.json  # any saved report (.json or .json.gz)

The default report, ``tests/data/explorer/llama-3-70b_tp8_80l_sharded.json.gz`` (0.1 MB), is what
``sp_lab.compile`` writes for ``llama-3-70b`` (80 layers, meta device, bf16) at tp 8, boundary ``sharded``, under
the fake process group with an inspect-only compile (every pass runs and fills the report; no Inductor code
generation). ``--regenerate`` compiles it again first (``tests/data/make_explorer_fixtures.py --large-only``,
20-45 s on 2 idle cores). Timed, best and median of ``--repeats`` runs after a warm-up:

- ``load_report``: JSON parse into the explorer's records;
- ``overview``: ``overview_data`` + ``build_overview_figure`` (collapsed; also expanded and ``to_html``);
- ``drilldown``: ``piece_diff_data`` + ``build_piece_figure`` for every distinct compiled piece (by fingerprint)
  in each mode (after, before, diff), with the ``dot`` layout cache cleared before each run, i.e. cold.

The process is pinned to 2 CPU cores when the machine has more. Prints one JSON line; exits 1 when a target is
missed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tests" / "data" / "explorer" / "llama-3-70b_tp8_80l_sharded.json.gz"
OVERVIEW_TARGET_S = 0.5
DRILLDOWN_TARGET_S = 1.0


def _time(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> dict:
    before()
    fn()  # warm-up: imports, plotly's validator caches
    runs = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return {"best_s": round(min(runs), 4), "median_s": round(statistics.median(runs), 4)}


def _pin_two_cores() -> None:
    """Run on 2 cores where the machine has more (the machine record then says 2 of N)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 2:
        os.sched_setaffinity(0, cores[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="a saved CompileReport (default: the real 70B tp8 report)")
    parser.add_argument("--range-index", type=int, default=None, help="range to draw (default: first SP range)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--regenerate", action="store_true", help="compile the default report again first")
    args = parser.parse_args(argv)
    _pin_two_cores()

    if args.regenerate:
        sys.path.insert(0, str(REPORT.parent.parent))
        from make_explorer_fixtures import compile_large_report

        compile_large_report(REPORT)
    path = args.report or REPORT
    t_import = time.perf_counter()
    from sp_lab.viz import explorer as graph
    from sp_lab.viz.dag_layout import _cached_layout

    import_s = time.perf_counter() - t_import
    from machine import machine  # after the timed import: it imports torch and sp_lab
    report = graph.load_report(path)
    data = graph.overview_data(report, args.range_index)
    distinct = {}
    for p in data.pieces:
        if p.kind == "compiled":
            distinct.setdefault(p.fingerprint, p.index)
    results = {
        "load_report": _time(lambda: graph.load_report(path), args.repeats),
        "overview": _time(lambda: graph.build_overview_figure(graph.overview_data(report, args.range_index)),
                          args.repeats),
        "overview_expanded": _time(lambda: graph.build_overview_figure(
            graph.overview_data(report, args.range_index), expand=True), args.repeats),
        # What a notebook or save_html pays on top of the build (plotly.js itself not included).
        "overview_to_html": _time(lambda: graph.build_overview_figure(
            graph.overview_data(report, args.range_index)).to_html(include_plotlyjs=False), args.repeats),
    }
    drilldown = {}
    for index in distinct.values():
        for mode in ("after", "before", "diff"):
            drilldown[f"piece {index} {mode}"] = _time(
                lambda index=index, mode=mode: graph.build_piece_figure(
                    graph.piece_diff_data(report, args.range_index, index), mode),
                args.repeats, before=_cached_layout.cache_clear)
    worst = max(drilldown.items(), key=lambda kv: kv[1]["median_s"])
    sizes = {i: len(data.range.pieces[i].graph_after.nodes) for i in distinct.values()}
    ok = results["overview"]["median_s"] < OVERVIEW_TARGET_S and worst[1]["median_s"] < DRILLDOWN_TARGET_S
    print(json.dumps({
        "bench": "explorer", "report": str(args.report) if args.report else
        f"REAL llama-3-70b tp8, 80 layers, boundary sharded, fake group, inspect-only ({REPORT.name})",
        "report_mb_gz": round(Path(path).stat().st_size / 1e6, 2), "pieces": len(data.pieces),
        "boundaries": len(data.boundaries), "groups": [g.label for g in data.groups],
        "distinct_pieces_nodes": sizes, "import_s": round(import_s, 3), **results, "drilldown": drilldown,
        "drilldown_worst": {worst[0]: worst[1]},
        "targets_s": {"overview": OVERVIEW_TARGET_S, "drilldown": DRILLDOWN_TARGET_S}, "ok": ok,
        "machine": machine(),
    }))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
