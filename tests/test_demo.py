"""The README's main job runs, from a fresh clone, and proves that training resumes
identically.

The README's first set-up command creates a virtualenv, installs bcp, then runs
``.venv/bin/python examples/demo.py`` in the repository root. The test checks that
this is still the command, clones the committed tree (what a new user gets: an
uncommitted file the demo needs would fail here) and runs the command's Python part
there, with this interpreter standing in for the new virtualenv's.
"""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from bcp.metadata import MANIFEST_KEY

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_COMMAND = re.compile(r"^\s+python3 -m venv \.venv && .*&& \.venv/bin/python (examples/demo\.py)$", re.M)


def _clone(dest: pathlib.Path) -> pathlib.Path:
    """The committed tree at HEAD, or (outside a git checkout) the tree as it is."""
    if shutil.which("git") and (ROOT / ".git").exists():
        subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(dest)], check=True, timeout=120)
        return dest
    return ROOT


def test_readme_names_the_demo_as_the_main_job():
    match = DEMO_COMMAND.search((ROOT / "README.md").read_text())
    assert match is not None, "README.md lost its 'set up and run the demo' command"
    assert (ROOT / match.group(1)).is_file()


@pytest.mark.slow
def test_demo_from_a_fresh_clone_resumes_training_identically(tmp_path):
    clone = _clone(tmp_path / "clone")
    out_dir = tmp_path / "out"
    out = subprocess.run(
        [sys.executable, "examples/demo.py", "--dir", str(out_dir), "--steps", "8", "--hidden", "256"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training continues identically: yes" in out.stdout
    assert "losses after restart equal the uninterrupted run: yes" in out.stdout, out.stdout
    assert "GB/s" in out.stdout and "tensors" in out.stdout
    assert (out_dir / "step4" / MANIFEST_KEY).exists()
    assert "loss continues after resharding 2 -> 3: yes" in out.stdout, out.stdout
    assert (out_dir / "fsdp-step" / MANIFEST_KEY).exists()
