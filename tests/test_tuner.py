"""The tuner's state (no browser) and its widget wiring (ipywidgets objects, no front end)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("plotly", reason="the tuner draws with plotly (optional on GPU machines)")
from sp_lab.config import LabConfig, load_tuned_config
from sp_lab.tuning.regret import regret_table
from sp_lab.viz.latency import CONFIG_META
from sp_lab.widgets import tuner as tuner_module
from sp_lab.widgets.tuner import TunerState, predicted_rows, tune

TOKENS = [1, 8, 64, 512]
# baseline is flat-ish, sp+async_tp pays a fixed cost and wins from 512 tokens on
LATENCY = {"baseline": {1: 100.0, 8: 110.0, 64: 200.0, 512: 1000.0},
           "sp+async_tp": {1: 300.0, 8: 310.0, 64: 250.0, 512: 600.0}}


def _row(variant: str, t: int, **extra) -> dict:
    us = LATENCY[variant][t]
    return {"source": "measured", "variant": variant, "num_tokens": t, "latency_us": us, "p10_us": us * 0.9,
            "p90_us": us * 1.1, "fusion_fired": variant != "baseline", "fusion_missing": False,
            "device_name": "cpu: test", "tp": 2, "model": "toy", "hidden_size": 64, "num_layers": 2,
            "torch_version": "2.13.0", "boundary": "sharded", "dtype": "float32", "row_id": f"{variant}-{t}",
            **extra}


@pytest.fixture
def rows() -> pl.DataFrame:
    return pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS])


def test_the_config_curve_and_regret_follow_the_threshold(rows):
    state = TunerState(tp=2)
    state.set_rows(rows)
    state.threshold = 1
    assert state.gated()["latency_us"].to_list() == [300.0, 310.0, 250.0, 600.0]
    state.threshold = 512
    assert state.gated()["latency_us"].to_list() == [100.0, 110.0, 200.0, 600.0]
    assert state.regret()["regret_rel"].sum() == 0.0
    state.threshold = 64
    assert state.regret().filter(pl.col("num_tokens") == 64)["regret_rel"].item() == pytest.approx(0.25)
    state.threshold = None  # "never": baseline everywhere
    assert state.gated()["variant_run"].to_list() == ["baseline"] * 4
    assert state.regret().equals(regret_table(rows, state.tuned_config()))  # the one regret


def test_recommendation_selects_the_least_regret_policy(rows):
    state = TunerState(tp=2)
    state.set_rows(rows)
    rec = state.use_recommended()
    assert rec.policy.name == "baseline below 512, sp+async_tp from 512"
    assert state.threshold == 512 and state.shape == ("baseline", "sp+async_tp")


def test_rows_arrive_one_by_one_and_recommendation_waits_for_both_variants():
    state = TunerState(tp=2)
    state.add_row(_row("baseline", 8))
    with pytest.raises(ValueError, match="no recommendation from these rows yet"):  # one variant: no choice yet
        state.recommendation()
    state.add_row(_row("sp+async_tp", 8))
    assert state.recommendation() is not None and state.done == 2


def test_mixed_sources_are_refused(rows):
    state = TunerState(tp=2)
    with pytest.raises(ValueError, match="mix sources"):
        state.set_rows(pl.concat([rows, rows.with_columns(source=pl.lit("predicted"))]))


def test_export_round_trips_the_policy(rows, tmp_path):
    state = TunerState(tp=2, config=LabConfig(tp_size=2))
    state.set_rows(rows)
    state.threshold = 64
    path = state.export(tmp_path)
    config, provenance = load_tuned_config(path)
    assert config.async_tp_min_tokens == 64 and config.enable_sp and config.enable_async_tp
    assert provenance["recommendation"]["async_tp_min_tokens"] == 512
    assert provenance["async_tp_min_tokens"] == "64"
    assert provenance["data_hash"] == state.data_hash()
    assert provenance["regret"]["per_token"]["64"]["regret_rel"] == pytest.approx(0.25)


def test_mistakes_on_an_empty_tuner_are_answered_in_the_calling_cell(tmp_path):
    """Export and the recommendation raise where they were called (not only in the widget's status line),
    saying to run a sweep first; a mistyped model is refused by tune() itself, with the closest name."""
    with pytest.raises(ValueError, match="run a sweep first"):
        TunerState(tp=2).export(tmp_path)
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path)
    with pytest.raises(ValueError, match=r"no rows yet: run a sweep first \(tuner.run_sweep\(\)"):
        tuner.state.recommendation()
    with pytest.raises(ValueError, match="run a sweep first"):
        tuner.export()
    assert "run a sweep first" in tuner.status.value  # the widget says it too
    with pytest.raises(ValueError, match="did you mean 'llama-3-8b'"):
        tune("lama-3-8b", tp=2, store_dir=None, export_dir=tmp_path)


def test_default_store_and_out_are_the_projects_whatever_the_working_directory(tmp_path, monkeypatch):
    """A kernel in notebooks/ and the CLI at the top of the checkout meet in one store: <project>/out/sweeps."""
    project = tmp_path / "project"
    (project / "notebooks").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.delenv("SP_LAB_OUT", raising=False)
    monkeypatch.chdir(project / "notebooks")
    tuner = tune("toy", tp=2, token_counts=TOKENS)
    assert Path(tuner.state.store_dir) == project.resolve() / "out" / "sweeps"
    assert Path(tuner.export_dir.value) == project.resolve() / "out"
    monkeypatch.setenv("SP_LAB_OUT", str(tmp_path / "elsewhere"))
    assert Path(tune("toy", tp=2).state.store_dir) == (tmp_path / "elsewhere" / "sweeps").resolve()


def test_live_sweep_needs_a_store():
    with pytest.raises(ValueError, match="store_dir"):
        TunerState(tp=2).run_sweep()


def test_demo_replay_is_the_performance_model_and_says_so_everywhere(tmp_path):
    from sp_lab.tuning.predict.layer import predict_layers
    from sp_lab.viz.latency import SWEEP_COLUMNS

    df = predicted_rows("llama-3-70b", 8, [1, 512, 4096])
    assert set(df["source"]) == {"predicted"} and not set(SWEEP_COLUMNS) - set(df.columns)
    # one model: the demo rows are the performance model's whole-layer rows, not another formula
    model = predict_layers("llama-3-70b", 8, [1, 512, 4096], "h200", full_layer=True).sort("num_tokens", "variant")
    assert df.sort("num_tokens", "variant")["latency_us"].to_list() == model["latency_us"].to_list()

    tuner = tune("llama-3-70b", tp=8, token_counts=[1, 512, 4096], store_dir=None, export_dir=tmp_path, replay=True)
    assert tuner.state.source == "predicted" and "predicted by the performance model" in tuner.status.value
    assert "source: predicted" in tuner.figure.layout.title.text
    assert {t.name for t in tuner.figure.data if t.name} >= {"baseline (predicted)", "sp+async_tp (predicted)"}
    assert "from predicted rows: the performance model's choice, not measured" in tuner.regret_html.value
    with pytest.raises(ValueError, match="allow_predicted"):  # exporting the model's choice needs an explicit call
        tuner.export()
    path = tuner.export(allow_predicted=True)
    assert json.loads(path.read_text())["provenance"]["source"] == "predicted"
    assert "from predicted rows: not measured" in tuner.status.value


def _gated_trace(tuner):
    return next(t for t in tuner.figure.data if t.meta == CONFIG_META)


def test_widget_slider_moves_the_config_curve_to_what_the_config_runs(rows, tmp_path):
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path, replay=rows)
    assert tuner.slider.value == "512" and list(_gated_trace(tuner).y) == [100.0, 110.0, 200.0, 600.0]
    tuner.slider.value = "1"  # what dragging the slider does
    assert list(_gated_trace(tuner).y) == [300.0, 310.0, 250.0, 600.0]
    tuner.slider.value = "never"
    assert list(_gated_trace(tuner).y) == [100.0, 110.0, 200.0, 1000.0]
    assert "recommended" in tuner.regret_html.value
    latency = [t for t in tuner.figure.data if str(t.meta).startswith("latency:")]
    assert {t.name for t in latency} == {"baseline", "sp+async_tp"}


def test_before_a_sweep_the_slider_says_what_the_legend_says(tmp_path):
    """No rows yet, the threshold is the config's default (128) and no token count of the sweep: the slider shows
    128, as the config's legend entry does (it read "never" beside "from 128")."""
    tuner = tune("toy", tp=2, token_counts=[3, 16, 64], store_dir=None, export_dir=tmp_path)
    assert tuner.state.threshold == 128 and tuner.slider.value == "128"
    assert "from 128" in _gated_trace(tuner).name
    tuner.slider.value = "16"
    assert "from 16" in _gated_trace(tuner).name and tuner.state.threshold == 16


def test_buttons_keep_their_text_and_rows_wrap_at_any_width(tmp_path):
    """Layout, not pixels: a button is as wide as its text and never shrinks ("Use recommend..."), and each row of
    controls wraps when the notebook is narrower than it."""
    import ipywidgets as w

    tuner = tune("toy", tp=2, token_counts=[3, 16, 64], store_dir=None, export_dir=tmp_path)

    def walk(widget):
        yield widget
        for child in getattr(widget, "children", ()):
            yield from walk(child)

    every = list(walk(tuner.widget))
    buttons = [b for b in every if isinstance(b, w.Button)]
    assert {b.description for b in buttons} >= {"Run sweep", "Use recommended", "Export config"}
    assert all(b.layout.flex == "0 0 auto" and b.layout.width == "auto" for b in buttons)
    rows = [b for b in every if isinstance(b, w.HBox)]
    assert rows and all(r.layout.flex_flow == "row wrap" for r in rows)


def test_never_is_one_explicit_value_in_widget_file_and_provenance(tmp_path):
    slow = pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS[:3]])  # fusion never wins below 512
    tuner = tune("toy", tp=2, token_counts=TOKENS[:3], store_dir=None, export_dir=tmp_path, replay=slow)
    assert tuner.slider.value == "never" and tuner.state.threshold is None
    path = tuner.export()
    config, provenance = load_tuned_config(path)
    assert not config.enable_sp and not config.enable_async_tp
    assert provenance["async_tp_min_tokens"] == "never"
    assert provenance["recommendation"]["async_tp_min_tokens"] == "never"
    assert provenance["policy"] == "baseline everywhere (SP and AsyncTP never)"
    # what the file says is what the widget printed
    assert f"{provenance['policy']} (async_tp_min_tokens=never)" in tuner.status.value
    # vLLM 0.34 has no SP fields: "never" passes nothing, so the user's own CUDA-graph mode stays; the toy is no
    # model vLLM can load, so there is no serve line to print
    vllm = json.loads(path.read_text())["vllm"]
    assert vllm["release"] == "0.34.0" and vllm["compilation_config"] == {} and vllm["serve"] is None
    assert "nothing to pass" in vllm["does"] and "your CUDA-graph mode" in vllm["does"]
    assert path.with_name(path.stem + ".min_tokens_per_rank.py").is_file()


