"""The headless CLI: fast --help, argument errors, export / report / replay on stored rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from test_store import make_row

from sp_lab import cli
from sp_lab.bench.store import SweepStore, data_hash
from sp_lab.config import LabConfig

REPO = Path(__file__).resolve().parents[1]


def _python_m_sp_lab(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "sp_lab", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def curve_rows(**overrides) -> list[dict]:
    """Rows of a 3-variant sweep where fusion pays from 64 tokens on (like docs/thresholds.md describes)."""
    rows = []
    for t in (1, 4, 16, 64, 256):
        base = 100.0 + t
        for variant, latency in (
            ("baseline", base),
            ("sp", base * 1.02),
            ("sp+async_tp", base * (1.3 if t < 64 else 0.8)),
        ):
            rows.append(
                make_row(
                    t,
                    variant=variant,
                    reported_variant=variant,
                    latency_us=latency,
                    config_hash=variant,
                    **overrides,
                )
            )
    return rows


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "sweeps"
    SweepStore(path).append(curve_rows())
    return path


def test_help_is_fast_and_imports_nothing_heavy():
    start = time.perf_counter()
    result = _python_m_sp_lab("--help")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    for command in cli.COMMANDS:
        assert command in result.stdout
    assert elapsed < 2.0, f"python -m sp_lab --help took {elapsed:.2f} s"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys, sp_lab.cli; sp_lab.cli.build_parser(); "
                "print(sorted(m for m in ('torch', 'polars', 'plotly') if m in sys.modules))"
            ),
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--tokens", "1,x"], "expected comma-separated token counts"),
        (["sweep", "--tokens", "0,4"], "token counts must be positive integers"),
        (["sweep", "--variants", "sp,turbo"], "unknown variants ['turbo']"),
        (["run", "--tp", "0"], "expected a positive integer, got 0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_argument_errors_name_the_bad_value(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_user_errors_are_one_line_with_the_fix_and_crashes_keep_their_traceback(tmp_path, monkeypatch):
    """A typo or an empty store: exit status 2, one line naming the fix, no traceback; a real crash: a traceback."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, fix in ((["sweep", "--model", "lama-3-8b", "--tp", "2", "--tokens", "1", "--store", str(tmp_path)],
                       "did you mean 'llama-3-8b'?"),
                      (["tune", "--store", str(empty)], f"run a sweep first, e.g. `python -m sp_lab sweep --store {empty}"),
                      (["replay", str(tmp_path / "nowhere.parquet"), "--store", str(tmp_path / "s")],
                       "it does not exist (looked in")):
        result = _python_m_sp_lab(*argv)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fix in lines[0], result.stderr
    monkeypatch.setitem(cli.COMMANDS, "tune", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["tune", "--store", str(empty)])


def test_cli_variants_match_the_sweeps():
    from sp_lab.bench.sweep import DEFAULT_VARIANTS, VARIANTS

    sweep = cli.build_parser().parse_args(["sweep"])
    assert sweep.variants == list(DEFAULT_VARIANTS)
    with pytest.raises(SystemExit):  # every variant the sweeps know is accepted, and only those
        cli.build_parser().parse_args(["sweep", "--variants", "sp,turbo"])
    assert cli.build_parser().parse_args(["sweep", "--variants", ",".join(VARIANTS)]).variants == list(VARIANTS)


def test_export_with_an_explicit_threshold_writes_a_tuned_config_with_provenance(store, tmp_path, capsys):
    assert (
        cli.main(["export", "--store", str(store), "--threshold", "64", "--out", str(tmp_path / "cfg")]) == 0
    )
    (path,) = (tmp_path / "cfg").glob("*.json")
    assert "device_name=cpu_test" in path.name and "tp=2" in path.name
    out = capsys.readouterr().out
    assert str(path) in out
    config = LabConfig.from_json(path)
    assert config.async_tp_min_tokens == 64 and config.enable_async_tp and config.tp_size == 2
    written = json.loads(path.read_text())
    provenance = written["provenance"]
    assert provenance["data_hash"] == data_hash(SweepStore(store).read())
    assert provenance["sweep_rows"] == 15
    # the file says what it does on chat traffic, priced on the same rows (or why it cannot be), as `run`'s does
    serving = written["serving"]
    assert serving["workload"] == "chat" and serving["rows_hash"] == provenance["data_hash"]
    assert "serving (chat traffic" in out


