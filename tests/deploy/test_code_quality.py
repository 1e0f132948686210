"""Lint and types are part of the test command: `ruff check` and a strict
`mypy` over the package, its tests, the conformance suite and the benchmarks,
run with the interpreter that runs pytest (the tools come with the `dev`
extra). A finding fails the test with the tool's own output. The same two
commands run as pre-commit hooks (.pre-commit-config.yaml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
import yaml

from tests.deploy._deploy import REPO

# What `ruff check` covers; [tool.mypy] files must name the same folders.
CHECKED = ["src", "tests", "sanity", "benchmarks", "scripts"]


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The tool as a module of this interpreter, in the repository's root,
    where pyproject.toml configures it."""
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900, check=False)


def test_ruff_and_mypy_come_with_the_dev_extra() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    dev = project["optional-dependencies"]["dev"]
    names = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in dev}
    assert {"ruff", "mypy"} <= names, dev


def test_mypy_checks_what_ruff_checks() -> None:
    tool = _pyproject()["tool"]
    assert isinstance(tool, dict)
    files = tool["mypy"]["files"]
    assert sorted(f.split("/")[0] for f in files) == sorted(CHECKED), files


@pytest.mark.parametrize(("tool", "args"), [
    ("ruff", ("check", *CHECKED)),
    ("mypy", ()),  # [tool.mypy] in pyproject.toml: strict, its files
], ids=["ruff", "mypy"])
def test_lint_and_types_are_clean(tool: str, args: tuple[str, ...]) -> None:
    r = _run(tool, *args)
    if "No module named" in r.stderr:
        pytest.fail(f"{tool} is not installed: pip install -e '.[dev]'\n{r.stderr}")
    if r.returncode != 0:
        pytest.fail(f"{tool} {' '.join(args)}:\n{r.stdout}{r.stderr}", pytrace=False)


def test_the_pre_commit_hooks_run_the_same_commands() -> None:
    r = _run("pre_commit", "validate-config", ".pre-commit-config.yaml")
    if r.returncode != 0:
        pytest.fail(f"pre-commit validate-config:\n{r.stdout}{r.stderr}", pytrace=False)
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    entries = {hook["id"]: hook["entry"] for repo in config["repos"] for hook in repo["hooks"]}
    assert entries["ruff"] == " ".join([".venv/bin/ruff", "check", *CHECKED])
    assert entries["mypy"] == ".venv/bin/mypy"