def test_each_arriving_row_redraws_the_plot(rows, monkeypatch, tmp_path):
    """A live sweep's k rows arriving one by one give k points, the figure redrawn after each."""
    ordered = rows.sort("num_tokens", "variant").to_dicts()
    seen: list[int] = []
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=str(tmp_path), export_dir=tmp_path)

    def fake_launch_sweep(model, *, on_row, **kwargs):
        for row in ordered:
            on_row(row)
            seen.append(sum(len(t.x) for t in tuner.figure.data if str(t.meta).startswith("latency:")))
        return type("Result", (), {"rows": ordered, "skipped": 0, "store_dir": str(tmp_path)})()

    import sp_lab.bench.sweep

    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep", fake_launch_sweep)
    tuner.run_sweep()
    assert seen == list(range(1, len(ordered) + 1))
    assert tuner.progress.value == len(ordered)
    assert tuner_module.TunerState is TunerState


def test_vllms_hopper_rule_is_shown_for_gpu_rows_only_and_regret_reads_in_percent(rows, tmp_path):
    """A CPU toy gets no "vLLM's rule (Hopper)" line or marker; H200 rows do. Worst and summed regret are both %."""
    cpu = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path, replay=rows)
    assert "vLLM" not in cpu.regret_html.value
    assert not any(str(a.text).startswith("vLLM") for a in cpu.figure.layout.annotations)
    table = cpu.state.regret()
    summed = f"summed over the token counts {100 * table['regret_rel'].sum():.1f}%"
    assert summed in cpu.regret_html.value and "total 0." not in cpu.regret_html.value
    gpu_rows = rows.with_columns(device_name=pl.lit("NVIDIA H200"), model=pl.lit("llama-3-70b"),
                                 hidden_size=pl.lit(8192), tp=pl.lit(8), dtype=pl.lit("bfloat16"))
    gpu = tune("llama-3-70b", tp=8, token_counts=TOKENS, store_dir=None, export_dir=tmp_path, replay=gpu_rows)
    assert "vLLM's own rule on Hopper for this model and tp: SP from" in gpu.regret_html.value
    assert any(str(a.text).startswith("vLLM sp_min_token_num=") for a in gpu.figure.layout.annotations)