def test_tune_export_and_report_pick_one_setup_of_a_shared_store_and_say_which(tmp_path, capsys):
    """The project's store after `make run` (float32, 2 layers) and notebook 06 (bf16 and FP8, 1 layer): every
    command uses one setup, the newest unless the flags ask for another, prints which, and lists the others with
    their row counts and the --setup that picks each; the report draws the one tune chose."""
    store = tmp_path / "sweeps"
    SweepStore(store).append(curve_rows(timestamp="2026-12-06T21:00:00.000+00:00"))
    SweepStore(store).append(curve_rows(timestamp="2026-12-06T22:00:00.000+00:00", num_layers=1, dtype="bfloat16"))
    SweepStore(store).append(curve_rows(timestamp="2026-12-06T22:05:00.000+00:00", num_layers=1,
                                        dtype="fp8-rowwise")[:9])  # 1, 4 and 16 tokens
    assert cli.main(["tune", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "setup: the newest of 3 in these rows, toy (1 layer, hidden 64), fp8-rowwise, tp 2" in out
    assert "(9 rows, measured, newest 2026-12-06 22:05 UTC)" in out
    assert "  - --setup num_layers=1,dtype=bfloat16: 15 rows, measured, newest 2026-12-06 22:00 UTC" in out
    assert "  - --setup num_layers=2,dtype=float32: 15 rows, measured, newest 2026-12-06 21:00 UTC" in out
    assert "baseline everywhere" in out  # the FP8 rows (1-16 tokens) alone: fusion never pays there

    assert cli.main(["tune", "--store", str(store), "--setup", "num_layers=2,dtype=float32"]) == 0
    out = capsys.readouterr().out
    assert "setup asked for (--setup num_layers=2,dtype=float32): toy (2 layers" in out and "from 64" in out
    assert cli.main(["export", "--store", str(store), "--dtype", "bfloat16", "--threshold", "64",
                     "--out", str(tmp_path / "cfg")]) == 0
    (path,) = (tmp_path / "cfg").glob("*.json")
    assert "dtype=bfloat16" in path.name and json.loads(path.read_text())["provenance"]["sweep_rows"] == 15
    capsys.readouterr()
    assert cli.main(["report", "--store", str(store), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<h1>sp_lab report: toy, tp=2, fp8-rowwise, cpu: test</h1>" in page
    assert "This report shows one setup of the 3 the rows hold" in page
    assert cli.main(["tune", "--store", str(store), "--setup", "dtype=float16"]) == 2
    err = capsys.readouterr().err
    assert "no rows of the setup asked for (--setup dtype=float16); the rows hold 3 setup(s)" in err
    assert "--setup num_layers=2,dtype=float32: 15 rows" in err
    with pytest.raises(SystemExit):  # refused while parsing, as argparse refuses a bad value
        cli.main(["tune", "--store", str(store), "--setup", "dtyp=float16"])
    assert "argument --setup: setup fields ['dtyp'] do not exist" in capsys.readouterr().err


def test_missing_store_and_corrupt_part_are_clear_errors(store, tmp_path, capsys):
    assert cli.main(["export", "--store", str(tmp_path / "nope"), "--threshold", "8"]) == 2
    assert "no sweep store at" in capsys.readouterr().err
    bad = SweepStore(store).append([make_row(512)])
    bad.write_bytes(bad.read_bytes()[:40])
    assert cli.main(["export", "--store", str(store), "--threshold", "8", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert bad.name in err and "--skip-corrupt" in err
    with pytest.warns(UserWarning, match="moved corrupt part"):
        assert (
            cli.main(
                [
                    "export",
                    "--store",
                    str(store),
                    "--threshold",
                    "8",
                    "--skip-corrupt",
                    "--out",
                    str(tmp_path),
                ]
            )
            == 0
        )


def test_report_marks_fusion_missing_rows(store, tmp_path, capsys):
    SweepStore(store).append(
        [
            make_row(
                256,
                variant="tuned",
                reported_variant="tuned [fusion missing]",
                fusion_missing=True,
                fusion_expected=True,
                config_hash="t",
            )
        ]
    )
    out = tmp_path / "r.html"
    assert cli.main(["report", "--store", str(store), "--out", str(out), "--cdn"]) == 0
    page = out.read_text()
    assert "plotly" in page and "1 row(s) expected SP or AsyncTP fusion that did not run" in page
    assert "tuned [fusion missing]" in page
    assert str(out) in capsys.readouterr().out


def test_replay_imports_rows_as_replayed_once(store, tmp_path):
    recorded = tmp_path / "recorded.parquet"
    rows = SweepStore(store).read()
    rows.with_columns(
        pl.when(pl.col("num_tokens") == 1)
        .then(pl.lit("predicted"))  # a model's rows keep their source: never relabelled as tunable timings
        .when(pl.col("num_tokens") == pl.col("num_tokens").max())
        .then(pl.lit("rehearsal"))  # ranks sharing one GPU: not the multi-GPU program's timing, never tunable
        .otherwise(pl.col("source"))
        .alias("source")
    ).write_parquet(recorded)
    dest = tmp_path / "replayed"
    assert cli.main(["replay", str(recorded), "--store", str(dest)]) == 0
    assert cli.main(["replay", str(recorded), "--store", str(dest)]) == 0  # idempotent
    got = SweepStore(dest).read()
    assert got.height == 15
    assert got.group_by("source").len().sort("source").rows() == [("predicted", 3), ("rehearsal", 3), ("replayed", 9)]


def test_replay_refuses_rows_without_provenance(tmp_path, capsys):
    thin = tmp_path / "thin.csv"
    pl.DataFrame({"num_tokens": [1], "latency_us": [3.0]}).write_csv(thin)
    assert cli.main(["replay", str(thin), "--store", str(tmp_path / "s")]) == 2
    assert "lacks columns" in capsys.readouterr().err


def test_tune_recommends_the_threshold_with_least_regret(store, tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert cli.main(["tune", "--store", str(store), "--json", str(out)]) == 0
    assert "async_tp_min_tokens=64" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["async_tp_min_tokens"] == 64 and rec["rows"] == 15
    assert rec["policy"]["name"] == "baseline below 64, sp+async_tp from 64"


def test_export_tunes_when_no_threshold_is_given(store, tmp_path):
    assert cli.main(["export", "--store", str(store), "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    assert LabConfig.from_json(path).async_tp_min_tokens == 64
    assert json.loads(path.read_text())["provenance"]["recommendation"]["async_tp_min_tokens"] == 64


def test_simulated_rows_are_tuned_on_only_when_named(tmp_path, capsys):
    store = tmp_path / "sim"
    SweepStore(store).append(curve_rows(source="simulated"))
    assert cli.main(["tune", "--store", str(store)]) == 2
    assert "pass --source simulated" in capsys.readouterr().err
    assert cli.main(["tune", "--store", str(store), "--source", "simulated"]) == 0


def test_export_never_writes_sp_off_and_says_never(store, tmp_path, capsys):
    assert cli.main(["export", "--store", str(store), "--threshold", "never", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["provenance"]["async_tp_min_tokens"] == "never" and not doc["sp_lab"]["enable_sp"]
    out = capsys.readouterr().out
    assert "SP and AsyncTP never" in out and "has no SP or AsyncTP in its compile config: nothing to pass" in out
    assert "never paid per layer" in out


def test_export_says_what_the_file_does_in_the_vllm_release_asked(store, tmp_path, capsys):
    argv = ["export", "--store", str(store), "--threshold", "64", "--out", str(tmp_path)]
    assert cli.main([*argv, "--vllm-release", "0.18"]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.18.1 (chosen): In vLLM 0.18.1 this runs SP + AsyncTP from 64 tokens" in out
    assert "no vllm serve line: toy is sp_lab's own model" in out  # vLLM cannot load toy: the flags alone
    assert "--max-num-batched-tokens" in out and '"sp_min_token_num":64' in out and '"compile_ranges_endpoints":[63]' in out
    assert "WARNING: tuned on gloo on CPU" in out and "next: measure on the GPUs you serve on" in out
    (fn,) = tmp_path.glob("*.min_tokens_per_rank.py")
    assert fn.name in out
    assert cli.main([*argv, "--vllm-release", "0.13"]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.13.0 cannot run this policy: vLLM 0.13.0 has no token gate" in out
    assert "closest it can run: never (worst" in out and "closest it can run: always (worst" in out
    with pytest.raises(SystemExit):
        cli.main([*argv, "--vllm-release", "0.9"])
    assert "unknown vLLM release '0.9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # "0" once matched every release by prefix and wrote 0.34.0
        cli.main([*argv, "--vllm-release", "0"])
    assert "'0' is not a vLLM version" in capsys.readouterr().err
    assert cli.main([*argv, "--vllm-release", "0.19.1+cu128"]) == 0  # a build: its minor's release, said so
    captured = capsys.readouterr()
    assert "note: vLLM 0.19.1+cu128 (a pre-release, dev, post or local build) is not in the release table: read " \
           "as 0.19.1" in captured.err and "vLLM 0.19.1 (chosen)" in captured.out
    # per-matmul rows give each shape its own gate: qkv's fused form wins from 64 tokens (32 per rank) on
    matmul = tmp_path / "matmul.csv"
    pl.DataFrame([{"name": "qkv", "side": "ag", "k": 64, "n": 64, "dtype": "float32", "tp": 2, "m": m,
                   "fused_us": 10.0 if m >= 64 else 30.0, "unfused_us": 20.0} for m in (16, 64, 256)]).write_csv(matmul)
    assert cli.main([*argv, "--matmul-rows", str(matmul)]) == 0
    (fn,) = tmp_path.glob("*.min_tokens_per_rank.py")
    assert "(64, 64, 'float32', 2): 32,  # qkv (ag), per-matmul rows" in fn.read_text()
    assert cli.main([*argv, "--matmul-rows", str(tmp_path / "none.csv")]) == 2
    assert "expected a .parquet or .csv file of per-matmul rows" in capsys.readouterr().err


def test_report_never_replaces_another_stores_report_unasked(store, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert cli.main(["report", "--store", str(store), "--out", str(out), "--cdn"]) == 0
    page = out.read_text()
    # recommendation and its confidence come before the figures; tables are HTML tables
    assert page.index("Recommendation") < page.index("Latency and regret")
    assert "<table>" in page
    # sp is 2% slower than baseline below 64 tokens while each row's spread (p10-p90 of 30 us over 3 repeats) is
    # ~8% of its median: the data cannot tell "baseline below 64" from "sp below 64", and the report says so.
    assert ("64 (baseline -&gt; sp+async_tp) and 64 (sp -&gt; sp+async_tp) are not distinguishable" in page
            and "chose baseline below 64, sp+async_tp from 64 (it rewrites least)" in page)
    assert "no other one-threshold policy" not in page
    other = tmp_path / "other"
    SweepStore(other).append(curve_rows())
    assert cli.main(["report", "--store", str(other), "--out", str(out), "--cdn"]) == 2
    assert f"is the report of the rows in {store}" in capsys.readouterr().err
    assert cli.main(["report", "--store", str(other), "--out", str(out), "--cdn", "--force"]) == 0


def test_an_installed_vllm_the_table_cannot_place_fails_before_any_work(store, tmp_path, monkeypatch, capsys):
    import sp_lab.vllm_releases as V
    from sp_lab.cli import rows

    _tuning_rows = rows.tuning_rows

    monkeypatch.setattr(V, "installed_release", lambda: "0.10.2")
    monkeypatch.setattr(rows, "tuning_rows", lambda args: pytest.fail("rows were read before the release"))
    assert cli.main(["export", "--store", str(store), "--threshold", "64", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the installed vLLM: unknown vLLM release '0.10.2'") and "0.11.0 to 0.34.0" in err
    assert err.endswith("name a release to write for with --vllm-release") and "\n" not in err
    monkeypatch.setattr(V, "installed_release", lambda: "0.19.1+cu128")  # a build of a table release: its entry
    monkeypatch.setattr(rows, "tuning_rows", _tuning_rows)
    assert cli.main(["export", "--store", str(store), "--threshold", "64", "--out", str(tmp_path)]) == 0
    assert "vLLM 0.19.1 (installed here)" in capsys.readouterr().out


def test_export_refusals_are_one_line_errors_naming_the_flags(store, tmp_path, capsys):
    out = ["--out", str(tmp_path / "cfg")]

    def error(*argv: str) -> str:
        assert cli.main(list(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
        return err

    err = error("export", "--store", str(store), "--threshold", "99999", *out)
    assert "--threshold 99999 is above max_num_tokens=16384" in err and "at most 16384, or --threshold never" in err
    assert "enable_sp=False" not in err
    small = tmp_path / "small.json"
    small.write_text(LabConfig(max_num_tokens=128).to_json())
    err = error("export", "--store", str(store), "--threshold", "256", "--config", str(small), *out)
    assert f"--threshold 256 is above max_num_tokens=128 of --config {small}" in err
    assert "--config: no such config file" in error("export", "--store", str(store), "--config",
                                                    str(tmp_path / "missing.json"), *out)
    bad = tmp_path / "bad.json"
    bad.write_text('{"async_tp_min_tokens": 0}')  # a ConfigError: the field and its range
    assert "async_tp_min_tokens: must be in [1, max_num_tokens=16384], got 0" in error(
        "export", "--store", str(store), "--config", str(bad), *out)
    predicted = tmp_path / "predicted"
    SweepStore(predicted).append(curve_rows(source="predicted"))
    err = error("export", "--store", str(predicted), "--source", "predicted", "--threshold", "64", *out)
    assert "these rows are predictions" in err and "python -m sp_lab predict --export-predicted DIR" in err
    assert not (tmp_path / "cfg").exists()  # nothing written by any of them


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "bogus"], "dtype='bogus' is not a model dtype"),
    (["--repeats", "5", "--max-repeats", "2"], "need max_repeats >= repeats"),
    (["--ci-width", "0"], "ci_width > 0"),
    (["--tokens", "1,99999"], "token counts [99999] exceed config.max_num_tokens=16384"),
    (["--warmup", "-1"], "need warmup >= 0"),
    (["--tp", "3"], "tp_size=3 does not divide"),
])
def test_sweep_arguments_every_rank_would_refuse_are_refused_before_launching(argv, message, tmp_path, monkeypatch,
                                                                              capsys):
    from sp_lab.distributed import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert cli.main(["sweep", "--store", str(tmp_path / "s"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "resume" not in err, err
