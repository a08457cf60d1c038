"""The conformance suite as users run it: `bcp conformance URI` and
`pytest --pyargs bcp.conformance`, against every built-in backend, the example
plugin, and deliberately broken backends that must fail it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import new_bucket, store_uri

TESTS = Path(__file__).parent


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "bcp.cli", "conformance", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def conformance(uri: str, tmp_path: Path, *extra: str) -> dict:
    """Run the CLI; return its JSON report after checking it passed."""
    report = tmp_path / f"report-{uuid.uuid4().hex[:6]}.json"
    proc = run_cli(uri, "--json", str(report), *extra, cwd=tmp_path)
    assert proc.returncode == 0, f"conformance failed on {uri}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(report.read_text())
    assert data["ok"] and data["counts"]["failed"] == 0 and data["counts"]["passed"] > 150, data["counts"]
    assert "RESULT: PASSED" in proc.stdout
    return data


def _groups(data: dict) -> set[str]:
    return {g for g, checks in data["groups"].items() if checks}


def test_file_backend_passes_the_full_suite(tmp_path):
    data = conformance(str(tmp_path / "store"), tmp_path, "--full", "--probe-mib", "16")
    assert any(g.startswith("checkpoints") for g in _groups(data))
    killed = [c for g, cs in data["groups"].items() for c in cs if "killed" in c["name"]]
    assert len(killed) == 2 and all(c["outcome"] == "passed" for c in killed), killed
    figures = data["figures"]
    assert figures["write_GBps"] > 0 and figures["best_read_concurrency"] in (1, 2, 4, 8, 16)
    assert data["backend"]["capabilities"].count("CREATE_ONLY") == 1


def test_memory_backend_passes_and_says_why_killed_checks_skip(tmp_path):
    data = conformance(f"memory://conf-{uuid.uuid4().hex[:8]}/root", tmp_path, "--full", "--probe-mib", "16")
    killed = [c for cs in data["groups"].values() for c in cs if "killed" in c["name"]]
    assert killed and all(c["outcome"] == "skipped" and "one process" in c["why"] for c in killed)


def test_generic_fsspec_backend_passes(tmp_path):
    conformance(f"fsspec+file://{tmp_path}/store?part_size=1MiB", tmp_path, "--full", "--probe-mib", "16")


def test_example_plugin_is_found_by_scheme_and_passes(tmp_path):
    data = conformance(f"sqlite://{tmp_path}/check.db/suite", tmp_path, "--full", "--probe-mib", "8")
    assert data["backend"]["class"] == "bcp_sqlite.SQLiteBackend", "the plugin was not found through its entry point"


def test_s3_on_moto_passes_the_full_suite(tmp_path, moto_server):
    uri = store_uri("moto", moto_server, new_bucket(moto_server), "suite")
    data = conformance(uri, tmp_path, "--full", "--probe-mib", "16")
    assert 10 << 20 < data["figures"]["object_bytes"] <= 16 << 20  # whole 5 MiB parts
    assert "endpoint_url" not in data["uri"], "options (which may be private) leaked into the report"


def test_s3_on_rclone_passes(tmp_path, rclone_server):
    # rclone rewrites objects in place (see docs/backends.md): the overwrite-race checks are left out here.
    uri = store_uri("rclone", rclone_server, new_bucket(rclone_server), "suite")
    conformance(
        uri,
        tmp_path,
        "--quick",
        "--probe-mib",
        "8",
        "-k",
        "not test_overwrite_is_atomic and not test_overwrite_never_mixes",
    )


def test_gcs_on_the_emulator_passes(tmp_path, gcs_server):
    uri = store_uri("gcs", gcs_server, new_bucket(gcs_server), "suite", part_size="256KiB", conditional_writes="false")
    conformance(uri, tmp_path, "--quick", "--probe-mib", "4")  # the emulator moves a few MB/s: a small probe


@pytest.mark.parametrize(
    ("scheme", "group", "message"),
    [
        ("broken-visible", "atomic commit", "before the writer committed"),
        ("broken-offbyone", "ranged reads", ""),
    ],
)
def test_broken_backends_fail_naming_the_guarantee(tmp_path, scheme, group, message):
    report = tmp_path / "r.json"
    proc = run_cli(
        f"{scheme}://x{uuid.uuid4().hex[:6]}/root",
        "--quick",
        "--import",
        "broken_backends",
        "--json",
        str(report),
        cwd=tmp_path,
    )
    assert proc.returncode == 1, f"a broken backend passed the suite:\n{proc.stdout[-3000:]}"
    assert "RESULT: FAILED" in proc.stdout
    data = json.loads(report.read_text())
    failed = [c for g, cs in data["groups"].items() if g.startswith(group) for c in cs if c["outcome"] == "failed"]
    assert failed, f"no failure in the {group!r} group: {data['counts']}"
    assert all(c["why"] for c in failed), "a failure does not say why"
    if message:
        assert any(message in c["why"] for c in failed), [c["why"] for c in failed]
    assert f"FAIL {failed[0]['name']}" in proc.stdout


def test_pytest_pyargs_entry(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "bcp.conformance",
            "--bcp-uri",
            str(tmp_path / "store"),
            "--bcp-level",
            "quick",
            "--bcp-probe-mib",
            "8",
            "-q",
            "-p",
            "no:cacheprovider",
            "--bcp-report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "bcp conformance report" in proc.stdout and "RESULT: PASSED" in proc.stdout
    assert json.loads((tmp_path / "r.json").read_text())["ok"]


def test_pytest_pyargs_without_a_uri_skips_and_says_how(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "bcp.conformance", "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "--bcp-uri" in proc.stdout and " passed" not in proc.stdout, proc.stdout[-2000:]


_HEADINGS_DUMP = """
import json, os