def test_the_demo_button_says_what_it_shows_and_answers_in_the_status_line(tmp_path):
    """The button shows the performance model's rows, not a recording, and says so. Clicked for a model the
    predictor cannot predict (the toy) it used to raise inside the click handler, unseen: the status line says
    why and what works; for a preset it shows the predicted demo."""
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path)
    assert tuner.demo_button.description == "Predicted demo (H200)"
    tuner.demo_button.click()
    assert "predicted demo failed: ValueError: no predicted demo for 'toy' at tp=2: unknown model preset" in (
        tuner.status.value)
    assert "pick one and a tp that divides its heads (e.g. llama-3-70b, tp 8)" in tuner.status.value
    assert "#b00" in tuner.status.value and not tuner.state.snapshot().height
    tuner.model.value, tuner.tp.value = "llama-3-70b", 8
    tuner.demo_button.click()
    assert tuner.state.source == "predicted" and "predicted by the performance model" in tuner.status.value


def test_the_figure_is_labelled_from_its_rows_not_the_setup_controls(rows, tmp_path):
    """tune("toy") showing 70B rows is titled with the 70B rows' model, tp, device and torch; a single machine's
    measured rows name their device and torch too."""
    demo = predicted_rows("llama-3-70b", 8, TOKENS)
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path)
    assert tuner.figure.layout.title.text.startswith("toy tp=2: forward latency vs tokens (no rows yet)")
    tuner.replay(demo)
    title = tuner.figure.layout.title.text
    assert "model llama-3-70b · tp 8 · device predicted: 8x H200 SXM 141GB · torch n/a (predicted)" in title
    assert "source: predicted" in title and "toy" not in title
    tuner.replay(rows)
    title = tuner.figure.layout.title.text
    assert "model toy · tp 2 · device cpu: test · torch 2.13.0" in title and "source: measured" in title
    assert f"<b>rows:</b> {tuner.state.provenance()}" in tuner.regret_html.value  # beside the recommendation


