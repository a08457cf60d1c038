"""docs/writing-a-backend.md as a backend author uses it: its complete backend,
taken from the Markdown as written, passes the whole conformance suite (object and
checkpoint checks, killed saves included), and the guide states the contract items
an author otherwise had to read the source for, with the signatures the code has."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from bcp.backends import Backend
from bcp.backends.streaming import StreamedFileBackend
from bcp.conformance import OBJECT_CONTRACT_GROUPS, CheckpointContractTests
from test_conformance_suite import run_cli
from test_docs_examples import blocks_of

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def guide_backend() -> str:
    """The guide's complete backend: the one python block that defines it."""
    found = [b.source for b in blocks_of(GUIDE) if "class DirectoryBackend(Backend)" in b.source]
    assert len(found) == 1, "the guide should show its complete backend in one block"
    return found[0]


def test_the_guides_backend_is_complete_and_about_100_lines():
    source = guide_backend()
    assert 60 <= len(source.splitlines()) <= 110
    namespace: dict = {"__name__": "guide_dirstore"}
    exec(compile(source, str(GUIDE), "exec"), namespace)
    backend_cls, writer_cls = namespace["DirectoryBackend"], namespace["DirectoryWriter"]
    assert not backend_cls.__abstractmethods__ and not writer_cls.__abstractmethods__
    assert inspect.signature(backend_cls.open_writer).parameters["size"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.slow
def test_the_guides_backend_passes_the_whole_conformance_suite(tmp_path: Path):
    (tmp_path / "guide_dirstore.py").write_text(guide_backend())
    report = tmp_path / "report.json"
    uri = f"dirstore://{tmp_path}/suite"
    proc = run_cli(uri, "--full", "--probe-mib", "8", "--import", "guide_dirstore", "--json", str(report), cwd=tmp_path)
    assert proc.returncode == 0, f"the guide's backend failed the suite:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    data = json.loads(report.read_text())
    assert data["backend"]["class"] == "guide_dirstore.DirectoryBackend"
    groups = data["groups"]
    for heading in [g.report_heading for g in OBJECT_CONTRACT_GROUPS] + [CheckpointContractTests.report_heading]:
        outcomes = {c["outcome"] for c in groups[heading]}
        assert "passed" in outcomes and not outcomes & {"failed", "error"}, (heading, groups[heading])
    checkpoint = {c["name"]: c["outcome"] for c in groups[CheckpointContractTests.report_heading]}
    assert checkpoint["test_killed_save_leaves_no_committed_checkpoint"] == "passed"
    assert checkpoint["test_killed_overwrite_keeps_the_previous_checkpoint"] == "passed"
    assert data["counts"]["passed"] > 190


def _prose() -> str:
    return re.sub(r"\s+", " ", GUIDE.read_text())


@pytest.mark.parametrize(
    "item",
    [
        "super().__init__(uri)",  # the constructor contract
        "redacted",  # ... and what .uri is
        "`size` is **keyword-only**",
        "frozen dataclass built with keywords only",
        'memoryview(buffer).cast("B")',  # typed views, counting bytes
        "number of **bytes** read",
        "is a **context manager**",  # errors.annotate
        "nested keys included",  # list() recurses
        "NON_ATOMIC_REPLACE",
        "test_overwrite_never_mixes_for_concurrent_readers",
        "bcp-checkpoint[conformance] @ file:///path/to/clone",  # from a clone, with pytest (the extra)
        "python -P -m bcp.conformance.killed_save",
    ],
)
def test_the_guide_states_the_contract_item(item: str):
    assert item in _prose(), f"docs/writing-a-backend.md does not say {item!r}"


def test_the_guide_shows_the_streamed_file_primitives_with_their_signatures():
    prose = _prose()
    for name in sorted(StreamedFileBackend.__abstractmethods__ - Backend.__abstractmethods__):
        sig = inspect.signature(getattr(StreamedFileBackend, name))
        params = ", ".join(
            f"{p.name}: {p.annotation}" if p.annotation is not inspect.Parameter.empty else p.name
            for p in sig.parameters.values()
        )
        shown = f"`{name}({params}) -> {sig.return_annotation}`"
        assert shown in prose, f"the guide does not show {shown}"
    init = inspect.signature(StreamedFileBackend.__init__)
    assert list(init.parameters) == ["self", "uri", "root", "part_size", "concurrency"]
    assert "`__init__(self, uri, root, *, part_size, concurrency)`" in prose
