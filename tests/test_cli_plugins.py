"""Backends that are not installed plugins, used from the command line: ``--import
MODULE`` on every subcommand, a module in the current directory, the conformance
suite's child processes, and the checks for the sub-URI rule and the writer's
attributes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import bcp
from bcp.backends import registry
from bcp.cli import main
from side_by_side import SideBySide

#: The console script, as users run it: unlike ``python -m``, it does not put the
#: current directory on sys.path by itself.
BCP = str(Path(sys.executable).with_name("bcp"))

#: A real file backend under a scheme of its own, registered when imported.
FILE_PLUGIN = """
from urllib.parse import unquote, urlsplit

from bcp.backends import register_backend
from bcp.backends.file import FileBackend


class PlainFileBackend(FileBackend):
    scheme = "{scheme}"

    @classmethod
    def from_uri(cls, uri, **options):
        return super().from_uri(unquote(urlsplit(uri).path), **options)


register_backend("{scheme}", PlainFileBackend, clobber=True)
"""

#: A memory backend that breaks the sub-URI rule: every URI is a namespace of its own.
FLAT_PLUGIN = """
from bcp.backends import register_backend
from bcp.backends.memory import MemoryBackend


class FlatBackend(MemoryBackend):
    scheme = "{scheme}"

    @classmethod
    def from_uri(cls, uri, **options):
        root = MemoryBackend.from_uri("memory://" + uri.split("://", 1)[1], **options).root.replace("/", "|")
        return cls("{scheme}://" + root, root)


register_backend("{scheme}", FlatBackend, clobber=True)
"""

#: A memory backend whose writers do not carry the key they write.
ANONYMOUS_WRITER_PLUGIN = """
from bcp.backends import register_backend
from bcp.backends.memory import MemoryBackend
from bcp.backends.wrappers import ForwardingWriter


class AnonymousWriter(ForwardingWriter):
    def __init__(self, inner):
        super().__init__(inner)
        self.key = ""


class AnonymousWriterBackend(MemoryBackend):
    scheme = "{scheme}"

    def open_writer(self, key, *, size=None):
        return AnonymousWriter(super().open_writer(key, size=size))