def test_recorded_rows_replay_as_replayed_and_a_live_sweep_never_merges_with_them(tmp_path, monkeypatch):
    """Another machine's store replays as python -m sp_lab replay imports it (timings: "replayed"), not as
    measurements of this machine; a live sweep afterwards shows its own rows only."""
    from test_cli import curve_rows

    from sp_lab.bench.store import SweepStore

    elsewhere = tmp_path / "h200_store"
    SweepStore(elsewhere).append(curve_rows(device_name="NVIDIA H200", torch_version="2.9.0"))
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=str(tmp_path / "mine"), export_dir=tmp_path,
                 replay=elsewhere)
    assert tuner.state.source == "replayed" and f"rows recorded in {elsewhere}" in tuner.status.value
    assert "device NVIDIA H200 · torch 2.9.0" in tuner.figure.layout.title.text
    assert "source: replayed" in tuner.figure.layout.title.text

    live = [_row(v, t) for v in LATENCY for t in TOKENS]

    def fake_launch_sweep(model, *, on_row, **kwargs):
        for row in live:
            on_row(row)
        return type("Result", (), {"rows": live, "skipped": 0, "store_dir": str(tmp_path / "mine")})()

    import sp_lab.bench.sweep

    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep", fake_launch_sweep)
    tuner.run_sweep()
    shown = tuner.state.snapshot()
    assert shown.height == len(live) and set(shown["device_name"]) == {"cpu: test"}
    assert tuner.state.source == "measured" and "NVIDIA H200" not in tuner.figure.layout.title.text
    # measured rows of another setup shown by replay(DataFrame) are not merged either
    tuner.replay(pl.DataFrame(live).with_columns(device_name=pl.lit("cpu: another box")))
    tuner.run_sweep()
    assert set(tuner.state.snapshot()["device_name"]) == {"cpu: test"}


