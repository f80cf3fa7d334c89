"""The vLLM release table and sp_lab's export per release, against facts read in vLLM's own sources.

Every expected value below was written by hand from the release's wheel (``vllm/config/compilation.py``, the SP
pass ``is_applicable*`` method, ``vllm/config/vllm.py``'s range code, ``vllm/models/common/ops/
sequence_parallel.py``), never from the table under test: a table or an exporter that drifts from vLLM fails.
The policy throughout: tp 4, SP + AsyncTP from 256 tokens, max 8192 tokens, CUDA graphs as the user chose.
"""

import json

import pytest

from sp_lab.config import ConfigError, LabConfig
from sp_lab.programs import closest_policy
from sp_lab.vllm_releases import (
    DEFAULT_RELEASE,
    installed_release,
    release,
    resolve_release,
    target_release,
    unknown_fields,
    vllm_export,
)

FROM_256 = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)
EVERYWHERE = LabConfig(tp_size=4, async_tp_min_tokens=1, max_num_tokens=8192)
NEVER = LabConfig(tp_size=4, enable_sp=False, enable_async_tp=False, max_num_tokens=8192)

# (release, what the 256-token policy exports to): the --compilation-config object, or None when the release
# cannot run it, with the expressible "never" object that is then offered.
LITERAL = {
    # 0.11.0: `level`, old flag names, SP only at static compile sizes (is_applicable_for_shape): no threshold.
    "0.11.0": (None, {"level": 3, "pass_config": {"enable_sequence_parallelism": False, "enable_async_tp": False},
                      "cudagraph_mode": "NONE"}),
    # 0.11.1: `mode`, old flag names; is_applicable returns True with splitting_ops [] -> every size.
    "0.11.1": (None, {"mode": 3, "pass_config": {"enable_sequence_parallelism": False, "enable_async_tp": False},
                      "cudagraph_mode": "NONE"}),
    # 0.12.0: renamed flags, no ranges field yet, still every size.
    "0.12.0": (None, {"mode": 3, "pass_config": {"enable_sp": False, "fuse_gemm_comms": False},
                      "cudagraph_mode": "NONE"}),
    "0.13.0": (None, {"mode": 3, "pass_config": {"enable_sp": False, "fuse_gemm_comms": False},
                      "cudagraph_mode": "NONE"}),
    "0.16.0": (None, {"mode": 3, "pass_config": {"enable_sp": False, "fuse_gemm_comms": False},
                      "cudagraph_mode": "NONE"}),
    # 0.17: sp_min_token_num gates SP (compile_range.start >= min_token_num), ranges still *_split_points.
    "0.17.1": ({"mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 256},
                "splitting_ops": [], "compile_ranges_split_points": [255], "cudagraph_mode": "NONE"}, None),
    # 0.18: compile_ranges_endpoints.
    "0.18.0": ({"mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 256},
                "splitting_ops": [], "compile_ranges_endpoints": [255], "cudagraph_mode": "NONE"}, None),
    "0.20.2": ({"mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 256},
                "splitting_ops": [], "compile_ranges_endpoints": [255], "cudagraph_mode": "NONE"}, None),
    "0.31.0": ({"mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 256},
                "splitting_ops": [], "compile_ranges_endpoints": [255], "cudagraph_mode": "NONE"}, None),
    # 0.32: sequence_parallelism.py and collective_fusion.py are gone, and the PassConfig fields with them: "never"
    # has nothing to write (a cudagraph_mode would change the user's graphs, FULL_AND_PIECEWISE by default there).
    "0.32.0": (None, {}),
    "0.34.0": (None, {}),
}


@pytest.mark.parametrize("version", sorted(LITERAL))
def test_export_per_release_is_what_vllm_runs(version):
    expected, never = LITERAL[version]
    export = vllm_export(FROM_256, version)
    assert export.compilation_config == expected
    if expected is None:
        assert export.not_expressible and export.closest["never"]["compilation_config"] == never
        with pytest.raises(ConfigError, match="closest vLLM .* can run: never"):
            FROM_256.to_vllm(version)
    else:
        assert export.not_expressible is None and "from 256 tokens" in export.does
        assert "[1, 255] without, [256, 8192] with" in export.does
    assert vllm_export(NEVER, version).compilation_config == never or expected is not None


