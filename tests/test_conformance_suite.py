"""The conformance suite as users run it: `bcp conformance URI` and
`pytest --pyargs bcp.conformance`, against every built-in backend, the example
plugin, and deliberately broken backends that must fail it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import new_bucket, store_uri
from side_by_side import SideBySide

TESTS = Path(__file__).parent


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bcp.cli", "conformance", *args]


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=cwd)


# -- every child of this module, started side by side (tests/side_by_side.py) ----------------------
#
# Each test below checks the run of one child process (`bcp conformance`, pytest --pyargs,
# the console script). The module submits them all when its first test starts, the longest
# (the servers') first, and each test checks its own child's result as before.


def submit_conformance(runs: SideBySide, name: str, uri: str, where: Path, *extra: str) -> None:
    """Queue ``bcp conformance URI --json where/report.json EXTRA`` in ``where``."""
    runs.submit(name, cli_argv(uri, "--json", str(where / "report.json"), *extra), cwd=where, env=cli_env())


def conformance(runs: SideBySide, name: str, uri: str, where: Path) -> dict:
    """The CLI run ``name`` (of ``uri``, in ``where``): its JSON report after checking it passed."""
    proc = runs.result(name)
    assert proc.returncode == 0, f"conformance failed on {uri}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((where / "report.json").read_text())
    assert data["ok"] and data["counts"]["failed"] == 0 and data["counts"]["passed"] > 150, data["counts"]
    assert "RESULT: PASSED" in proc.stdout
    _incremental_cases_pass(data)
    return data


INCREMENTAL_GROUP = "incremental stores (references and holds)"


def _incremental_cases_pass(data: dict) -> None:
    """The cases an incremental store relies on ran and passed: the object group and the
    checkpoint contract's incremental save (issue 39)."""
    cases = data["groups"].get(INCREMENTAL_GROUP, [])
    assert len(cases) == 5 and all(c["outcome"] == "passed" for c in cases), cases
    saves = [c for cs in data["groups"].values() for c in cs if "test_incremental_checkpoint" in c["name"]]
    assert len(saves) == 1 and saves[0]["outcome"] == "passed", saves


class Run(NamedTuple):
    """A submitted child: its name in the pool, the URI it checks, its directory."""

    name: str
    uri: str
    where: Path


@pytest.fixture(scope="module")
def runs() -> Iterator[SideBySide]:
    pool = SideBySide()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server_runs(runs, tmp_path_factory, moto_server, rclone_server, gcs_server, request) -> dict[str, Run]:
    """The runs against moto, rclone and the GCS emulator (then the others: local_runs)."""
    out = {}
    where = tmp_path_factory.mktemp("conf-moto")
    out["moto"] = Run("moto", store_uri("moto", moto_server, new_bucket(moto_server), "suite"), where)
    submit_conformance(runs, "moto", out["moto"].uri, where, "--full", "--probe-mib", "16")
    where = tmp_path_factory.mktemp("conf-gcs")
    uri = store_uri("gcs", gcs_server, new_bucket(gcs_server), "suite", part_size="256KiB", conditional_writes="false")
    out["gcs"] = Run("gcs", uri, where)
    submit_conformance(runs, "gcs", uri, where, "--quick", "--probe-mib", "4")  # the emulator moves a few MB/s
    where = tmp_path_factory.mktemp("conf-rclone")
    out["rclone"] = Run("rclone", store_uri("rclone", rclone_server, new_bucket(rclone_server), "suite"), where)
    # rclone rewrites objects in place (see docs/backends.md): the overwrite-race checks are left out here.
    skip_races = "not test_overwrite_is_atomic and not test_overwrite_never_mixes"
    submit_conformance(runs, "rclone", out["rclone"].uri, where, "--quick", "--probe-mib", "8", "-k", skip_races)
    request.getfixturevalue("local_runs")  # queued behind these, running while the tests check these
    return out