def test_a_resumed_sweep_shows_the_stored_rows_it_skipped_and_no_other_devices(tmp_path, monkeypatch):
    """A rerun measures nothing new and shows the store's rows of its setup: those of the device and backend it ran
    on (the resume key's columns: another host with the same device counts as done, so it is shown), never another
    device's measured rows in a store they share."""
    from test_cli import curve_rows

    import sp_lab.bench.sweep
    from sp_lab.bench.setups import setup_of_row
    from sp_lab.bench.store import SweepStore

    store = tmp_path / "shared"
    SweepStore(store).append(curve_rows(hostname="this-box")[:6] + curve_rows(hostname="twin-box")[6:]
                             + curve_rows(hostname="another-box", device_name="cpu: another box")
                             # the same device, model, layers and tp, another setup swept later: bf16
                             + curve_rows(hostname="this-box", dtype="bfloat16",
                                          timestamp="2026-12-06T22:00:00.000+00:00"))
    tuner = tune("toy", tp=2, token_counts=[1, 4, 16, 64, 256], variants=["baseline", "sp+async_tp"],
                 store_dir=str(store), export_dir=tmp_path)
    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep", lambda model, **kwargs: type(
        "Result", (), {"rows": [], "skipped": 10, "store_dir": str(store), "device_name": "cpu: test",
                       "backend": "gloo", "setup": setup_of_row(curve_rows()[0])})())
    tuner.run_sweep()
    shown = tuner.state.snapshot()
    assert shown.height == 10 and set(shown["device_name"]) == {"cpu: test"}
    assert set(shown["hostname"]) == {"this-box", "twin-box"}
    assert set(shown["dtype"]) == {"float32"}


# ----------------------------------------------------------------------------------- a store of several setups
def _three_setups_store(path: Path) -> Path:
    """What `make run` then notebook 06 leave in the project's store: the float32 toy with 2 layers (21:00), then
    the bf16 and the FP8 toy with 1 layer (22:00, 22:05), every row with its variant's real config."""
    from test_cli import curve_rows

    from sp_lab.bench.store import SweepStore
    from sp_lab.programs import variant_config

    def sweep(when: str, scale: float, **setup) -> list[dict]:
        rows = curve_rows(timestamp=f"2026-12-06T{when}:00.000+00:00", sweep_id=when, **setup)
        return [{**r, "latency_us": scale * r["latency_us"],
                 "config_json": variant_config(r["variant"], LabConfig(tp_size=2)).to_json()} for r in rows
                if r["variant"] != "sp" or not setup]  # notebook 06 sweeps baseline and sp+async_tp only
    store = SweepStore(path)
    store.append(sweep("21:00", 1.0))
    store.append(sweep("22:00", 3.0, num_layers=1, dtype="bfloat16"))
    store.append(sweep("22:05", 0.3, num_layers=1, dtype="fp8-rowwise"))
    return path


