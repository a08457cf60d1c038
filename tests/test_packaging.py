"""The layered layout: backends/, metadata/, conformance/ are importable only as
bcp.backends, bcp.metadata and bcp.conformance, from an installed wheel too."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["backends", "metadata", "conformance"])
def test_layers_are_not_top_level_modules(tmp_path, name):
    code = f"import importlib.util, bcp.{name}; print(importlib.util.find_spec({name!r}) is None)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", f"a top-level {name!r} module is importable"


def test_wheel_contains_only_the_bcp_namespace(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("bcp_checkpoint-*.whl")  # the distribution bcp-checkpoint
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"bcp", next(t for t in top if t.endswith(".dist-info"))}, top
    assert any(t.startswith("bcp_checkpoint-") for t in top), "the distribution is bcp-checkpoint, the package bcp"
    for module in (
        "bcp/backends/base.py",
        "bcp/metadata/catalog/core.py",
        "bcp/metadata/FORMAT.md",
        "bcp/conformance/__init__.py",
        "bcp/tiers/tier.py",
    ):
        assert module in names, f"{module} missing from the wheel"
    for package in ("bcp", "bcp/backends", "bcp/metadata", "bcp/conformance"):  # PEP 561, for users' type checkers
        assert f"{package}/py.typed" in names, f"{package}/py.typed missing from the wheel"


def test_metadata_and_backends_never_import_the_engine():
    """The layering in the README: the catalog and storage layers stand alone (absolute
    imports are the risk; a relative one leaves its layer only with more leading dots
    than the file is deep in it, e.g. ``from ..`` in a layer's top folder)."""
    offenders = []
    for layer in ("metadata", "backends"):
        for path in (ROOT / layer).rglob("*.py"):
            for line in path.read_text().splitlines():
                stripped = line.strip()
                if stripped.startswith(("import bcp", "from bcp")) and not stripped.startswith(
                    ("from bcp.metadata", "import bcp.metadata", "from bcp.backends", "import bcp.backends")
                ):
                    offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
                dots = len(stripped[5:]) - len(stripped[5:].lstrip("."))
                escapes = stripped.startswith("from .") and dots > len(path.relative_to(ROOT / layer).parts)
                if escapes or "import torch" in stripped:
                    offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert offenders == [], offenders
