"""The README's main job runs and proves that training resumes identically."""

import pathlib
import subprocess
import sys

from bcp.metadata import MANIFEST_KEY

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_resumes_training_identically(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--dir", str(tmp_path), "--steps", "8", "--hidden", "256"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "training continues identically: yes" in out.stdout
    assert "losses after restart equal the uninterrupted run: yes" in out.stdout, out.stdout
    assert "GB/s" in out.stdout and "tensors" in out.stdout
    assert (tmp_path / "step4" / MANIFEST_KEY).exists()
    assert "loss continues after resharding 2 -> 3: yes" in out.stdout, out.stdout
    assert (tmp_path / "fsdp-step" / MANIFEST_KEY).exists()
