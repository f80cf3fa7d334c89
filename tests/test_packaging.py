"""Layout and install: pyproject.toml, environment.yml, the Makefile, .ci/run and the README agree."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What the issue asks pyproject.toml to declare (PEP 503-normalised names).
REQUIRED_RUNTIME = {
    "torch",
    "polars",
    "plotly",
    "ipywidgets",
    "anywidget",
    "jupyterlab",
    "scikit-learn",
    "tqdm",
}
REQUIRED_HF = {"transformers", "safetensors"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _split_requirement(text: str) -> tuple[str, str]:
    """'scikit-learn >= 1.4' -> ('scikit-learn', '>=1.4'); extras and markers are not used here."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*", text)
    assert match, f"cannot read requirement {text!r}"
    return _normalise(match[1]), match[2].replace(" ", "")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pyproject_requirements() -> dict[str, str]:
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    return dict(_split_requirement(line) for line in lines)


def _environment() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses environment.yml (jupyterlab brings it)")
    return yaml.safe_load((REPO / "environment.yml").read_text())


def _shell_lines(text: str) -> list[str]:
    """Command lines of a shell script or block: no blanks, no comments, no prompt."""
    lines = []
    for raw in text.splitlines():
        # A trailing "  # comment" is not part of the command.
        line = re.sub(r"\s+#\s.*$", "", raw.strip().removeprefix("$ ")).strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------------


def test_pyproject_declares_what_the_issue_asks_for():
    project = _pyproject()["project"]
    assert project["requires-python"] == ">=3.11"
    runtime = dict(_split_requirement(line) for line in project["dependencies"])
    assert REQUIRED_RUNTIME <= runtime.keys(), f"missing: {REQUIRED_RUNTIME - runtime.keys()}"
    assert runtime["torch"] == ">=2.11"
    extras = project["optional-dependencies"]
    assert REQUIRED_HF <= {_split_requirement(line)[0] for line in extras["hf"]}
    dev = {_split_requirement(line)[0] for line in extras["dev"]}
    assert {"pytest", "ruff"} <= dev and dev & {"nbmake", "nbclient"}


def test_environment_yml_and_pyproject_list_the_same_dependencies():
    env = _environment()
    conda_lines, pip_lines = [], []
    for entry in env["dependencies"]:
        if isinstance(entry, dict):
            pip_lines.extend(entry["pip"])
        else:
            conda_lines.append(entry)

    # The package itself, with both extras, comes through pip.
    editable = [line for line in pip_lines if line.startswith("-e")]
    assert editable and re.fullmatch(r"-e\s+\.\[(.+)\]", editable[0]), pip_lines
    extras = {e.strip() for e in re.fullmatch(r"-e\s+\.\[(.+)\]", editable[0])[1].split(",")}
    assert extras == set(_pyproject()["project"]["optional-dependencies"])

    conda = dict(_split_requirement(line) for line in conda_lines)
    pip = dict(_split_requirement(line) for line in pip_lines if not line.startswith("-"))
    # PyTorch has no conda channel of its own any more: torch must come through pip.
    assert "torch" in pip and "torch" not in conda
    assert conda.pop("python") == _pyproject()["project"]["requires-python"]
    conda.pop("pip")
    in_env = conda | pip
    assert in_env == _pyproject_requirements(), (
        "environment.yml and pyproject.toml disagree; pyproject is the reference. "
        f"Only in environment.yml: {sorted(in_env.items() - _pyproject_requirements().items())}; "
        f"only in pyproject.toml: {sorted(_pyproject_requirements().items() - in_env.items())}"
    )


