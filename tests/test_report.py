"""The CompileReport contract on its own: records, JSON, the strict loader, schema migration; no compiles.

Reports written by the compiler are tested in ``test_compiler_report.py``; here the saved files of
``tests/data`` (schema 1, from before the typed records) and hand-edited copies of them.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sp_lab.compiler.report import (
    OP_KEYS,
    SCHEMA,
    BoundaryCrossing,
    BoundaryRecord,
    CompileReport,
    CopyEvent,
    CountKey,
    GraphSnapshot,
    PieceRecord,
    ReportError,
)

DATA = Path(__file__).parent / "data"


def _raw(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


V1_FILES = sorted(p for p in [*DATA.glob("*.json"), *DATA.glob("explorer/*.json.gz")]
                  if _raw(p).get("schema") == "sp_lab.compile_report/1")
REAL_V1 = DATA / "report_toy_sharded.json"


def test_there_are_schema_1_files_to_read():
    assert REAL_V1 in V1_FILES and len(V1_FILES) >= 2


@pytest.mark.parametrize("path", V1_FILES, ids=lambda p: p.stem)
def test_schema_1_files_load_into_records_and_round_trip(path):
    report = CompileReport.load(path)
    raw = _raw(path)
    assert [(r.lo, r.hi, r.compiled) for r in report.ranges] == [(r["lo"], r["hi"], r["compiled"]) for r in raw["ranges"]]
    for rng, raw_rng in zip(report.ranges, raw["ranges"]):
        assert len(rng.pieces) == len(raw_rng["pieces"])
        assert all(isinstance(p, PieceRecord) for p in rng.pieces)
        assert all(isinstance(b, BoundaryRecord) and all(isinstance(t, BoundaryCrossing) for t in b.tensors)
                   for b in rng.boundaries)
        assert [t["name"] for b in raw_rng["boundaries"] for t in b["tensors"]] == [
            t.name for b in rng.boundaries for t in b.tensors]
        # The erased copies a v1 file listed (per piece, or per range in the synthetic ones) became events.
        assert len(rng.erased_copies) == len(raw_rng.get("erased_copies", []))
        assert rng.numerically_unsafe == raw_rng.get("numerically_unsafe", False)
        for piece, raw_piece in zip(rng.pieces, raw_rng["pieces"]):
            assert piece.op_counts_after == raw_piece.get("op_counts_after", {})
            if raw_piece.get("graph_after"):
                assert isinstance(piece.graph_after, GraphSnapshot)
                assert len(piece.graph_after.nodes) == len(raw_piece["graph_after"]["nodes"])
    saved = report.to_dict()
    assert saved["schema"] == SCHEMA
    assert CompileReport.from_json(json.dumps(saved)).to_dict() == saved


def test_erased_copies_of_a_schema_1_report_become_copy_events():
    raw = _raw(DATA / "explorer" / "schema1_toy_inplace_gather_erase.json.gz")
    report = CompileReport.from_dict(raw)
    (i, raw_range), = [(i, r) for i, r in enumerate(raw["ranges"]) if r["erased_copies"]]
    rng = report.ranges[i]
    assert len(rng.erased_copies) == len(raw_range["erased_copies"]) > 0
    for (piece, event), expected in zip(rng.erased_copies, raw_range["erased_copies"]):
        assert piece == expected["piece"]
        assert event == CopyEvent(expected["target"], tuple(expected["dst_shape"]), tuple(expected["src_shape"]),
                                  "erased")
    assert rng.numerically_unsafe


def test_op_and_match_keys_come_from_one_enum():
    report = CompileReport.load(REAL_V1)
    counts = report.op_counts(12)
    assert tuple(counts) == OP_KEYS and all(isinstance(k, CountKey) for k in counts)
    assert counts["fused_all_gather_matmul"] == counts[CountKey.FUSED_ALL_GATHER_MATMUL] == 5
    assert set(report.range_for(12).matches()) <= {CountKey(k) for k in ("sp_first", "sp_middle", "sp_last",
                                                                           "async_tp_ag_mm", "async_tp_mm_rs")}
    # Printed (a notebook cell, the README's first session), the counts read as plain strings.
    assert repr(counts).startswith("{'all_reduce': 0, ") and "CountKey" not in repr(counts)


def _doc() -> dict:
    return CompileReport.load(REAL_V1).to_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["ranges"][1]["pieces"][0]["op_counts_after"].update(all_gathers=1),
         r"ranges\[1\]\.pieces\[0\]\.op_counts_after\['all_gathers'\]: expected one of 'all_reduce'"),
        (lambda d: d["ranges"][1]["pieces"][0]["async_tp_decisions"][0].update(decision="maybe"),
         r"ranges\[1\]\.pieces\[0\]\.async_tp_decisions\[0\]\.decision: expected one of 'fuse', 'no_fuse'"),
        (lambda d: d["ranges"][1]["boundaries"][0]["tensors"][1].update(shape_after=[1.5, 64]),
         r"ranges\[1\]\.boundaries\[0\]\.tensors\[1\]\.shape_after\[0\]: expected int or str, got float 1.5"),
        (lambda d: d["ranges"][1]["pieces"][0]["graph_after"]["edges"].append(["a"]),
         r"ranges\[1\]\.pieces\[0\]\.graph_after\.edges\[\d+\]: expected 2 items, got 1"),
        (lambda d: d["ranges"][1]["pieces"][0]["graph_after"]["nodes"][0].update(source={"file": "x.py"}),
         r"graph_after\.nodes\[0\]\.source: expected str, got dict"),
        (lambda d: d["graphs"].append({"index": 0, "static_tokens": "one", "capture_time_s": 1.0}),
         r"graphs\[0\]\.static_tokens: expected int, got str 'one'"),
        (lambda d: d["ranges"][0].update(dynamo_graph=True), r"ranges\[0\]\.dynamo_graph: expected int, got bool"),
    ],
    ids=["unknown_op_key", "decision", "shape_item", "edge_pair", "source_line", "graph_tokens", "graph_bool"],
)
def test_a_bad_field_is_named_by_its_path(edit, message):
    doc = _doc()
    edit(doc)
    with pytest.raises(ReportError, match=message):
        CompileReport.from_dict(doc)


def test_load_names_the_file_and_from_json_takes_only_text(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_doc())[:500])
    with pytest.raises(ReportError, match=rf"{path}: compile report is not valid JSON"):
        CompileReport.load(path)
    with pytest.raises(ReportError, match="not valid JSON"):  # a path is text, not a file to open
        CompileReport.from_json(str(REAL_V1))
    with pytest.raises(FileNotFoundError, match="to_json"):
        CompileReport.load(tmp_path / "missing.json")


def test_records_are_frozen_and_the_report_reads_without_torch():
    record = CompileReport.load(REAL_V1).ranges[1].pieces[0]
    with pytest.raises(AttributeError):
        record.index = 3
    code = ("import sys; from sp_lab.compiler.report import CompileReport; "
            f"r = CompileReport.load({str(REAL_V1)!r}); r.op_counts(12); "
            "import sp_lab.viz.explorer; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_package_exports_the_report_and_its_errors():
    import sp_lab
    from sp_lab.compiler.backend import BoundaryError
    from sp_lab.config import ConfigError

    assert {"CompileReport", "BoundaryError", "ConfigError", "compile", "LabConfig"} <= set(dir(sp_lab))
    assert sp_lab.CompileReport is CompileReport
    assert sp_lab.BoundaryError is BoundaryError and sp_lab.ConfigError is ConfigError
    with pytest.raises(AttributeError, match="no attribute 'Report'"):
        sp_lab.Report  # noqa: B018
