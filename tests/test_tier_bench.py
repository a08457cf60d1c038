"""bench/tier_bench.py runs end to end on a small state (servers, 4 + 3 ranks, both
recoveries) and reports two bit-exact recoveries; its local-vs-file part prints both
recoveries side by side, with the bare verified reads of the same files beside them.

One smoke run serves every test here (a module fixture): ``--quick`` on the transformer
shape (every row of the table, the AdamW steps saved and checked on recovery) at its
smallest size, one layer (``--gib 0.001``): no row depends on the size, and the run's
time is the ranks' start and the proxied S3 requests, one per tensor."""

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
LOCAL_VS_FILE = re.compile(
    r"tier_bench local-vs-file: local ([0-9.]+) s \([0-9.]+ CPU-s\), file ([0-9.]+) s \([0-9.]+ CPU-s\), "
    r"ratio ([0-9.]+), exact (True|False)"
)

LIMIT = re.compile(
    r"tier_bench local-vs-file limit: verified read /dev/shm ([0-9.]+) s, page cache ([0-9.]+) s, "
    r"the machine's ratio ([0-9.]+) \(bcp's [0-9.]+, [0-9.]+x the machine's; the file-root load with its reads' "
    r"time from /dev/shm instead: [0-9.]+\); a recovery faster than the file-root load (is within|is beyond) "
    r"this machine's reach"
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The bench's smoke run (its file root under a directory of its own), that directory,
    and the one its ``--profile`` writes to."""
    root = tmp_path_factory.mktemp("tier-bench")
    profiles = tmp_path_factory.mktemp("tier-bench-profiles")
    command = [sys.executable, str(BENCH), "--quick", "--shape", "transformer", "--gib", "0.001", "--dir", str(root)]
    command += ["--profile", str(profiles)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600), root, profiles


@pytest.mark.slow
def test_tier_bench_quick_run_recovers_exactly_from_both_tiers(smoke_run):
    done, _root, _profiles = smoke_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    m = LAST.match(last)
    assert m, f"last line does not parse: {last!r}"
    assert m["exact"] == "True", last
    assert float(m["local"]) > 0 and float(m["persistent"]) > 0, last


@pytest.mark.slow
def test_tier_bench_local_vs_file_prints_both_recoveries_side_by_side(smoke_run):
    """The local-tier recovery and the load of the same step from a page-cached file root,
    both bit-exact on the same 4 ranks, their rows and ratio; the file root is removed."""
    done, root, profiles = smoke_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    local_row = [ln for ln in lines if ln.startswith("| recovery on 4 ranks (all present), local tier | ")]
    assert len(local_row) == 1, lines
    # CPU summed over the ranks, and the median of each repeat's ratio, beside the slowest rank's
    assert re.search(r"CPU-s \([0-9.]+ summed over the ranks\); .*\(median of each repeat's [0-9.]+x\)", local_row[0])
    # rank 0's cProfile of each counted load (one repeat with --quick), both kinds
    assert sorted(p.name for p in profiles.iterdir()) == ["file-1.prof", "local-1.prof"]
    assert any(ln.startswith("| load of the same step from a page-cached file root, same 4 ranks | ") for ln in lines)
    # the limit beside them, the bare verified reads of the ranks' files from both places, the
    # machine's own ratio and the part of the CPU gap they explain
    limit = [ln for ln in lines if ln.startswith("| verified read of each rank's files from the ")]
    assert len(limit) == 2 and "(/dev/shm)" in limit[0] and "(page cache)" in limit[1], lines
    assert re.search(r"the machine's ratio [0-9.]+x .*of which the verified reads' difference", limit[1]), limit[1]
    per_repeat = [ln for ln in lines if ln.startswith("  verified read of the same files, rep ")]
    assert len(per_repeat) == 1, "one counted repeat with --quick, beside its pair of loads"
    machine = [m for m in map(LIMIT.fullmatch, lines) if m]
    assert len(machine) == 1, lines
    vread_local, vread_file, ratio = float(machine[0][1]), float(machine[0][2]), float(machine[0][3])
    if vread_local >= 0.001:  # printed to 4 decimals: a ratio of two tiny reads' rounded seconds says nothing
        half = 0.00005
        low, high = (vread_file - half) / (vread_local + half), (vread_file + half) / (vread_local - half)
        assert low - 0.005 <= ratio <= high + 0.005, machine[0][0]
    assert machine[0][4] == ("is within" if ratio > 1 else "is beyond"), machine[0][0]
    found = [m for m in map(LOCAL_VS_FILE.fullmatch, lines) if m]
    assert len(found) == 1, lines
    m = found[0]
    assert m[4] == "True" and float(m[1]) > 0 and float(m[2]) > 0, m[0]
    # the ratio is file / local of the unrounded seconds: within what rounding the printed
    # seconds (3 decimals) and the printed ratio (2) allows, however small the loads are
    local, file, ratio, half = float(m[1]), float(m[2]), float(m[3]), 0.0005
    low, high = (file - half) / (local + half), (file + half) / max(local - half, 1e-9)
    assert low - 0.005 <= ratio <= high + 0.005, m[0]
    assert list(root.iterdir()) == [], "the file root was left behind"


@pytest.mark.slow
def test_tier_bench_transformer_shape_recovers_exactly(smoke_run):
    """(Was a run of its own in tests/test_bench_smoke.py.) The first line names the
    transformer state; the last reports both recoveries exact."""
    done, _root, _profiles = smoke_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("state (transformer: "), lines[0]
    assert re.fullmatch(r"tier_bench: local [0-9.]+ s, persistent [0-9.]+ s, ratio [0-9.]+, exact True", lines[-1])
