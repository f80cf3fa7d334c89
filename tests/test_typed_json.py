"""One strict loader of typed JSON (sp_lab.jsonfile.TypedJSON): configs and compile reports fail the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sp_lab.compiler.report import CompileReport, ReportError
from sp_lab.config import ConfigError, LabConfig

REPORT = json.loads((Path(__file__).parent / "data" / "report_toy_sharded.json").read_text())


def _report_with(edit) -> dict:
    doc = json.loads(json.dumps(REPORT))
    edit(doc)
    return doc


def test_a_bad_choice_reads_the_same_in_a_config_and_a_report():
    choices = "expected one of 'none', 'gather_erase', 'gather', 'sharded', got str 'shard'; did you mean 'sharded'?"
    with pytest.raises(ConfigError) as config_error:
        LabConfig.from_dict({"boundary": "shard"})
    with pytest.raises(ReportError) as report_error:
        CompileReport.from_dict(_report_with(lambda d: d["ranges"][0].update(boundary="shard")))
    assert str(config_error.value) == f"boundary: {choices}"
    assert str(report_error.value) == f"compile report: ranges[0].boundary: {choices}"


def test_an_unknown_field_reads_the_same_in_a_config_and_a_report():
    with pytest.raises(ConfigError, match=r"^unknown field 'max_num_token'; did you mean 'max_num_tokens'\?$"):
        LabConfig.from_dict({"max_num_token": 64})
    with pytest.raises(ReportError, match=r"^compile report: ranges\[0\]: unknown field 'compile_tim'; did you "
                                          r"mean 'compile_time_s'\?$"):
        CompileReport.from_dict(_report_with(lambda d: d["ranges"][0].update(compile_tim=1.0)))


def test_wrong_types_are_named_by_path_in_both():
    with pytest.raises(ConfigError, match=r"^compile_range_split_points\[1\]: expected int, got bool True$"):
        LabConfig.from_dict({"compile_range_split_points": [512, True]})
    with pytest.raises(ReportError, match=r"^compile report: ranges\[0\]\.lo: expected int, got bool True$"):
        CompileReport.from_dict(_report_with(lambda d: d["ranges"][0].update(lo=True)))
    # a Python caller's value goes through the same checks: a tuple is a list, a rule must be built
    assert LabConfig(compile_range_split_points=(512,)).compile_range_split_points == [512]
    with pytest.raises(ConfigError, match=r"^heuristic: expected MatmulRule, got dict"):
        LabConfig(heuristic={"choice": "fuse"})
