"""Run the conformance suite against a URI from Python or the CLI (in-process pytest)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence


def run_suite(
    uri: str,
    *,
    level: str = "full",
    options: Sequence[str] = (),
    json_path: str | None = None,
    imports: Sequence[str] = (),
    keyword: str | None = None,
    verbose: bool = False,
    probe_mib: int | None = None,
) -> int:
    """Run every check against ``uri``; print the report; return the exit status
    (0 only if nothing failed). ``options`` are ``KEY=VALUE`` storage options,
    ``imports`` modules to import first (backends registered at import time); the
    killed-save child processes import them too."""
    import pytest

    from bcp.backends.registry import import_plugins

    import_plugins(imports)
    with tempfile.TemporaryDirectory(prefix="bcp-conformance-") as workdir:
        ini = os.path.join(workdir, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")  # the caller's project settings must not leak into the run
        args = [
            "--pyargs",
            "bcp.conformance",
            "-c",
            ini,
            "--rootdir",
            workdir,
            "-p",
            "no:cacheprovider",
            "--bcp-uri",
            uri,
            "--bcp-level",
            level,
            "-q" if not verbose else "-v",
            "--tb=short",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
        ]
        if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            args += ["-p", "bcp.conformance.pytest_plugin"]
        for option in options:
            args += ["--bcp-option", option]
        if json_path:
            args += ["--bcp-report", os.path.abspath(json_path)]
        if probe_mib:
            args += ["--bcp-probe-mib", str(probe_mib)]
        if keyword:
            args += ["-k", keyword]
        return int(pytest.main(args))
