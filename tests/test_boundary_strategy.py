"""The boundary strategy is one typed value: LabConfig, the CLI, the post-grad pass and saved reports agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from sp_lab import cli
from sp_lab.bench.rehearsal import BOUNDARIES
from sp_lab.compiler.passes.post_grad import SequenceParallelPass
from sp_lab.compiler.report import CompileReport
from sp_lab.config import BoundaryStrategy, ConfigError, LabConfig

ALLOWED = "none, gather_erase, gather, sharded"


def test_a_bad_strategy_names_the_allowed_ones_wherever_it_is_given(capsys):
    with pytest.raises(ConfigError, match=r"boundary: expected one of 'none', 'gather_erase', 'gather', 'sharded'.*"
                                          r"did you mean 'sharded'"):
        LabConfig(boundary="shard")
    with pytest.raises(ConfigError, match=f"unknown strategy 'whole_graph'; choose from {ALLOWED}"):
        SequenceParallelPass(tp_size=2, rank=0, group_name=None, boundary="whole_graph")
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--boundary", "whole_graph"])
    assert "'none', 'gather_erase', 'gather', 'sharded'" in capsys.readouterr().err


def test_a_name_and_the_member_are_the_same_config_and_file():
    by_name, by_member = LabConfig(boundary="gather"), LabConfig(boundary=BoundaryStrategy.GATHER)
    assert by_name == by_member and by_name.boundary is BoundaryStrategy.GATHER
    assert by_name.to_dict()["boundary"] == "gather" and type(by_name.to_dict()["boundary"]) is str
    assert LabConfig.from_json(by_name.to_json()).boundary is BoundaryStrategy.GATHER
    assert BOUNDARIES == tuple(BoundaryStrategy)  # a rehearsal compiles every strategy there is


def test_a_saved_report_loads_its_strategy_as_the_typed_value():
    report = CompileReport.load(Path(__file__).parent / "data" / "report_toy_sharded.json")
    assert {r.boundary for r in report.ranges} == {BoundaryStrategy.SHARDED}
    assert all(isinstance(r.boundary, BoundaryStrategy) for r in report.ranges)