def test_why_a_release_cannot_run_a_threshold():
    assert "only at static compile_sizes" in vllm_export(FROM_256, "0.11.0").not_expressible
    assert "no token gate" in vllm_export(FROM_256, "0.11.1").not_expressible
    assert "removed the SP and AsyncTP compile passes" in vllm_export(FROM_256, "0.32.0").not_expressible
    # where SP runs at every size once splitting_ops is [], "always" is the other expressible choice
    assert vllm_export(FROM_256, "0.13.0").closest["always"]["compilation_config"] == {
        "mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True}, "splitting_ops": [],
        "cudagraph_mode": "NONE"}
    assert "always" not in vllm_export(FROM_256, "0.11.0").closest  # only static sizes there
    two_gates = LabConfig(tp_size=4, sp_min_tokens=16, async_tp_min_tokens=256)
    assert "one gate for both" in vllm_export(two_gates, "0.31.0").not_expressible


def test_sp_everywhere_is_expressible_from_0_11_1():
    assert vllm_export(EVERYWHERE, "0.11.1").compilation_config == {
        "mode": 3, "pass_config": {"enable_sequence_parallelism": True, "enable_async_tp": True},
        "splitting_ops": [], "cudagraph_mode": "NONE"}
    assert vllm_export(EVERYWHERE, "0.16.0").compilation_config == {
        "mode": 3, "pass_config": {"enable_sp": True, "fuse_gemm_comms": True}, "splitting_ops": [],
        "cudagraph_mode": "NONE"}
    assert vllm_export(EVERYWHERE, "0.11.0").compilation_config is None


@pytest.mark.parametrize(("mode", "with_sp", "without_sp"), [
    ("none", "NONE", "NONE"),  # never switched on (vLLM's default would capture graphs)
    ("full", "FULL", "FULL"),
    ("piecewise", "NONE", "PIECEWISE"),  # no pieces under SP; vLLM would turn PIECEWISE into FULL
    ("full_and_piecewise", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"),
])
def test_cuda_graph_mode_is_kept_never_switched_on(mode, with_sp, without_sp):
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, cudagraph_mode=mode)
    assert vllm_export(config, "0.18").compilation_config["cudagraph_mode"] == with_sp
    off = LabConfig(tp_size=4, enable_sp=False, enable_async_tp=False, cudagraph_mode=mode)
    assert vllm_export(off, "0.31").compilation_config["cudagraph_mode"] == without_sp
    assert vllm_export(off, "0.34").compilation_config == {}  # 0.32+: nothing for SP, graphs as the user runs them


# facts per release, read from each wheel: (mode field, SP flag, threshold field, ranges field, unknown keys,
# what gates SP, whether splitting_ops [] must be written)
FACTS = {
    "0.11.0": ("level", "enable_sequence_parallelism", None, None, "dropped", "static_sizes", False),
    "0.11.1": ("mode", "enable_sequence_parallelism", None, None, "dropped", "every_size", True),
    "0.12.0": ("mode", "enable_sp", None, None, "dropped", "every_size", True),
    "0.13.0": ("mode", "enable_sp", None, "compile_ranges_split_points", "rejected", "every_size", True),
    "0.16.0": ("mode", "enable_sp", None, "compile_ranges_split_points", "rejected", "every_size", True),
    "0.17.0": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_split_points", "rejected",
               "sp_min_token_num", True),
    "0.18.0": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_endpoints", "rejected", "sp_min_token_num",
               True),
    "0.19.0": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_endpoints", "rejected", "sp_min_token_num",
               True),
    "0.19.1": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_endpoints", "rejected", "sp_min_token_num",
               True),
    "0.20.2": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_endpoints", "rejected", "sp_min_token_num",
               False),
    "0.31.0": ("mode", "enable_sp", "sp_min_token_num", "compile_ranges_endpoints", "rejected", "sp_min_token_num",
               False),
    "0.32.0": ("mode", None, None, "compile_ranges_endpoints", "rejected", "removed", None),
    "0.34.0": ("mode", None, None, "compile_ranges_endpoints", "rejected", "removed", None),
}


