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
