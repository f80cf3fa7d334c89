"""Where sp_lab writes by default: the project's ``out/``, found from the working directory (``sp_lab.paths``).

Every directory is a temporary one of its own, so the checkout the tests run from plays no part.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sp_lab import paths


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp/project`` with a ``pyproject.toml`` and a ``notebooks/`` folder; no ``SP_LAB_OUT``."""
    monkeypatch.delenv(paths.OUT_ENV, raising=False)
    root = tmp_path / "project"
    (root / "notebooks").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    return root


def test_the_root_is_the_nearest_directory_up_with_a_pyproject_or_a_git(project, tmp_path):
    assert paths.project_root(project / "notebooks") == project
    assert paths.project_root(project) == project
    bare = tmp_path / "bare" / "deeper"
    bare.mkdir(parents=True)
    (tmp_path / "bare" / ".git").mkdir()  # a checkout: .git alone marks it
    assert paths.project_root(bare) == tmp_path / "bare"


def test_a_checkout_nested_in_another_repository_is_its_own_root(project):
    # A clone inside another repository (a vendored copy, a worktree under a monorepo): the nearest marker wins,
    # the start directory's own included; the outer repository is never reached.
    (project / ".git").mkdir()
    inner = project / "vendor" / "sp_lab"
    (inner / "notebooks").mkdir(parents=True)
    (inner / "pyproject.toml").write_text("")
    assert paths.project_root(inner) == inner
    assert paths.project_root(inner / "notebooks") == inner
    git_only = project / "vendor" / "other"
    git_only.mkdir()
    (git_only / ".git").write_text("gitdir: ../../.git/worktrees/other\n")  # a worktree's .git is a file
    assert paths.project_root(git_only) == git_only


def test_a_directory_named_pyproject_toml_is_no_marker(project):
    inner = project / "sub"
    (inner / "pyproject.toml").mkdir(parents=True)
    assert paths.project_root(inner) == project


def test_without_any_marker_the_start_itself(tmp_path, monkeypatch):
    start = tmp_path / "a" / "b"
    start.mkdir(parents=True)
    if any((d / "pyproject.toml").is_file() or (d / ".git").exists() for d in start.parents):
        pytest.skip(f"a directory above {tmp_path} is marked as a project")
    assert paths.project_root(start) == start
    monkeypatch.chdir(start)
    assert paths.project_root() == start


def test_the_default_start_is_the_working_directory(project, monkeypatch):
    monkeypatch.chdir(project / "notebooks")
    assert paths.project_root() == project
    assert paths.default_out() == project / "out"
    assert paths.default_store() == project / "out" / "sweeps"
    assert paths.default_report() == project / "out" / "report.html"


def test_sp_lab_out_names_the_folder_outright(project, monkeypatch, tmp_path):
    monkeypatch.chdir(project)
    monkeypatch.setenv(paths.OUT_ENV, str(tmp_path / "elsewhere"))
    assert paths.default_out() == tmp_path / "elsewhere"
    assert paths.default_store() == tmp_path / "elsewhere" / "sweeps"
    assert paths.default_report() == tmp_path / "elsewhere" / "report.html"
    monkeypatch.setenv(paths.OUT_ENV, "relative/out")  # resolved against the working directory, made absolute
    assert paths.default_out() == project / "relative" / "out"
    monkeypatch.setenv(paths.OUT_ENV, "")  # empty: not set
    assert paths.default_out() == project / "out"


def test_a_relative_path_resolves_in_the_project_only_where_it_exists_there(project, monkeypatch):
    (project / "out" / "sweeps").mkdir(parents=True)
    monkeypatch.chdir(project / "notebooks")
    assert paths.resolve_in_project("out/sweeps") == project / "out" / "sweeps"
    assert paths.resolve_in_project("nowhere") == Path("nowhere")  # as given: the error names what was typed
    (project / "notebooks" / "out" / "sweeps").mkdir(parents=True)  # one where the kernel runs wins
    assert paths.resolve_in_project("out/sweeps") == Path("out/sweeps")
    assert paths.resolve_in_project(project / "absent") == project / "absent"  # absolute: as given