@pytest.mark.parametrize("version", sorted(FACTS))
def test_release_table_matches_the_wheels(version):
    r = release(version)
    assert (r.mode_field, r.sp_flag, r.sp_threshold_field, r.ranges_field, r.unknown_keys, r.sp_gate,
            r.splitting_ops_empty_needed) == FACTS[version]
    assert r.wheel.startswith(f"vllm-{version}-") and r.config_file == "vllm/config/compilation.py"
    assert r.cudagraph_modes == ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def test_release_table_field_lists():
    assert "level" in release("0.11.0").compilation_fields and "mode" not in release("0.11.0").compilation_fields
    assert {"level", "mode"} <= release("0.11.1").compilation_fields  # level deprecated, still accepted
    assert "level" not in release("0.18.0").compilation_fields
    assert {"enable_sp", "enable_sequence_parallelism"} <= release("0.12.0").pass_fields  # old names deprecated
    assert "enable_sequence_parallelism" not in release("0.13.0").pass_fields
    assert not {"enable_sp", "fuse_gemm_comms", "sp_min_token_num"} & release("0.32.0").pass_fields
    assert unknown_fields({"compile_ranges_endpoints": [255]}, "0.17") == ["compile_ranges_endpoints"]
    assert unknown_fields({"pass_config": {"sp_min_token_num": 1}}, "0.16") == ["pass_config.sp_min_token_num"]
    # model-level SP in 0.34: a min_tokens argument and a 1024-rows-per-rank fused all-gather + matmul
    assert release("0.34.0").model_sp["is_sequence_parallel_active"] == ["is_enabled", "num_tokens", "min_tokens"]
    assert release("0.34.0").model_sp["fused_all_gather_matmul_min_tokens_per_rank"] == 1024
    assert release("0.33.0").model_sp["is_sequence_parallel_active"] == ["is_enabled", "num_tokens"]
    # 0.19.1 added a pass field 0.19.0 lacks: the table holds both patches (read from both wheels)
    assert "fuse_minimax_qk_norm" in release("0.19.1").pass_fields - release("0.19.0").pass_fields
    assert release("0.19.0").pass_fields < release("0.19.1").pass_fields
    assert resolve_release("0.19.0") == (release("0.19.0"), None)
    assert release("0.34.0").wheel_sha256 == "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"


def test_release_names():
    assert DEFAULT_RELEASE == "0.34.0"  # the newest on the package index when the table was read
    assert release("0.18").version == "0.18.1" and release("0.11").version == "0.11.2"
    assert resolve_release("0.18.1") == (release("0.18.1"), None)  # a table version or a minor: nothing to say
    supported = r"supported: 0\.11\.0 to 0\.34\.0, by minor 0\.11, 0\.12, .*0\.34"
    for outside in ("0.9", "0.10.2", "0.99.0", "1.0.0"):  # before the table, or never read (fields may differ)
        with pytest.raises(KeyError, match=rf"unknown vLLM release '{outside}': the release table has no "
                                           rf".*{supported}"):
            release(outside)
    for garbage in ("0", "latest", "0.x", "18", "0.18.x"):  # "0" used to match every release by prefix (0.34.0)
        with pytest.raises(KeyError, match=rf"'{garbage}' is not a vLLM version .*{supported}"):
            release(garbage)
    with pytest.raises(ConfigError, match="unknown vLLM release '0.9'"):
        FROM_256.to_vllm("0.9")


@pytest.mark.parametrize(("installed", "read_as", "build"), [
    ("0.22.0", "0.22.1", False),  # a patch the table lacks (read: same facts as 0.22.1): the minor's release
    ("0.19.1+cu128", "0.19.1", True),  # a local build of a table release
    ("0.20.0.dev5+g1a2b3c4", "0.20.2", True),  # a dev build: the minor's only release
    ("0.18.1.post1", "0.18.1", True),
    ("0.17.4", "0.17.1", False),  # the newest patch of the minor not above it
    ("0.11.0rc1", "0.11.0", True),
    ("0.34.1", "0.34.0", False),
])
def test_builds_and_unknown_patches_are_read_as_their_minors_release_and_say_so(installed, read_as, build):
    rel, note = resolve_release(installed)
    assert rel.version == read_as
    assert note == (f"vLLM {installed}{' (a pre-release, dev, post or local build)' if build else ''} is not in the "
                    f"release table: read as {read_as}, the table's {rel.minor} release")
    with pytest.warns(UserWarning, match=f"read as {read_as}"):
        assert release(installed) is rel
    export = vllm_export(FROM_256, installed)
    assert export.release is rel and export.notes[0] == note