def test_makefile_has_the_documented_targets_and_test_deselects_gpu_tests():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
    assert {"install", "test", "run", "lab", "lint"} <= targets
    dry_run = subprocess.run(
        ["make", "-n", "--no-print-directory", "test", "STAMP=pyproject.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert 'pytest -q -m "not gpu and not multigpu and not slow"' in dry_run
    assert "rc -eq 5" in dry_run  # "no tests collected" must fail, not pass


def _readme_make_commands() -> list[str]:
    """The ``make`` commands of the README's shell blocks, in the README's order."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", readme, flags=re.DOTALL)
    return [line for block in blocks for line in _shell_lines(block) if re.match(r"make \w", line)]


def test_ci_runs_the_readme_commands_in_the_readmes_order_and_fails_fast():
    """A newcomer runs `make run`, then `make test`; CI does the same, in that order, and stops at the first failure
    (each target installs what it needs itself, so CI installs nothing of the package on its own)."""
    ci = _shell_lines((REPO / ".ci" / "run").read_text())
    assert ci[0] == "set -euo pipefail"
    setup = _readme_make_commands()[:2]
    assert setup == ["make run", "make test"], f"the README's set-up block changed: {setup}"
    made = [line for line in ci if line.startswith("make ")]
    assert made == setup, f".ci/run runs {made}, the README tells a newcomer {setup}"
    assert not [line for line in ci if "pip install" in line], ".ci/run installs on its own; the Makefile should"


def _dry_run(target: str, *overrides: str) -> str:
    """``make -n target`` as a newcomer's shell would run it (this suite runs under `make test`'s own settings)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-n", "--no-print-directory", target, "STAMP=pyproject.toml", *overrides],
                          cwd=REPO, capture_output=True, text=True, check=True, env=env).stdout


def _launch_env(dry_run: str, program: str) -> dict[str, str]:
    """The VAR=value words before ``program`` on the recipe line that starts it."""
    line = next(line for line in dry_run.splitlines() if program in line)
    words = line.split(program)[0].split("&&")[-1].split()
    return dict(word.split("=", 1) for word in words if "=" in word)


def test_each_cpu_capability_has_its_own_inductor_cache_and_temporary_directory():
    """Inductor keys neither its cache nor its precompiled headers ($TMPDIR/torchinductor_<user>) on the CPU
    capability, so a kernel built by `make run` or `make lab` (the machine's vector ISA) and then reused by
    `make test` (ATEN_CPU_CAPABILITY=default) fails to compile. Every target that starts Python gives it the cache
    and TMPDIR of its capability, and creates that TMPDIR (Python silently falls back to /tmp otherwise)."""
    test = _launch_env(_dry_run("test"), "-m pytest")
    run = _launch_env(_dry_run("run"), "-m sp_lab run")
    lab = _launch_env(_dry_run("lab"), "-m jupyter lab")
    assert test["ATEN_CPU_CAPABILITY"] == "default" and "ATEN_CPU_CAPABILITY" not in run
    assert run == lab  # the notebooks' kernels and the main job share what they built, for the same ISA
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        assert test[key] != run[key], f"make test and make run share {key}={test[key]}"
    assert f"mkdir -p {test['TMPDIR']} " in _dry_run("test")
    native = _launch_env(_dry_run("test", "TEST_CPU_CAPABILITY="), "-m pytest")  # the suite on the machine's ISA
    assert "ATEN_CPU_CAPABILITY" not in native and native == run


# ---------------------------------------------------------------------------------------------------
# A non-editable install: the wheel must carry everything sp_lab reads at run time.

