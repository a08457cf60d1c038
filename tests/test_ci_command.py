"""CI (.ci/run) runs exactly the README's test command, once: the fast tier is part of
the whole suite, so running it first as well only adds its minutes to every CI run. The
suite runs on CI's 2 cores with pytest-xdist: most tests wait on children and servers."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    after = next(i for i, ln in enumerate(lines) if ln.startswith("The whole test suite"))
    return next(ln.strip() for ln in lines[after + 1 :] if ln.startswith("    "))


def test_ci_runs_exactly_the_readme_test_command_once():
    command = _readme_test_command()
    assert command.endswith(".venv/bin/python -m pytest -q -n 2 --dist loadfile"), command
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    run = [ln for ln in script if ln.strip() and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    assert run == [command], run
    assert sum(ln.count("pytest") for ln in script if not ln.startswith("#")) == 1, script


def test_the_test_extra_installs_what_the_test_command_uses():
    """``-n 2`` is pytest-xdist's option: without it in the test extra the command fails."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("pytest-xdist") for req in extras["test"]), extras["test"]