def test_replaying_a_store_of_three_setups_shows_one_says_which_and_lists_the_others(tmp_path):
    """The issue's store: replay showed 12 traces of three setups and no recommendation ("a policy needs baseline
    and sp ... rows" although they were there). Now it shows the newest setup alone, says so, lists the other two
    with their row counts, and recommends; the one asked for is shown instead; one that is not there is refused."""
    store = _three_setups_store(tmp_path / "sweeps")
    tuner = tune("toy", tp=2, store_dir=None, export_dir=tmp_path, replay=store)
    shown = tuner.state.snapshot()
    assert shown.height == 10 and set(shown["dtype"]) == {"fp8-rowwise"} and set(shown["num_layers"]) == {1}
    status = tuner.status.value
    assert "setup: the newest of 3 in these rows, toy (1 layer, hidden 64), fp8-rowwise, tp 2" in status
    assert "setup={&#x27;num_layers&#x27;: 1, &#x27;dtype&#x27;: &#x27;bfloat16&#x27;}: 10 rows" in status
    assert "setup={&#x27;num_layers&#x27;: 2, &#x27;dtype&#x27;: &#x27;float32&#x27;}: 15 rows" in status
    assert tuner.state.recommendation_or_none() is not None and "<b>recommended:</b>" in tuner.regret_html.value
    assert "values (see the legend)" not in tuner.state.provenance()  # nothing varies within what is shown
    assert not [t.name for t in tuner.figure.data if "dtype=" in (t.name or "")]  # no curve per dtype

    asked = tune("toy", tp=2, store_dir=None, export_dir=tmp_path, replay=store, setup={"dtype": "float32"})
    assert asked.state.snapshot().height == 15 and set(asked.state.snapshot()["num_layers"]) == {2}
    assert "setup asked for (setup={&#x27;dtype&#x27;: &#x27;float32&#x27;}): toy (2 layers" in asked.status.value
    assert asked.state.choice.how == "asked" and len(asked.state.choice.others) == 2

    from sp_lab.bench.setups import SetupNotFoundError

    with pytest.raises(SetupNotFoundError, match=r"no rows of the setup asked for \(setup=\{'dtype': 'float16'\}\)"
                                                 r"; the rows hold 3 setup\(s\)"):
        tune("toy", tp=2, store_dir=None, export_dir=tmp_path, replay=store, setup={"dtype": "float16"})
    with pytest.raises(ValueError, match=r"setup fields \['dtyp'\] do not exist"):
        tune("toy", tp=2, store_dir=None, export_dir=tmp_path, setup={"dtyp": "float16"})
    # rows given as they are must be one setup: never drawn or scored together
    from sp_lab.bench.store import SweepStore

    with pytest.raises(ValueError, match="rows of 3 setups"):
        TunerState(tp=2).set_rows(SweepStore(store).read())


def test_without_a_recommendation_the_panel_says_what_is_missing(tmp_path):
    """Rows of one setup where baseline and sp+async_tp never share a token count: the panel says which variant
    was measured where, not a fixed sentence."""
    rows = pl.DataFrame([_row("baseline", 1), _row("baseline", 8), _row("sp+async_tp", 64)])
    tuner = tune("toy", tp=2, store_dir=None, export_dir=tmp_path, replay=rows)
    assert "the rows have baseline at [1, 8]; sp+async_tp at [64]" in tuner.regret_html.value


# ------------------------------------------------------------------------------------------ reused points
def test_the_tuners_bar_counts_the_points_a_rerun_reuses_and_says_from_where(tmp_path, monkeypatch):
    """Notebook 03's bar stayed at "2 / 6" when 4 points came from an earlier sweep: it now counts them, and the
    status line says where they come from, while the sweep runs and after."""
    import sp_lab.bench.sweep
    from sp_lab.bench.progress import ReusedFrom, SweepTally

    earlier = (ReusedFrom(sweep_id="s0", newest="2026-12-06T22:10:00.000+00:00", points=4),)
    seen = []

    def fake_launch_sweep(model, *, on_row, on_tally, **kwargs):
        tally = SweepTally(total=6, reused=4, origins=earlier)
        on_tally(tally)
        seen.append((tuner.progress.value, tuner.progress.max, tuner.progress.description, tuner.status.value))
        for i, t in enumerate((64, 512)):
            on_row(_row("sp+async_tp", t))
            on_tally(tally.with_measured(i + 1))
        seen.append((tuner.progress.value, tuner.progress.max, tuner.progress.description, tuner.status.value))
        return type("Result", (), {"rows": [1, 2], "skipped": 4, "store_dir": str(tmp_path), "setup": None,
                                   "tally": tally.with_measured(2)})()

    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep", fake_launch_sweep)
    tuner = tune("toy", tp=2, token_counts=[8, 64, 512], variants=["baseline", "sp+async_tp"],
                 store_dir=str(tmp_path), export_dir=tmp_path)
    tuner.run_sweep()
    start, end = seen
    assert start[:3] == (4, 6, "4 / 6") and end[:3] == (6, 6, "6 / 6")
    assert "4 of 6 points from the sweep of 2026-12-06 22:10 UTC, 0 of 2 measured now" in start[3]
    assert "4 of 6 points from the sweep of 2026-12-06 22:10 UTC, 2 measured now" in end[3]
    assert "sweep done: 4 of 6 points from the sweep of 2026-12-06 22:10 UTC, 2 measured now" in tuner.status.value
    assert (tuner.progress.value, tuner.progress.description) == (6, "6 / 6")


