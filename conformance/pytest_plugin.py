"""pytest plugin (entry point ``pytest11``): the ``--bcp-*`` options and the report.

Loaded by pytest wherever bcp is installed; it does nothing unless ``--bcp-uri`` is
given. ``pytest --pyargs bcp.conformance --bcp-uri URI`` then runs the suite against
that store and prints the grouped report after pytest's own summary.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from bcp.conformance.report import Check


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bcp-conformance", "bcp storage conformance suite")
    group.addoption("--bcp-uri", default=None, help="root URI of an empty location in the store under test")
    group.addoption(
        "--bcp-level",
        default="full",
        choices=("quick", "full"),
        help="quick: skip killed-process checks and shrink the probe; full: everything (default)",
    )
    group.addoption(
        "--bcp-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="storage option added to the URI's query (repeatable)",
    )
    group.addoption(
        "--bcp-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (repeatable): a backend registered at import time; child processes import it too",
    )
    group.addoption("--bcp-report", default=None, metavar="PATH", help="also write the report as JSON here")
    group.addoption(
        "--bcp-probe-mib",
        type=int,
        default=None,
        metavar="N",
        help="size of the probe's object (default 256 for full, 32 for quick)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (skipped by --bcp-level quick)")
    imports = config.getoption("--bcp-import", default=[]) or []
    if imports:
        from bcp.backends.registry import import_plugins

        try:
            import_plugins(imports)
        except ImportError as e:
            raise pytest.UsageError(str(e)) from e
    if config.getoption("--bcp-uri", default=None):
        config.pluginmanager.register(ReportPlugin(config), "bcp-conformance-report")


def target_uri(config: pytest.Config) -> str | None:
    """--bcp-uri with every --bcp-option merged into its query string."""
    from urllib.parse import parse_qsl, urlencode

    uri = config.getoption("--bcp-uri", default=None)
    if not uri:
        return None
    extra = []
    for item in config.getoption("--bcp-option", default=[]) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise pytest.UsageError(f"--bcp-option needs KEY=VALUE, got {item!r}")
        extra.append((key, value))
    if not extra:
        return uri
    base, _, query = uri.partition("?")
    merged = dict(parse_qsl(query, keep_blank_values=True))
    merged.update(extra)
    return f"{base}?{urlencode(merged)}"


class ReportPlugin:
    def __init__(self, config: pytest.Config) -> None:
        from bcp.conformance.report import Report

        self.config = config
        self.report = Report(uri=_public_uri(config.getoption("--bcp-uri")), level=config.getoption("--bcp-level"))
        self._checks: dict[str, Check] = {}
        #: nodeid -> heading, taken from each collected test's class (see report.heading_of).
        self.headings: dict[str, str] = {}

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        from bcp.conformance.report import heading_of

        for item in items:
            name = getattr(item, "originalname", None) or item.name
            self.headings[item.nodeid] = heading_of(getattr(item, "cls", None), name)
        self.report.order = list(dict.fromkeys(self.headings.values()))
        if config.getoption("--bcp-level") != "quick":
            return
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for item in items:
            (drop if item.get_closest_marker("slow") else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from bcp.conformance.report import OTHER, Check

        name = report.nodeid.split("::")[-1]
        check = self._checks.get(report.nodeid)
        if check is None:
            check = Check(report.nodeid, self.headings.get(report.nodeid, OTHER), name, "passed")
            self._checks[report.nodeid] = check
            self.report.checks.append(check)
        check.seconds += report.duration
        for key, value in report.user_properties:
            if not isinstance(value, dict):  # the suite records dicts under both keys
                continue
            if key == "figures":
                check.figures = value
            elif key == "backend":
                self.report.backend = value
        if report.skipped:
            check.outcome = "skipped"
            longrepr = report.longrepr
            check.why = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")
        elif report.failed:
            check.outcome = "failed" if report.when == "call" else "error"
            check.why = _failure_line(report)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.write_sep("=", "bcp conformance report")
        terminalreporter.write_line(self.report.to_text())

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = self.config.getoption("--bcp-report")
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(self.report.to_json())


def _failure_line(report: pytest.TestReport) -> str:
    """The assertion's own message (which names the guarantee), on one line; a very
    long one is cut at a word boundary (report.shorten)."""
    from bcp.conformance.report import shorten

    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    return shorten(first.removeprefix("AssertionError: ").removeprefix("Failed: "))


def _public_uri(uri: str) -> str:
    """The URI as shown in reports: without its query (options may be private)."""
    return uri.partition("?")[0]
