"""bench/tier_bench.py runs end to end on a small state (servers, 4 + 3 ranks, both
recoveries) and its last line reports two bit-exact recoveries."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "tier_bench.py"
LAST = re.compile(
    r"^tier_bench: local (?P<local>[0-9.]+) s, persistent (?P<persistent>[0-9.]+) s, "
    r"ratio (?P<ratio>[0-9.]+), exact (?P<exact>True|False)$"
)


@pytest.mark.slow
def test_tier_bench_quick_run_recovers_exactly_from_both_tiers():
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    m = LAST.match(last)
    assert m, f"last line does not parse: {last!r}"
    assert m["exact"] == "True", last
    assert float(m["local"]) > 0 and float(m["persistent"]) > 0, last


@pytest.mark.slow
def test_tier_bench_local_vs_file_prints_both_recoveries_side_by_side(tmp_path):
    """--only local-vs-file (no S3): the local-tier recovery and the load of the same step
    from a page-cached file root, both bit-exact on the same 4 ranks, their rows and ratio."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--shape",
            "transformer",
            "--only",
            "local-vs-file",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(ln.startswith("| recovery on 4 ranks (all present), local tier | ") for ln in lines), lines
    assert any(ln.startswith("| load of the same step from a page-cached file root, same 4 ranks | ") for ln in lines)
    m = re.fullmatch(
        r"tier_bench local-vs-file: local ([0-9.]+) s \([0-9.]+ CPU-s\), file ([0-9.]+) s \([0-9.]+ CPU-s\), "
        r"ratio ([0-9.]+), exact (True|False)",
        lines[-1],
    )
    assert m, lines[-1]
    assert m[4] == "True" and float(m[1]) > 0 and float(m[2]) > 0, lines[-1]
    assert abs(float(m[3]) - float(m[2]) / float(m[1])) < 0.03 * float(m[3]) + 0.01, lines[-1]
    assert list(tmp_path.iterdir()) == [], "the file root was left behind"
