"""What a setup is (sp_lab.bench.setups) and how a reader chooses one of a store's setups: polars only, no torch run."""

from __future__ import annotations

import polars as pl
import pytest
from test_cli import curve_rows

from sp_lab.bench.setups import (
    SETUP_FIELDS,
    Setup,
    SetupNotFoundError,
    compile_settings,
    parse_query,
    select_setup,
    setup_of_row,
    setups,
)
from sp_lab.bench.store import KEY_COLUMNS
from sp_lab.config import LabConfig
from sp_lab.programs import VARIANTS, Policy, variant_config
from sp_lab.vocabulary import SETUP_COLUMNS


def _rows(when: str, **setup) -> list[dict]:
    return curve_rows(timestamp=f"2026-12-06T{when}:00.000+00:00", **setup)


def test_the_variants_of_one_sweep_share_its_compile_settings_and_other_settings_are_another_setup():
    """A variant sets its own gates and per-matmul rule (programs.variant_config): those never split a sweep into
    setups. Settings the variants share (max_num_tokens, compile_mode) do: their rows are not comparable."""
    base = LabConfig(tp_size=2, async_tp_min_tokens=64)
    tuned = Policy.gate("baseline", "sp+async_tp", 16).to_config(base)
    assert {compile_settings(variant_config(v, base).to_json()) for v in VARIANTS} == {"defaults"}
    assert compile_settings(tuned.to_json()) == "defaults"
    assert compile_settings(LabConfig(tp_size=2, max_num_tokens=512).to_json()) == "max_num_tokens=512"
    assert compile_settings(LabConfig(compile_mode="full_graph").to_json()) == "compile_mode=full_graph"
    assert compile_settings("{}") == "defaults"  # rows written with no field away from the defaults
    assert compile_settings(None) == "not recorded"


def test_a_setup_is_the_setup_columns_and_the_resume_key_holds_every_one():
    """A point a sweep counts as done must be a point of the same setup: every setup column is in the resume key
    (torch included: another torch compiles other kernels, its rows are measured anew)."""
    assert SETUP_FIELDS == (*SETUP_COLUMNS, "settings")
    assert tuple(f for f in Setup.__dataclass_fields__) == SETUP_FIELDS
    assert set(SETUP_COLUMNS) <= set(KEY_COLUMNS) and "torch_version" in SETUP_COLUMNS
    row = curve_rows()[0]
    assert setup_of_row(row) == Setup(model="toy", hidden_size=64, num_layers=2, tp=2, dtype="float32",
                                      device_name="cpu: test", backend="gloo", boundary="sharded",
                                      torch_version="2.13.0", settings="defaults")


def test_setups_are_listed_newest_first_with_their_row_counts_and_sources():
    rows = pl.DataFrame(_rows("21:00") + _rows("22:00", torch_version="2.14.0")[:6]
                        + _rows("22:05", dtype="bfloat16", num_layers=1, source="replayed")[:3])
    found = setups(rows)
    assert [(s.setup.dtype, s.setup.torch_version, s.rows, s.sources) for s in found] == [
        ("bfloat16", "2.13.0", 3, ("replayed",)), ("float32", "2.14.0", 6, ("measured",)),
        ("float32", "2.13.0", 15, ("measured",))]
    # rows without a time (hand-made, predicted) or without some columns still group, after those with one
    bare = pl.DataFrame([{"num_tokens": 1, "variant": "baseline", "latency_us": 1.0, "dtype": d} for d in "ab"])
    assert sorted(s.setup.dtype for s in setups(bare)) == ["a", "b"] and setups(bare)[0].newest is None


def test_select_setup_keeps_the_one_asked_for_else_the_newest_and_says_so():
    rows = pl.DataFrame(_rows("21:00") + _rows("22:00", dtype="bfloat16", num_layers=1)
                        + _rows("22:05", dtype="fp8-rowwise", num_layers=1))
    newest, choice = select_setup(rows)
    assert newest.height == 15 and set(newest["dtype"]) == {"fp8-rowwise"} and choice.how == "newest"
    assert choice.message() == (
        "setup: the newest of 3 in these rows, toy (1 layer, hidden 64), fp8-rowwise, tp 2, cpu: test, gloo, sharded,"
        " torch 2.13.0, compile settings: defaults (15 rows, measured, newest 2026-12-06 22:05 UTC)\n"
        "other setups, never mixed with it (ask for one by its fields):\n"
        "  - setup={'num_layers': 1, 'dtype': 'bfloat16'}: 15 rows, measured, newest 2026-12-06 22:00 UTC\n"
        "  - setup={'num_layers': 2, 'dtype': 'float32'}: 15 rows, measured, newest 2026-12-06 21:00 UTC")
    two_layers, choice = select_setup(rows, {"num_layers": "2"})  # as text, as the command line gives it
    assert set(two_layers["dtype"]) == {"float32"} and choice.how == "asked"
    whole, choice = select_setup(rows, setup_of_row(_rows("22:00", dtype="bfloat16", num_layers=1)[0]))
    assert set(whole["dtype"]) == {"bfloat16"} and choice.message("cli").startswith("setup asked for: toy (1 layer")
    assert "--setup num_layers=2,dtype=float32: 15 rows" in choice.message("cli")
    one = pl.DataFrame(_rows("21:00"))
    kept, choice = select_setup(one)
    assert kept.height == 15 and choice.how == "only" and choice.message().startswith("setup: toy (2 layers")
    with pytest.raises(SetupNotFoundError, match=r"no rows of the setup asked for \(setup=\{'tp': 4\}\); the rows "
                                                 r"hold 3 setup\(s\):\n  - setup=\{'num_layers': 1, 'dtype'"):
        select_setup(rows, {"tp": 4})
    with pytest.raises(ValueError, match=r"setup fields \['layers'\] do not exist; a setup is asked for by"):
        select_setup(rows, {"layers": 1})
    with pytest.raises(ValueError, match="no rows"):
        select_setup(rows.clear())


def test_the_command_lines_setup_query_is_parsed_and_checked():
    assert parse_query("dtype=bfloat16, num_layers=1") == {"dtype": "bfloat16", "num_layers": "1"}
    assert parse_query("device_name=cpu: AMD EPYC") == {"device_name": "cpu: AMD EPYC"}
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        parse_query("bfloat16")
    with pytest.raises(ValueError, match=r"setup fields \['dtpye'\] do not exist"):
        parse_query("dtpye=bfloat16")
