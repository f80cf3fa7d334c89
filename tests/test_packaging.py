"""Layout and install: pyproject.toml, environment.yml, the Makefile, .ci/run and the README agree."""

from __future__ import annotations

import re
import subprocess
import tomllib
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


def test_ci_installs_torch_before_the_package_and_fails_fast():
    lines = _shell_lines((REPO / ".ci" / "run").read_text())
    assert lines[0] == "set -euo pipefail"
    torch_pin = next(i for i, line in enumerate(lines) if re.search(r"pip install \"?torch==", line))
    package = next(i for i, line in enumerate(lines) if 'pip install -e ".[hf,dev]"' in line)
    assert torch_pin < package


def test_ci_runs_the_readme_test_command():
    readme = REPO / "README.md"
    if not readme.exists():
        pytest.skip("README.md is not written yet: nothing to compare .ci/run with")
    blocks = re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", readme.read_text(), flags=re.DOTALL)
    commands = [line for block in blocks for line in _shell_lines(block)]
    test_commands = [c for c in commands if re.search(r"\bmake test\b|\bpytest\b", c)]
    assert test_commands, "README.md shows no test command (`make test`) in a shell block"
    ci_lines = _shell_lines((REPO / ".ci" / "run").read_text())
    assert test_commands[0] in ci_lines, (
        f".ci/run does not run the README's test command {test_commands[0]!r}"
    )
