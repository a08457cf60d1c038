"""The distribution is `bcp-checkpoint` (the name `bcp` on PyPI is an unrelated
package): installed metadata, the version, the install hints of optional backends and
the example plugin's dependency all use it."""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

import bcp
from bcp.backends import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_installed_distribution_is_bcp_checkpoint():
    dist = importlib.metadata.distribution("bcp-checkpoint")
    assert "bcp" in (dist.read_text("top_level.txt") or "bcp").split()
    assert bcp.__version__ == dist.version


def test_install_hints_name_the_distribution():
    hints = [hint for _path, hint in registry._BUILTIN.values() if hint and "pip install" in hint]
    assert hints and all("pip install 'bcp-checkpoint[" in h for h in hints)
    assert "'bcp[" not in (ROOT / "docs" / "backends.md").read_text()


def test_the_example_plugin_depends_on_the_distribution():
    project = tomllib.loads((ROOT / "examples" / "sqlite_backend" / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["bcp-checkpoint"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "bcp-checkpoint"