# Run by the installed interpreter from a directory outside the checkout: the package must come from
# the venv, and the presets and H200 tables from inside it.
_INSTALLED_CHECK = """
import json, sys
from pathlib import Path
import sp_lab
from sp_lab.models import available, build
from sp_lab.tuning.predict.kernels import MatmulTable

package = Path(sp_lab.__file__).resolve().parent
assert package.is_relative_to(Path(sys.prefix).resolve()), f"sp_lab imported from {package}, not the venv"
model = build("llama-3-8b", tp_size=8, num_layers=2, device="meta")
weight = model.model.layers[0].mlp.down_proj.weight
table = MatmulTable.default()
print(json.dumps({
    "package": str(package), "presets": available(), "meta_device": weight.device.type,
    "down_proj_shard": list(weight.shape), "h200_rows": table.rows.height,
    "h200_files": [Path(f["path"]).name for f in table.provenance["files"]],
}))
"""


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """A venv with sp_lab installed from a freshly built wheel (no index: torch and the other
    dependencies come from the system site-packages, so nothing is downloaded)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    # Build from a copy so the checkout gets no build/ or egg-info, and only tracked inputs count.
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("sp_lab", "data"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # a table added under data/ in a folder of its own ships with nothing else declared
    (src / "data" / "new-folder").mkdir()
    (src / "data" / "new-folder" / "table.json").write_text("{}")
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(dist), str(src)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = dist.glob("sp_lab-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "sp_lab/data/models/llama-3-70b.json" in names
    assert "sp_lab/data/h200/gemm_chunking_tp8.json" in names
    # the performance model's hardware constants and the published figures it is validated against
    assert {"sp_lab/data/hardware.json", "sp_lab/data/published_figures.json"} <= names
    assert "sp_lab/data/new-folder/table.json" in names
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)],
        # without PYTHONPATH: a checkout on it with an egg-info (left by an editable install) reads as sp_lab
        # already installed, and pip would skip the wheel
        check=True, capture_output=True, text=True, env=_outside_env(),
    )
    return python


def _outside_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a worktree on the path would win
    return env


def test_wheel_installs_and_runs_from_another_directory(installed_wheel, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    help_text = subprocess.run(
        [str(installed_wheel), "-m", "sp_lab", "run", "--help"],
        cwd=elsewhere, env=_outside_env(), capture_output=True, text=True, check=True,
    ).stdout
    assert "usage:" in help_text and " run" in help_text

    result = subprocess.run(
        [str(installed_wheel), "-c", _INSTALLED_CHECK],
        cwd=elsewhere, env=_outside_env(), capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert "site-packages" in facts["package"] and not facts["package"].startswith(str(REPO))
    assert {"toy", "llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b"} <= set(facts["presets"])
    # llama-3-8b: intermediate 14336 / tp 8 = 1792 input columns of down_proj's shard, hidden 4096 rows.
    assert facts["meta_device"] == "meta" and facts["down_proj_shard"] == [4096, 1792]
    assert facts["h200_rows"] > 0 and "gemm_chunking_tp8.json" in facts["h200_files"]


# ---------------------------------------------------------------------------------------------------------------
# Everything the code cites is in the repository


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".py", ".md", ".ipynb", ".toml", ".yml", ".sh", ".cfg", ".txt"}
    return [REPO / n for n in names if Path(n).suffix in suffixes or n in ("Makefile", ".ci/run")]


def test_nothing_points_outside_the_repository():
    """Background lives in docs/: no file names a document kept beside the checkout."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    outside = re.compile(r"BACKGROUND(\.md)?\b|\.\./shared\b|\.notes/|CONTRACTS\.md")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}"
             for p in _tracked_text_files() if p.is_file() and p.name != "test_packaging.py"
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not found, "cite docs/ instead:\n" + "\n".join(found)


def test_docs_name_only_modules_that_exist():
    cited = {m for page in (REPO / "docs").glob("*.md") for m in re.findall(r"sp_lab/[\w/]+\.py", page.read_text())}
    assert cited, "docs/ cite no module at all"
    assert not [m for m in sorted(cited) if not (REPO / m).is_file()]
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))))
    assert linked <= pages, f"broken links in docs/: {sorted(linked - pages)}"


def test_readme_architecture_table_matches_the_modules():
    """Every module of the package is in the README's architecture table, and every module it names exists."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Architecture"):]
    section = section[: section.index("\n## ", 1)]
    listed = set(re.findall(r"(\w+)\.py", section))
    for braces in re.findall(r"\{([\w,]+)\}\.py", section):
        listed |= set(braces.split(","))
    modules = {p.stem for p in (REPO / "sp_lab").rglob("*.py") if p.name != "__init__.py"}
    assert not sorted(modules - listed), "modules missing from the README's architecture table"
    assert not sorted(listed - modules), "the README's architecture table names modules that do not exist"


def test_data_lives_once_at_the_top_of_the_checkout():
    """Presets and measured tables: one copy, in data/ beside sp_lab/, read from there when run from a checkout."""
    from sp_lab.resources import DATA_DIR

    assert (REPO / "data" / "models").is_dir() and (REPO / "data" / "h200").is_dir()
    stray = sorted(str(p.relative_to(REPO)) for p in (REPO / "sp_lab" / "data").rglob("*"))
    assert not stray, f"data files belong under data/ (shipped as sp_lab/data by pyproject.toml): {stray}"
    assert DATA_DIR == REPO / "data"


def test_every_package_a_test_module_skips_without_is_installed():
    """Test modules skip themselves where an optional package is missing (``pytest.importorskip``: plotly on a GPU
    image). ``make test`` installs every one of them (the package's dependencies and its hf and dev extras), so
    there such a skip could only hide a broken install and the tests behind it."""
    names = sorted({name for path in (REPO / "tests").glob("*.py")
                    for name in re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", path.read_text())})
    assert {"transformers", "plotly.graph_objects", "nbclient"} <= set(names)  # the scan finds the calls
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    assert not missing, f"not installed: {missing}; `make install` (pip install -e '.[hf,dev]') installs them"
