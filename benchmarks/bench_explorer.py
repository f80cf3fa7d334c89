"""Time the split-graph overview for an 80-layer Llama-3-70B-shaped report at tp 8 (target: < 2 s on CPU).

The report source is a parameter:

    python benchmarks/bench_explorer.py                        # SYNTHETIC report (tests/synthetic_reports.py)
    python benchmarks/bench_explorer.py --report path/to.json  # a real report, e.g. compiled with the
                                                               # fake process group at tp 8

The synthetic report is hand-built from the CompileReport schema (81 compiled pieces + 80 attention
splitting ops per range, layer fingerprints equal) until the compiler can write the real one.
Timed: ``load_report`` (JSON parse + schema check), ``overview_data`` + ``build_overview_figure``
(collapsed, fully expanded, and collapsed + ``to_html``), and one piece drill-down. Best and median of ``--repeats`` runs,
after one warm-up run; prints one JSON line and exits 1 when the overview misses the target.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TARGET_S = 2.0


def _synthetic_report_path(directory: Path, strategy: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic_reports import llama_70b_tp8_report

    path = directory / f"synthetic_llama_3_70b_tp8_{strategy}.json"
    path.write_text(json.dumps(llama_70b_tp8_report(strategy)))
    return path


def _time(fn: Callable[[], object], repeats: int) -> dict:
    fn()  # warm-up: imports, plotly's validator caches
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return {"best_s": round(min(runs), 4), "median_s": round(statistics.median(runs), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="CompileReport JSON (default: the synthetic 70B tp8 report)")
    parser.add_argument("--strategy", default="sharded", help="boundary strategy of the synthetic report")
    parser.add_argument("--range-index", type=int, default=None, help="range to draw (default: first with SP)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--html", type=Path, help="also write the collapsed overview to this HTML file")
    args = parser.parse_args(argv)

    t_import = time.perf_counter()
    from sp_lab.viz import graph

    import_s = time.perf_counter() - t_import
    with tempfile.TemporaryDirectory() as tmp:
        path = args.report or _synthetic_report_path(Path(tmp), args.strategy)
        report = graph.load_report(path)
        data = graph.overview_data(report, args.range_index)
        middle = next(p.index for p in data.pieces[1:] if p.kind == "compiled")
        results = {
            "load_report": _time(lambda: graph.load_report(path), args.repeats),
            "overview": _time(lambda: graph.build_overview_figure(graph.overview_data(report, args.range_index)),
                              args.repeats),
            "overview_expanded": _time(lambda: graph.build_overview_figure(
                graph.overview_data(report, args.range_index), expand=True), args.repeats),
            # What a notebook or save_html pays on top of the build (plotly.js itself not included).
            "overview_to_html": _time(lambda: graph.build_overview_figure(
                graph.overview_data(report, args.range_index)).to_html(include_plotlyjs=False), args.repeats),
            "piece_drilldown": _time(lambda: graph.build_piece_figure(
                graph.piece_diff_data(report, args.range_index, middle)), args.repeats),
        }
        report_bytes = Path(path).stat().st_size
    if args.html:
        graph.save_html(graph.plot_overview(report, args.range_index), args.html)
    ok = results["overview"]["median_s"] < TARGET_S
    print(json.dumps({
        "bench": "explorer_overview", "report": str(args.report) if args.report else
        f"SYNTHETIC llama-3-70b tp8 {args.strategy}", "report_mb": round(report_bytes / 1e6, 2),
        "pieces": len(data.pieces), "boundaries": len(data.boundaries), "groups": [g.label for g in data.groups],
        "import_s": round(import_s, 3), **results, "target_s": TARGET_S, "ok": ok,
        "machine": f"{platform.machine()}, python {platform.python_version()}",
    }))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
