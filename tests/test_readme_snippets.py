"""The README's Python snippets run as written: every ```python block, in order, in one
namespace, in a fresh working directory (the snippets save under the relative path
``ckpt/``), with the results they promise checked afterwards."""

from __future__ import annotations

import pathlib
import re

import bcp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def test_the_readme_has_the_snippets_this_test_runs():
    blocks = snippets()
    assert len(blocks) >= 2
    assert any("bcp.save(" in b for b in blocks) and any("CheckpointManager(" in b for b in blocks)


def test_the_readme_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(snippets()):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    assert "saved 3 tensors" in capsys.readouterr().out, "print(info) describes the save"
    for step in (100, 200, 300):
        assert bcp.open(f"ckpt/step{step}").keys(), f"ckpt/step{step} holds nothing"
    manager = namespace["manager"]
    assert manager.latest() == 4, "a fresh run saves steps 0-4"
    assert len(manager.steps()) <= 4, "keep_last=3 plus the best step"


def test_a_second_run_resumes_after_the_newest_step(tmp_path, monkeypatch):
    """Run the manager snippet twice, as a restarted job would (the quick start once, for
    the state it builds): the second run resumes from step 4 and saves 5-9."""
    monkeypatch.chdir(tmp_path)
    blocks = snippets()
    loop = next(b for b in blocks if "CheckpointManager(" in b)
    setup: dict = {"__name__": "readme"}
    exec(compile(blocks[0], "README.md python block 1", "exec"), setup)
    for _run in range(2):
        namespace = dict(setup)
        exec(compile(loop, "README.md manager block", "exec"), namespace)
    assert namespace["start"] == 5 and namespace["manager"].latest() == 9
