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
from pathlib import Path

import pytest
import torch

import bcp
from bcp.backends import registry
from bcp.cli import main
from cli_runner import cli

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


def console(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``bcp ARGS`` in ``cwd``, with no PYTHONPATH pointing at the tests."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([BCP, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False)


def conformance_report(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / f"report-{uuid.uuid4().hex[:6]}.json"
    proc = console("conformance", *args, "--json", str(report), cwd=tmp_path, timeout=600)
    assert report.exists(), f"no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(report.read_text())


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


def test_killed_save_checks_pass_with_import_of_a_module_in_the_current_directory(tmp_path):
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    proc, data = conformance_report(tmp_path, f"{scheme}://{tmp_path}/store", "--import", module, "-k", "killed")
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


def test_import_option_of_pytest_reaches_the_child(tmp_path):
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    pytest_args = ["--pyargs", "bcp.conformance", "-q", "-p", "no:cacheprovider"]
    suite_args = ["--bcp-uri", f"{scheme}://{tmp_path}/store", "--bcp-import", module, "-k", "killed_save_leaves"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, *suite_args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]


def one_check(tmp_path: Path, plugin: str, name: str, k: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the conformance checks matching ``k`` against ``plugin`` (imported with
    --import): the run and the report of check ``name``."""
    module, scheme = write_plugin(tmp_path, plugin)
    proc, data = conformance_report(tmp_path, f"{scheme}://store/root", "--quick", "--import", module, "-k", k)
    return proc, checks(data)[name]


def test_backend_breaking_the_sub_uri_rule_fails_its_check(tmp_path):
    proc, check = one_check(tmp_path, FLAT_PLUGIN, "test_sub_uri_sees_the_roots_objects_under_sub", "sub_uri")
    assert check["outcome"] == "failed" and "sub-URI rule" in check["why"], check
    assert proc.returncode == 1


def test_sub_uri_rule_breaks_the_manager_as_the_check_says(tmp_path, in_process):
    """Why the rule is in the suite: the manager cannot see its own steps without it."""
    module, scheme = write_plugin(tmp_path, FLAT_PLUGIN)
    registry.import_plugins([module])
    manager = bcp.CheckpointManager(f"{scheme}://m{uuid.uuid4().hex[:6]}/root", async_save=False)
    manager.save(1, {"w": torch.ones(2)})
    assert manager.steps() == [] and manager.latest() is None


def test_writer_without_its_key_fails_the_attribute_check(tmp_path):
    proc, check = one_check(tmp_path, ANONYMOUS_WRITER_PLUGIN, "test_writer_has_the_interface_attributes", "attrib")
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
    assert main(args) == 2, "the scheme was known without --import (or it was not a usage error)"
    assert f"unknown storage scheme {scheme!r}" in capsys.readouterr().err
    registry.import_plugins([module])  # to save the checkpoint the commands read
    bcp.save({"w": torch.arange(6.0)}, uri, overwrite=True)
    full = ["--import", module, *args] if where == "before" else [*args, "--import", module]
    status = main(full)
    _out, err = capsys.readouterr()
    assert status == 0, f"bcp {' '.join(full)}: {err}"
    assert "unknown storage scheme" not in err


def test_import_of_a_module_in_the_current_directory_through_the_console_script(tmp_path):
    module, scheme = write_plugin(tmp_path, FILE_PLUGIN)
    (tmp_path / "store").mkdir()
    proc = console("ls", f"{scheme}://{tmp_path}/store", "--import", module, cwd=tmp_path)
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("source", "expected", "where"),
    [
        (None, "No module named", "in this process"),
        ("raise RuntimeError('boom at import')", "RuntimeError: boom at import", "console script"),
    ],
)
def test_import_failure_is_one_line_naming_the_module(request, tmp_path, source, expected, where):
    """The module that raises at import runs through the console script (its traceback
    must not reach the user); the missing module in this process (tests/cli_runner.py:
    a child costs seconds of imports), which prints what a child would."""
    module = f"plugin_{uuid.uuid4().hex[:8]}"
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source + "\n")
    if where == "console script":
        proc = console("--import", module, "ls", str(tmp_path), cwd=tmp_path)
    else:
        request.getfixturevalue("in_process")
        proc = cli("--import", module, "ls", str(tmp_path))
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