def pytest_collection_finish(session):
    plugin = session.config.pluginmanager.get_plugin("bcp-conformance-report")
    rows = [{"nodeid": i.nodeid, "cls": i.cls.__name__ if i.cls else None, "name": i.originalname,
             "heading": plugin.headings[i.nodeid]} for i in session.items]
    with open(os.environ["BCP_HEADINGS_DUMP"], "w") as f:
        json.dump({"rows": rows, "order": plugin.report.order}, f)
"""


def test_every_check_reports_under_the_heading_of_its_own_class(tmp_path):
    """Collect the suite as `bcp conformance` does and take the report plugin's heading of
    every check: it must be the heading declared by the one class that defines the test,
    each heading must belong to one class, and every group must have checks."""
    from bcp.conformance import OBJECT_CONTRACT_GROUPS, BackendContractTests, CheckpointContractTests
    from bcp.conformance import test_suite as suite

    (tmp_path / "conf_headings_dump.py").write_text(_HEADINGS_DUMP)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    dump = tmp_path / "headings.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "BCP_HEADINGS_DUMP": str(dump),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "bcp.conformance",
            "--collect-only",
            "-q",
            "-c",
            str(tmp_path / "pytest.ini"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-p",
            "conf_headings_dump",
            "--bcp-uri",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(dump.read_text())
    rows = data["rows"]
    assert len(rows) >= 196, f"the suite lost checks: {len(rows)} collected"

    owners: dict[str, set[type]] = {}
    for row in rows:
        cls = getattr(suite, row["cls"])
        defining = [k for k in cls.__mro__ if row["name"] in vars(k)]
        assert len(defining) == 1, f"{row['nodeid']} is defined by several classes: {defining}"
        owner = defining[0]
        assert "report_heading" in vars(owner), f"{owner.__name__} defines {row['name']} but declares no heading"
        assert row["heading"] == vars(owner)["report_heading"], (
            f"{row['nodeid']} is reported under {row['heading']!r}, its class {owner.__name__} declares "
            f"{vars(owner)['report_heading']!r}"
        )
        owners.setdefault(row["heading"], set()).add(owner)
    assert all(len(classes) == 1 for classes in owners.values()), f"classes share a heading: {owners}"
    groups = [*OBJECT_CONTRACT_GROUPS, CheckpointContractTests, suite.TestPerformanceProbe]
    assert {next(iter(c)) for c in owners.values()} == set(groups), "a group has no checks, or a class is no group"
    assert data["order"] == [g.report_heading for g in groups], "headings are not shown in the groups' order"

    # The composed class is exactly its groups: each test in one group, none of its own.
    assert BackendContractTests.__bases__ == tuple(reversed(OBJECT_CONTRACT_GROUPS))
    per_group = [{n for n in vars(g) if n.startswith("test_")} for g in OBJECT_CONTRACT_GROUPS]
    union = set().union(*per_group)
    assert sum(map(len, per_group)) == len(union), "two groups define a test of the same name"
    assert union == {n for n in dir(BackendContractTests) if n.startswith("test_")}
    assert not [n for n in vars(BackendContractTests) if n.startswith("test_")]


def test_a_subclass_keeps_overridden_tests_under_their_group():
    """What a backend's own subclass does (override a test to skip it, add its own) cannot
    move a check to another group's heading."""
    from bcp.conformance import BackendContractTests, ListingTests, RangedReadTests
    from bcp.conformance.report import OTHER, heading_of

    class TestMine(BackendContractTests):
        def test_list_many_keys(self, backend):
            pytest.skip("not on this store")

        def test_my_own_check(self, backend):
            pass

    class TestMyReads(RangedReadTests):
        report_heading = "my ranged reads"

        def test_my_own_check(self, backend):
            pass

    assert heading_of(TestMine, "test_list_many_keys") == ListingTests.report_heading
    assert heading_of(TestMine, "test_read_into_past_end_returns_zero[1]") == RangedReadTests.report_heading
    assert heading_of(TestMine, "test_my_own_check") == OTHER
    assert heading_of(TestMyReads, "test_my_own_check") == "my ranged reads"
    assert heading_of(TestMyReads, "test_read_whole_object") == RangedReadTests.report_heading
    assert heading_of(None, "test_anything") == OTHER


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("bcp")
    proc = subprocess.run([str(script), "conformance", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout


# -- the contract's comparison ---------------------------------------------------------------------


def test_assert_same_is_byte_exact_a_nan_round_trips_and_minus_zero_differs(tmp_path):
    import torch

    import bcp
    from bcp.conformance.checkpoint_contract import assert_same, same_bytes, template_like

    state = {
        "f32": torch.tensor([float("nan"), 1.0, -0.0, float("-inf")]),
        "bf16": torch.tensor([float("nan"), -0.0], dtype=torch.bfloat16),
        "f64": torch.full((2, 3), float("nan"), dtype=torch.float64),
    }
    uri = str(tmp_path / "ck")
    bcp.save(state, uri)
    got = bcp.load(template_like(state), uri)
    assert not torch.equal(got["f32"], state["f32"]), "torch.equal calls NaN unequal: the reason for byte compare"
    assert_same(got, state)  # the same NaNs, bit for bit
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_same({"x": torch.tensor([-0.0])}, {"x": torch.tensor([0.0])})
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_same(torch.tensor([-0.0], dtype=torch.bfloat16), torch.tensor([0.0], dtype=torch.bfloat16))
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # another NaN payload
    assert not same_bytes(other_nan, torch.tensor([float("nan")]))
    assert same_bytes(torch.arange(6.0).reshape(2, 3).t(), torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]))
    assert not same_bytes(torch.zeros(2, 3), torch.zeros(3, 2)), "same bytes, another shape"
    assert not same_bytes(torch.zeros(2, dtype=torch.int32), torch.zeros(2)), "same bytes, another dtype"
    with pytest.raises(AssertionError, match=r"expected a torch\.float32 tensor"):
        assert_same(torch.zeros(2, dtype=torch.int32), torch.zeros(2))