register_backend("{scheme}", AnonymousWriterBackend, clobber=True)
"""


def write_plugin(directory: Path, template: str) -> tuple[str, str]:
    """A plugin module in ``directory``: (module name, scheme), both unique."""
    tag = uuid.uuid4().hex[:8]
    module, scheme = f"plugin_{tag}", f"plug{tag}"
    (directory / f"{module}.py").write_text(textwrap.dedent(template.format(scheme=scheme)))
    return module, scheme


def console_env() -> dict[str, str]:
    """The environment with no PYTHONPATH pointing at the tests."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def console(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``bcp ARGS`` in ``cwd``, with no PYTHONPATH pointing at the tests."""
    env = console_env()
    return subprocess.run([BCP, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False)


def conformance_report(proc: subprocess.CompletedProcess, where: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """A ``bcp conformance ... --json where/report.json`` run and its report."""
    report = where / "report.json"
    assert report.exists(), f"no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(report.read_text())


# -- the console-script children of this module, started side by side (tests/side_by_side.py) -------


class Child(NamedTuple):
    """A submitted child: its directory, and the plugin module and scheme written there."""

    where: Path
    module: str
    scheme: str


IMPORT_FAILURES = [(None, "No module named"), ("raise RuntimeError('boom at import')", "RuntimeError: boom at import")]


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> Iterator[tuple[SideBySide, dict[str, Child]]]:
    """Every child process of this module's tests, submitted when the first one starts;
    each test checks its own child's result as it did when it ran the child itself."""
    runs, out = SideBySide(), {}

    def console_child(name: str, template: str | None, *args: str, timeout: float = 300, store: bool = False) -> None:
        where = tmp_path_factory.mktemp(name)
        if store:
            (where / "store").mkdir()
        module, scheme = write_plugin(where, template) if template else ("", "")
        args = tuple(a.format(where=where, module=module, scheme=scheme) for a in args)
        out[name] = Child(where, module, scheme)
        runs.submit(name, [BCP, *args], cwd=where, env=console_env(), timeout=timeout)

    report = ("--json", "{where}/report.json")
    console_child(
        "killed", FILE_PLUGIN, "conformance", "{scheme}://{where}/store", "--import", "{module}", "-k", "killed",
        *report, timeout=600,
    )  # fmt: skip
    for name, plugin, k in (("sub_uri", FLAT_PLUGIN, "sub_uri"), ("attrib", ANONYMOUS_WRITER_PLUGIN, "attrib")):
        console_child(
            name, plugin, "conformance", "{scheme}://store/root", "--quick", "--import", "{module}", "-k", k, *report,
            timeout=600,
        )  # fmt: skip

    where = tmp_path_factory.mktemp("pytest_import")
    module, scheme = write_plugin(where, FILE_PLUGIN)
    out["pytest_import"] = Child(where, module, scheme)
    pytest_args = ["--pyargs", "bcp.conformance", "-q", "-p", "no:cacheprovider"]
    suite_args = ["--bcp-uri", f"{scheme}://{where}/store", "--bcp-import", module, "-k", "killed_save_leaves"]
    env = {**os.environ, "PYTHONPATH": str(where)}
    runs.submit("pytest_import", [sys.executable, "-m", "pytest", *pytest_args, *suite_args], cwd=where, env=env)

    console_child("ls", FILE_PLUGIN, "ls", "{scheme}://{where}/store", "--import", "{module}", store=True)
    for n, (source, _expected) in enumerate(IMPORT_FAILURES):
        where = tmp_path_factory.mktemp(f"import_failure{n}")
        module = f"plugin_{uuid.uuid4().hex[:8]}"
        if source is not None:
            (where / f"{module}.py").write_text(source + "\n")
        out[f"import_failure{n}"] = Child(where, module, "")
        runs.submit(f"import_failure{n}", [BCP, "--import", module, "ls", str(where)], cwd=where, env=console_env())
    yield runs, out
    runs.close()


def checks(data: dict) -> dict[str, dict]:
    return {c["name"]: c for cs in data["groups"].values() for c in cs}


@pytest.fixture
def in_process(tmp_path, monkeypatch) -> Path:
    """Run ``main`` in this process, in ``tmp_path``, without leaking sys.path or the
    list of imported plugins into other tests."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(registry, "_imported_plugins", [])
    return tmp_path


# -- the conformance suite and its child processes ---------------------------------------------


def test_killed_save_checks_pass_with_import_of_a_module_in_the_current_directory(children):
    runs, child = children[0], children[1]["killed"]  # bcp conformance SCHEME://DIR/store --import MODULE -k killed
    proc, data = conformance_report(runs.result("killed"), child.where)
    killed = {name: c for name, c in checks(data).items() if "killed" in name}
    assert len(killed) == 2, killed
    assert all(c["outcome"] == "passed" for c in killed.values()), killed
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.subprocess  # the conformance check starts the child, out of sight of tests/conftest.py
def test_killed_save_failure_names_the_childs_error(tmp_path, monkeypatch):
    """Without the import in the child, the check fails saying why (its last stderr
    line), not with the start of a truncated traceback."""
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    monkeypatch.setattr(registry, "_imported_plugins", [])
    from bcp.conformance.checkpoint_contract import CheckpointContractTests

    sys.path.insert(0, str(tmp_path))
    try:
        __import__(module)  # registered in this process only: the child cannot know it
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(AssertionError) as caught:
        CheckpointContractTests().test_killed_save_leaves_no_committed_checkpoint(f"{scheme}://{tmp_path}/ck")
    first = str(caught.value).splitlines()[0]
    assert f"unknown storage scheme {scheme!r}" in first and "--import" in first, first


def test_import_option_of_pytest_reaches_the_child(children):
    runs = children[0]  # python -m pytest --pyargs bcp.conformance --bcp-uri ... --bcp-import MODULE, PYTHONPATH=DIR
    proc = runs.result("pytest_import")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]


def one_check(
    children: tuple[SideBySide, dict[str, Child]], run: str, name: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """The conformance run ``run`` (the checks matching a ``-k`` against a plugin imported
    with --import): the run and the report of check ``name``."""
    runs, child = children[0], children[1][run]
    proc, data = conformance_report(runs.result(run), child.where)
    return proc, checks(data)[name]


def test_backend_breaking_the_sub_uri_rule_fails_its_check(children):
    proc, check = one_check(children, "sub_uri", "test_sub_uri_sees_the_roots_objects_under_sub")
    assert check["outcome"] == "failed" and "sub-URI rule" in check["why"], check
    assert proc.returncode == 1


def test_sub_uri_rule_breaks_the_manager_as_the_check_says(tmp_path, in_process):
    """Why the rule is in the suite: the manager cannot see its own steps without it."""
    module, scheme = write_plugin(tmp_path, FLAT_PLUGIN)
    registry.import_plugins([module])
    manager = bcp.CheckpointManager(f"{scheme}://m{uuid.uuid4().hex[:6]}/root", async_save=False)
    manager.save(1, {"w": torch.ones(2)})
    assert manager.steps() == [] and manager.latest() is None


def test_writer_without_its_key_fails_the_attribute_check(children):
    proc, check = one_check(children, "attrib", "test_writer_has_the_interface_attributes")
    assert check["outcome"] == "failed" and "writer.key" in check["why"], check
    assert proc.returncode == 1


# -- --import on every subcommand ------------------------------------------------------------


def _commands(uri: str, tmp_path: Path) -> dict[str, list[str]]:
    """One harmless invocation of each subcommand against ``uri`` (a checkpoint)."""
    return {
        "ls": ["ls", uri],
        "inspect": ["inspect", uri],
        "verify": ["verify", uri],
        "gc": ["gc", uri, "--dry-run"],
        "rm": ["rm", uri, "--dry-run"],
        "convert": ["convert", uri, str(tmp_path / "out-st"), "--to", "safetensors"],
        "bench": ["bench", uri.rsplit("/", 1)[0], "--gib", "0.0001", "--repeats", "1"],
    }


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc", "rm", "convert", "bench"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_import_works_before_and_after_every_subcommand(in_process, capsys, command, where):
    tmp_path = in_process
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    uri = f"{scheme}://{tmp_path}/scratch/ck"
    args = _commands(uri, tmp_path)[command]
    assert main(args) == 1, "the scheme was known without --import"
    assert f"unknown storage scheme {scheme!r}" in capsys.readouterr().err
    registry.import_plugins([module])  # to save the checkpoint the commands read
    bcp.save({"w": torch.arange(6.0)}, uri, overwrite=True)
    full = ["--import", module, *args] if where == "before" else [*args, "--import", module]
    status = main(full)
    _out, err = capsys.readouterr()
    assert status == 0, f"bcp {' '.join(full)}: {err}"
    assert "unknown storage scheme" not in err


def test_import_of_a_module_in_the_current_directory_through_the_console_script(children):
    proc = children[0].result("ls")  # bcp ls SCHEME://DIR/store --import MODULE, in DIR
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout, proc.stderr


@pytest.mark.parametrize(("source", "expected"), IMPORT_FAILURES)
def test_import_failure_is_one_line_naming_the_module(children, source, expected):
    runs, out = children
    n = IMPORT_FAILURES.index((source, expected))
    module = out[f"import_failure{n}"].module  # bcp --import MODULE ls DIR, MODULE missing or raising
    proc = runs.result(f"import_failure{n}")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--import {module!r} failed" in lines[0] and expected in lines[0], lines[0]


def test_imports_before_and_after_are_merged_once_each(in_process):
    tmp_path = in_process
    tag = uuid.uuid4().hex[:8]
    a, b, c = (f"order_{name}_{tag}" for name in "abc")
    for module in (a, b, c):  # each notes its import, in order, in one file
        (tmp_path / f"{module}.py").write_text(f"with open('imported.txt', 'a') as f:\n    f.write('{module}\\n')\n")
    assert main(["--import", a, "--import", b, "ls", str(tmp_path), "--import", a, "--import", c]) == 0
    assert (tmp_path / "imported.txt").read_text().split() == [a, b, c]
    assert registry.imported_plugins() == [a, b, c], "child processes would import them in another order"