# ------------------------------------------------------------------------------------------ early refusals
def test_mistakes_knowable_before_the_ranks_start_are_refused_in_the_calling_cell(tmp_path, monkeypatch):
    """tune("toy", tp=4) used to be accepted, failing at run_sweep() with the status line stuck at "sweeping toy on
    4 ranks ..."; a checkpoint path that does not exist read "unknown model". Each is refused by tune() itself,
    naming the value and what works, and no rank is started."""
    import sp_lab.bench.sweep
    from sp_lab.bench.sweep import SweepArgumentError
    from sp_lab.models.registry import CheckpointNotFoundError

    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep",
                        lambda *a, **k: pytest.fail("ranks were started for a sweep that cannot run"))
    args = {"store_dir": str(tmp_path / "sweeps"), "export_dir": tmp_path}
    with pytest.raises(SweepArgumentError, match=r"'toy' cannot run on 4 ranks: tp_size=4 does not divide "
                                                 r".*tp_size values that work for this model: \[1, 2\]"):
        tune("toy", tp=4, **args)
    missing = tmp_path / "checkpoints" / "llama"
    with pytest.raises(CheckpointNotFoundError, match=f"checkpoint directory .* not found: {missing}"):
        tune(str(missing), tp=2, **args)
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        tune(str(missing), tp=2, store_dir=None, export_dir=tmp_path)  # replay-only tuners too
    with pytest.raises(TypeError, match=r"unknown arguments \['repeat'\]"):
        tune("toy", tp=2, repeat=3, **args)
    with pytest.raises(SweepArgumentError, match=r"token counts must be positive ints, got \[0\]"):
        tune("toy", tp=2, token_counts=[0, 8], **args)
    with pytest.raises(SweepArgumentError, match="dtype='float8' is not a model dtype"):
        tune("toy", tp=2, dtype="float8", **args)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SweepArgumentError, match="store_dir=.*a_file.* is a file"):
        tune("toy", tp=2, store_dir=str(tmp_path / "a_file"), export_dir=tmp_path)
    with pytest.raises(ValueError, match="export_dir=.*a_file.* is a file"):
        tune("toy", tp=2, store_dir=None, export_dir=tmp_path / "a_file")
    with pytest.raises(ValueError, match=r"threshold=-8: give a token count >= 1"):
        tune("toy", tp=2, threshold=-8, **args)
    assert tune("toy", tp=2, backend="gloo", timeout=60.0, **args).state.sweep_kwargs["backend"] == "gloo"

    # tp changed in the widget: refused when the sweep is asked for, and the status line says why
    tuner = tune("toy", tp=2, **args)
    tuner.tp.value = 4
    with pytest.raises(SweepArgumentError, match="'toy' cannot run on 4 ranks"):
        tuner.run_sweep()
    assert "sweep failed: SweepArgumentError: &#x27;toy&#x27; cannot run on 4 ranks" in tuner.status.value
    assert "sweeping" not in tuner.status.value


def test_a_sweep_that_fails_in_its_ranks_says_so_in_the_status_line(tmp_path, monkeypatch):
    import sp_lab.bench.sweep

    def failing_launch_sweep(model, **kwargs):
        raise RuntimeError("rank 1 died (SIGKILL)")

    monkeypatch.setattr(sp_lab.bench.sweep, "launch_sweep", failing_launch_sweep)
    tuner = tune("toy", tp=2, store_dir=str(tmp_path), export_dir=tmp_path)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        tuner.run_sweep()
    assert "sweep failed: RuntimeError: rank 1 died (SIGKILL)" in tuner.status.value
    assert not tuner.state.running