def test_the_target_release_is_the_installed_vllms_resolved_early(monkeypatch):
    import sp_lab.vllm_releases as V

    monkeypatch.setattr(V, "installed_release", lambda: None)
    assert target_release() == DEFAULT_RELEASE and target_release("0.18") == "0.18.1"
    monkeypatch.setattr(V, "installed_release", lambda: "0.19.1+cu128")
    assert target_release() == "0.19.1" and target_release("0.31") == "0.31.0"  # a named release wins
    monkeypatch.setattr(V, "installed_release", lambda: "0.10.2")
    with pytest.raises(KeyError, match=r"the installed vLLM: unknown vLLM release '0.10.2'.*supported: 0\.11\.0 to "
                                       r"0\.34\.0"):
        target_release()
    assert target_release("0.31.0") == "0.31.0"  # naming one needs no installed vLLM the table knows


# rows where SP alone everywhere and SP + AsyncTP everywhere have different regrets: the best is baseline at 16
# tokens (100) and sp+async_tp at 256 (80); sp everywhere loses 10% at 16 and 12.5% at 256, sp+async_tp 50% at 16
FALLBACK_ROWS = [{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), us in {
    (16, "baseline"): 100.0, (16, "sp"): 110.0, (16, "sp+async_tp"): 150.0,
    (256, "baseline"): 100.0, (256, "sp"): 90.0, (256, "sp+async_tp"): 80.0}.items()]


def test_the_always_fallback_and_its_regret_are_the_policy_it_runs():
    import polars as pl

    from sp_lab.tuning.export import vllm_section

    rows = pl.DataFrame(FALLBACK_ROWS)
    sp_only = LabConfig(tp_size=4, enable_async_tp=False, async_tp_min_tokens=256, max_num_tokens=8192)
    section = vllm_section(rows, sp_only, "0.13.0")  # no token gate there: SP from 256 cannot be written
    always = section["closest"]["always"]
    assert always["compilation_config"]["pass_config"] == {"enable_sp": True, "fuse_gemm_comms": False}
    assert closest_policy(sp_only, "always").name == "sp everywhere"
    assert always["regret"] == {"worst": pytest.approx(0.125), "total": pytest.approx(0.225)}  # sp, not sp+async_tp
    fused = vllm_section(rows, FROM_256, "0.13.0")["closest"]["always"]
    assert fused["compilation_config"]["pass_config"] == {"enable_sp": True, "fuse_gemm_comms": True}
    assert fused["regret"] == {"worst": pytest.approx(0.5), "total": pytest.approx(0.5)}
    assert section["closest"]["never"]["regret"] == {"worst": pytest.approx(0.25), "total": pytest.approx(0.25)}
    with pytest.raises(ValueError, match="unknown closest choice 'sometimes'; the choices are 'never' and 'always'"):
        closest_policy(sp_only, "sometimes")


def test_a_file_section_must_follow_from_its_config():
    text = FROM_256.to_json(vllm_release="0.18.0")
    assert LabConfig.from_json(text) == FROM_256
    doc = json.loads(text)
    doc["vllm"]["compilation_config"]["pass_config"]["sp_min_token_num"] = 512
    with pytest.raises(ConfigError, match="vllm.compilation_config.pass_config.sp_min_token_num: the file says 512"):
        LabConfig.from_json(json.dumps(doc))
    doc["vllm"]["release"] = "2026.03"  # a name from before sections named an exact release: not checked
    assert LabConfig.from_json(json.dumps(doc)) == FROM_256


def test_serve_line_quotes_the_object():
    line = vllm_export(FROM_256, "0.18").serve_line("meta-llama/Llama-3.3-70B-Instruct", 4)
    assert line == ("vllm serve meta-llama/Llama-3.3-70B-Instruct --tensor-parallel-size 4 --max-num-batched-tokens "
                    "8192 --compilation-config "
                    "'{\"mode\":3,\"pass_config\":{\"enable_sp\":true,\"fuse_gemm_comms\":true,\"sp_min_token_num\":"
                    "256},\"splitting_ops\":[],\"compile_ranges_endpoints\":[255],\"cudagraph_mode\":\"NONE\"}'")


