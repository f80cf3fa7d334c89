"""``python -m sp_lab traffic``: the speedup as a ratio with its source, user errors as one line (exit 2). The
performance model is replaced by known rows so the command runs in a second."""

from __future__ import annotations

import pytest
from test_serving_verdict import rows

from sp_lab.cli.dispatch import main
from sp_lab.serving import step_costs


@pytest.fixture
def known_rows(monkeypatch):
    calls = []

    def fake(model, tp, gpu, dtype="bfloat16", max_tokens=8192):
        calls.append((model, tp, gpu, dtype, max_tokens))
        return rows(source="predicted", with_ci=False)

    monkeypatch.setattr(step_costs, "predicted_rows", fake)
    return calls


def test_steps_file_gives_the_speedup_as_a_ratio_and_says_predicted(known_rows, tmp_path, capsys):
    steps = tmp_path / "steps.txt"
    steps.write_text("\n".join(["1"] * 90 + ["4096"] * 10))
    assert main(["traffic", "--model", "llama-3-70b", "--tp", "8", "--steps", str(steps)]) == 0
    out = capsys.readouterr().out
    assert "rows: PREDICTED" in out
    # every step also pays the modelled LM-head read: 128256 x 8192 bf16 weights / 8 GPUs at 4800 GB/s
    head_us = 128256 * 8192 * 2 / 8 / 4800e3
    speedup = (10900 + 100 * head_us) / (8900 + 100 * head_us)
    assert f"serving speedup vs baseline: {speedup:.2f}x (predicted; sp+async_tp from 4096)" in out
    assert known_rows == [("llama-3-70b", 8, "h200", "bfloat16", 8192)]


def test_workload_with_concurrency_runs_under_the_budget(known_rows, capsys):
    assert main(["traffic", "--workload", "random", "--requests", "20", "--concurrency", "4",
                 "--max-num-batched-tokens", "4096", "--max-num-seqs", "64"]) == 0
    out = capsys.readouterr().out
    assert "max_num_batched_tokens=4096, max_num_seqs=64" in out and "TTFT" in out


def test_user_errors_are_one_line(known_rows, tmp_path, capsys):
    assert main(["traffic", "--workload", "chatty"]) == 2
    assert "unknown workload 'chatty'" in capsys.readouterr().err
    assert known_rows == []  # refused before any row was predicted
    bad = tmp_path / "t.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0,x,1\n")
    assert main(["traffic", "--trace", str(bad)]) == 2
    assert "line 2: prompt_tokens 'x' is not an integer >= 1" in capsys.readouterr().err
    # the default budget reaches past rows that end at 4096
    assert main(["traffic", "--workload", "random", "--requests", "5"]) == 2
    assert "outside the predicted rows" in capsys.readouterr().err


def test_measured_rows_from_a_store_are_said_measured_with_their_interval(tmp_path, capsys):
    from test_store import make_row

    from sp_lab.bench.store import SweepStore

    store = SweepStore(tmp_path / "sweeps")
    table = {"baseline": {1: 10.0, 64: 100.0, 256: 300.0}, "sp+async_tp": {1: 20.0, 64: 120.0, 256: 200.0}}
    store.append([make_row(t, variant=v, reported_variant=v, latency_us=us, ci_low_us=us * 0.95,
                           ci_high_us=us * 1.05) for v, pts in table.items() for t, us in pts.items()])
    steps = tmp_path / "steps.txt"
    steps.write_text("1\n256\n")
    assert main(["traffic", "--model", "toy", "--tp", "2", "--store", str(store.path), "--steps", str(steps)]) == 0
    out = capsys.readouterr().out
    assert f"rows: measured, from {store.path}" in out
    assert "serving speedup vs baseline: 1.48x (measured; sp+async_tp from 256)" in out  # (10+300)/(10+200)
    assert "interval: delta method" in out and "'toy' is not a preset" in out


def test_a_tuned_config_is_priced_through_its_own_gates(known_rows, tmp_path, capsys):
    from sp_lab.config import LabConfig
    from sp_lab.rules import MatmulRule

    steps = tmp_path / "steps.txt"
    steps.write_text("\n".join(["1"] * 90 + ["4096"] * 10))
    gated = tmp_path / "gated.json"
    LabConfig(tp_size=8, enable_sp=True, enable_async_tp=True, async_tp_min_tokens=64).to_json(gated)
    assert main(["traffic", "--steps", str(steps), "--config", str(gated)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tuned config"))
    head_us = 128256 * 8192 * 2 / 8 / 4800e3  # as above: baseline at 1 token, SP + AsyncTP at 4096
    assert line.split()[2] == f"{(10900 + 100 * head_us) / (8900 + 100 * head_us):.3f}x"
    ruled = tmp_path / "ruled.json"
    LabConfig(tp_size=8, async_tp_min_tokens=64, heuristic=MatmulRule.always("fuse")).to_json(ruled)
    assert main(["traffic", "--steps", str(steps), "--config", str(ruled)]) == 2
    assert "fuses per matmul by its own rule" in capsys.readouterr().err


def test_tuned_rows_of_several_configs_are_not_pooled(tmp_path):
    from test_store import make_row

    from sp_lab.bench.store import SweepStore
    from sp_lab.serving.step_costs import measured_rows

    store = SweepStore(tmp_path / "sweeps")
    store.append([make_row(1, variant="tuned", reported_variant="tuned", config_hash=h) for h in ("aaa", "bbb")]
                 + [make_row(1, variant="baseline", reported_variant="baseline")])
    with pytest.warns(UserWarning, match=r"tuned rows of 2 configs \(aaa, bbb\) are left out"):
        rows = measured_rows(store.path, "toy", 2)
    assert set(rows["variant"]) == {"baseline"}