_HEADINGS_DUMP = """
import json, os

def pytest_collection_finish(session):
    plugin = session.config.pluginmanager.get_plugin("bcp-conformance-report")
    rows = [{"nodeid": i.nodeid, "cls": i.cls.__name__ if i.cls else None, "name": i.originalname,
             "heading": plugin.headings[i.nodeid]} for i in session.items]
    with open(os.environ["BCP_HEADINGS_DUMP"], "w") as f:
        json.dump({"rows": rows, "order": plugin.report.order}, f)
"""

BROKEN = [
    ("broken-visible", "atomic commit", "before the writer committed"),
    ("broken-offbyone", "ranged reads", ""),
]


@pytest.fixture(scope="module")
def local_runs(runs, tmp_path_factory) -> dict[str, Run]:
    """Every other child of this module: stores in files and in memory, the example
    plugin, broken backends, the pytest entry points and the console script."""
    out = {}

    def run(name: str, uri: str, *extra: str) -> None:
        where = tmp_path_factory.mktemp(f"conf-{name}")
        uri = uri.format(where=where)
        out[name] = Run(name, uri, where)
        submit_conformance(runs, name, uri, where, *extra)

    run("file", "{where}/store", "--full", "--probe-mib", "16")
    run("sqlite", "sqlite://{where}/check.db/suite", "--full", "--probe-mib", "8")
    run("fsspec", "fsspec+file://{where}/store?part_size=1MiB", "--full", "--probe-mib", "16")
    run("memory", f"memory://conf-{uuid.uuid4().hex[:8]}/root", "--full", "--probe-mib", "16")
    for scheme, _group, _message in BROKEN:
        run(scheme, f"{scheme}://x{uuid.uuid4().hex[:6]}/root", "--quick", "--import", "broken_backends")
    # the check past a page is a slow one (1,050 objects): run alone, at the full level
    one_page = ("--full", "-k", "test_list_past_a_page", "--import", "broken_backends")
    run("broken-onepage", f"broken-onepage://x{uuid.uuid4().hex[:6]}/root", *one_page)

    where = tmp_path_factory.mktemp("conf-pyargs")
    out["pyargs"] = Run("pyargs", str(where / "store"), where)
    pyargs = [sys.executable, "-m", "pytest", "--pyargs", "bcp.conformance"]
    runs.submit(
        "pyargs",
        [
            *pyargs,
            *("--bcp-uri", str(where / "store"), "--bcp-level", "quick", "--bcp-probe-mib", "8"),
            *("-q", "-p", "no:cacheprovider", "--bcp-report", str(where / "r.json")),
        ],
        cwd=where,
    )

    where = tmp_path_factory.mktemp("conf-headings")
    out["headings"] = Run("headings", str(where / "store"), where)
    (where / "conf_headings_dump.py").write_text(_HEADINGS_DUMP)
    (where / "pytest.ini").write_text("[pytest]\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")]),
        "BCP_HEADINGS_DUMP": str(where / "headings.json"),
    }
    runs.submit(
        "headings",
        [
            *pyargs,
            *("--collect-only", "-q", "-c", str(where / "pytest.ini"), "--rootdir", str(where)),
            *("-p", "no:cacheprovider", "-p", "conf_headings_dump", "--bcp-uri", str(where / "store")),
        ],
        cwd=where,
        env=env,
        timeout=300,
    )

    where = tmp_path_factory.mktemp("conf-no-uri")
    out["no-uri"] = Run("no-uri", "", where)
    runs.submit("no-uri", [*pyargs, "-q", "-rs", "-p", "no:cacheprovider"], cwd=where, timeout=300)

    runs.submit("help", [str(Path(sys.executable).with_name("bcp")), "conformance", "--help"], timeout=60)
    return out


def _groups(data: dict) -> set[str]:
    return {g for g, checks in data["groups"].items() if checks}


def test_s3_on_moto_passes_the_full_suite(runs, server_runs):
    run = server_runs["moto"]
    data = conformance(runs, run.name, run.uri, run.where)
    assert 10 << 20 < data["figures"]["object_bytes"] <= 16 << 20  # whole 5 MiB parts
    assert "endpoint_url" not in data["uri"], "options (which may be private) leaked into the report"