def test_export_validates_with_the_installed_vllm():
    """Parse the export as ``vllm serve`` parses --compilation-config, with the installed vLLM's own classes."""
    version = installed_release()
    if version is None:
        pytest.skip("vLLM is not installed: the literal fixtures above stand for its classes")
    from pydantic import TypeAdapter
    from vllm.config.compilation import CompilationConfig

    for config in (FROM_256, EVERYWHERE, NEVER):
        export = vllm_export(config, version)
        objects = [export.compilation_config] if export.compilation_config else [
            c["compilation_config"] for c in export.closest.values()]
        for obj in objects:
            parsed = TypeAdapter(CompilationConfig).validate_json(json.dumps(obj))
            for key, value in obj.get("pass_config", {}).items():
                assert getattr(parsed.pass_config, key) == value


def test_a_file_written_for_a_build_says_how_the_table_read_it(tmp_path, monkeypatch):
    """An export for a build the table lacks (asked for, or installed) carries the note that it was read as the
    table's release of its minor, in the file itself, not only on the CLI's stderr."""
    import polars as pl
    from test_cli import curve_rows

    import sp_lab.tuning.export as E
    import sp_lab.vllm_releases as V

    rows = pl.DataFrame(curve_rows())
    config = LabConfig(tp_size=2, async_tp_min_tokens=64)
    for asked, installed in (("0.19.1+cu128", None), (None, "0.19.1+cu128")):
        for module in (V, E):
            monkeypatch.setattr(module, "installed_release", lambda installed=installed: installed)
        path = E.export_config(rows, config, tmp_path / str(asked), chosen_in="test", vllm_release=asked)
        vllm = json.loads(path.read_text())["vllm"]
        assert vllm["release"] == "0.19.1", vllm["release"]
        assert any("read as 0.19.1" in note for note in vllm["notes"]), vllm["notes"]


def test_model_level_facts_match_the_installed_vllm(tmp_path):
    """The vendored model-level facts against the installed vLLM's own files (read as text, vLLM not imported): the
    gate's arguments and expression, the fused all-gather + matmul constant, and every line a printed patch edits."""
    import ast
    import importlib.util
    import shutil
    import subprocess
    from pathlib import Path

    from sp_lab.vllm_models import model_level_sp, model_sp_releases

    version = installed_release()
    spec = importlib.util.find_spec("vllm")
    if version is None or spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed: the facts were read from the wheels (benchmarks/vllm_releases)")
    facts = model_sp_releases().get(resolve_release(version)[0].version)
    if facts is None:
        pytest.skip(f"vLLM {version}: a release before 0.32 has no model-level SP facts")
    root = Path(spec.origin).resolve().parent.parent
    helpers = facts["helpers"]
    source = (root / helpers["file"]).read_text()
    gate = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
                and n.name == "is_sequence_parallel_active")
    assert [a.arg for a in gate.args.args] == helpers["is_sequence_parallel_active"]["args"]
    returned = next(n for n in ast.walk(gate) if isinstance(n, ast.Return))
    assert ast.unparse(returned.value) == helpers["is_sequence_parallel_active"]["returns"]
    lines = source.splitlines()
    for constant in helpers["constants"]:
        assert lines[constant["line"] - 1] == constant["text"]
    for model in facts["models"].values():
        for a in model["min_tokens_assignments"]:
            assert (root / a["file"]).read_text().splitlines()[a["line"] - 1] == a["text"], a
    level = model_level_sp(version, "MuseSparkForConditionalGeneration", sp_min_tokens=4096,
                           fused_ag_min_tokens_per_rank=512, dtype="bfloat16")
    if level is not None and level.patch and shutil.which("patch"):
        patch = tmp_path / "muse.patch"
        patch.write_text(level.patch)
        done = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(root), "-i", str(patch)],
                              check=False, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_patches_left_out_of_the_table_are_read_as_the_release_they_equal():
    """Patches read from their wheels and found equal to their minor's entry resolve to that entry."""
    from sp_lab.vllm_releases import RELEASES_FILE

    read_as = json.loads(RELEASES_FILE.read_text())["meta"]["patches_read_identical"]["read_as"]
    assert sorted(read_as) == ["0.14.0", "0.15.0", "0.20.0", "0.20.1", "0.22.0", "0.25.0", "0.27.0"]
    for version, entry in read_as.items():
        assert resolve_release(version)[0].version == entry["as"]
        assert entry["wheel"].startswith(f"vllm-{version}-") and len(entry["wheel_sha256"]) == 64