def test_gcs_on_the_emulator_passes(runs, server_runs):
    run = server_runs["gcs"]
    conformance(runs, run.name, run.uri, run.where)


def test_s3_on_rclone_passes(runs, server_runs):
    run = server_runs["rclone"]
    conformance(runs, run.name, run.uri, run.where)


def test_file_backend_passes_the_full_suite(runs, local_runs):
    run = local_runs["file"]
    data = conformance(runs, run.name, run.uri, run.where)
    assert any(g.startswith("checkpoints") for g in _groups(data))
    killed = [c for g, cs in data["groups"].items() for c in cs if "killed" in c["name"]]
    assert len(killed) == 2 and all(c["outcome"] == "passed" for c in killed), killed
    figures = data["figures"]
    assert figures["write_GBps"] > 0 and figures["best_read_concurrency"] in (1, 2, 4, 8, 16)
    assert data["backend"]["capabilities"].count("CREATE_ONLY") == 1


def test_memory_backend_passes_and_says_why_killed_checks_skip(runs, local_runs):
    run = local_runs["memory"]
    data = conformance(runs, run.name, run.uri, run.where)
    killed = [c for cs in data["groups"].values() for c in cs if "killed" in c["name"]]
    assert killed and all(c["outcome"] == "skipped" and "one process" in c["why"] for c in killed)


def test_generic_fsspec_backend_passes(runs, local_runs):
    run = local_runs["fsspec"]
    conformance(runs, run.name, run.uri, run.where)


def test_example_plugin_is_found_by_scheme_and_passes(runs, local_runs):
    run = local_runs["sqlite"]
    data = conformance(runs, run.name, run.uri, run.where)
    assert data["backend"]["class"] == "bcp_sqlite.SQLiteBackend", "the plugin was not found through its entry point"


@pytest.mark.parametrize(
    ("scheme", "group", "message"), [*BROKEN, ("broken-onepage", "listing", "list of 1050 keys returned 1000")]
)
def test_broken_backends_fail_naming_the_guarantee(runs, local_runs, scheme, group, message):
    proc = runs.result(scheme)
    assert proc.returncode == 1, f"a broken backend passed the suite:\n{proc.stdout[-3000:]}"
    assert "RESULT: FAILED" in proc.stdout
    data = json.loads((local_runs[scheme].where / "report.json").read_text())
    failed = [c for g, cs in data["groups"].items() if g.startswith(group) for c in cs if c["outcome"] == "failed"]
    assert failed, f"no failure in the {group!r} group: {data['counts']}"
    assert all(c["why"] for c in failed), "a failure does not say why"
    if message:
        assert any(message in c["why"] for c in failed), [c["why"] for c in failed]
    assert f"FAIL {failed[0]['name']}" in proc.stdout


def test_pytest_pyargs_entry(runs, local_runs):
    proc = runs.result("pyargs")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "bcp conformance report" in proc.stdout and "RESULT: PASSED" in proc.stdout
    assert json.loads((local_runs["pyargs"].where / "r.json").read_text())["ok"]


def test_pytest_pyargs_without_a_uri_skips_and_says_how(runs, local_runs):
    proc = runs.result("no-uri")
    assert proc.returncode == 0 and "--bcp-uri" in proc.stdout and " passed" not in proc.stdout, proc.stdout[-2000:]


def test_every_check_reports_under_the_heading_of_its_own_class(runs, local_runs):
    """Collect the suite as `bcp conformance` does and take the report plugin's heading of
    every check: it must be the heading declared by the one class that defines the test,
    each heading must belong to one class, and every group must have checks."""
    from bcp.conformance import OBJECT_CONTRACT_GROUPS, BackendContractTests, CheckpointContractTests
    from bcp.conformance import test_suite as suite

    proc = runs.result("headings")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((local_runs["headings"].where / "headings.json").read_text())
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


def test_console_script_is_installed(runs, local_runs):
    proc = runs.result("help")  # the script next to this Python: `bcp conformance --help`
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
