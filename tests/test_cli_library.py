"""What the ``bcp`` commands print comes from library functions (the CLI only parses
and prints): the listing of ``bcp ls``, the split of ``bcp rm``, the document of
``bcp inspect``, the runs of ``bcp bench``; and the shape of the two packages behind
the command line and ``bcp.convert``."""

from __future__ import annotations

import ast
import datetime
import fractions
import inspect
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.memory import clear_memory_store
from bcp.benchmark import save_load
from bcp.commit import delete_checkpoint
from bcp.describe import describe
from bcp.discovery import checkpoint_objects, list_checkpoints
from bcp.metadata.keys import MANIFEST_KEY
from bcp.metadata.manifest import reseal

ROOT = Path(__file__).resolve().parents[1]


def test_listing_marks_each_manager_roots_latest_and_an_unreadable_manifest(tmp_path):
    for root, steps in (("a", (1, 5)), ("b", (2, 3))):
        manager = bcp.CheckpointManager(str(tmp_path / root), async_save=False)
        for step in steps:
            manager.save(step, {"w": torch.ones(2)})
    bcp.save({"w": torch.ones(2)}, str(tmp_path / "plain"))
    naive = tmp_path / "b" / "step_0000000003" / "manifest.json"
    doc = json.loads(naive.read_text())
    doc["created"] = "2024-01-01T00:00:00"  # no time zone: the age cannot be told
    naive.write_bytes(reseal(doc))

    listing = list_checkpoints(backend_for(str(tmp_path)))
    rows = {r.path: r for r in listing.checkpoints}
    assert not listing.truncated
    assert sorted(p for p, r in rows.items() if r.latest) == ["a/step_0000000005", "b/step_0000000002"]
    bad = rows["b/step_0000000003"]
    assert bad.status == "unreadable" and isinstance(bad.error, ValueError) and "no time zone" in str(bad.error)
    assert bad.created is None and bad.created_at is None
    good = rows["plain"]
    assert good.status == "committed" and good.kind == "directory" and good.error is None
    assert good.created_at is not None and good.created_at.tzinfo is not None
    assert datetime.datetime.now(datetime.UTC) - good.created_at < datetime.timedelta(minutes=10)


_PART = st.sampled_from(["manifest.json", "gen-1", "gen-2", "gen-", "notes.txt", "x"])


@settings(deadline=None)
@given(keys=st.sets(st.lists(_PART, min_size=1, max_size=3).map("/".join), min_size=1, max_size=8))
def test_rm_deletes_exactly_the_objects_said_to_be_bcps(keys):
    store = f"t{uuid.uuid4().hex[:10]}"
    try:
        backend = backend_for(f"memory://{store}/ck")
        for key in keys:
            backend.write(key, b"x")
        found = checkpoint_objects(backend)
        assert found.keys == sorted(keys)
        assert sorted(found.bcp_keys + found.other_keys) == found.keys and not set(found.bcp_keys) & set(
            found.other_keys
        )
        assert found.committed == (MANIFEST_KEY in keys)
        assert found.generations == sorted({k.split("/")[0] for k in found.bcp_keys if k != MANIFEST_KEY})
        delete_checkpoint(backend, only_bcp=True)
        assert sorted(backend.list("")) == found.other_keys
    finally:
        clear_memory_store(store)


def test_describe_is_the_manifest_and_catalog_as_json(tmp_path):
    uri = str(tmp_path / "ck")
    state = {"model": {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 7, "frac": fractions.Fraction(1, 3)}
    bcp.save(state, uri, allow_pickle=True, metadata={"run": "a"})
    doc = describe(bcp.open(uri))
    assert json.loads(json.dumps(doc)) == doc, "JSON as it is"
    assert doc["user_metadata"] == {"run": "a"} and doc["world_size"] == 1 and doc["data_files"] == 1
    (tensor,) = doc["tensors"]
    assert tensor == {"fqn": "model.w", "shape": [3, 4], "dtype": "bfloat16", "fragments": 1, "bytes": 24}
    assert doc["objects"]["step"] == "7"
    assert doc["objects"]["frac"].startswith("<object 'frac' was pickled"), "never unpickled"


def test_the_benchmark_reports_each_run_and_leaves_no_directory_it_made(tmp_path):
    runs = []
    target = tmp_path / "new" / "dir"
    result = save_load(str(target), gib=0.001, repeats=2, on_run=lambda *run: runs.append(run))
    assert [r[0] for r in runs] == [0, 1] and all(r[1] == result.nbytes for r in runs)
    assert (
        result.nbytes == 16 * int(0.001 * 2**30 / 4 / 16) * 4
        and len(result.save_seconds) == len(result.load_seconds) == 2
    )
    assert result.save_gbps > 0 and result.load_gbps > 0
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        save_load(str(target), repeats=0)


# -- the shape of bcp.cli and bcp.convert -----------------------------------------------------------

#: bcp.convert's names that docs/interop.md, docs/manager.md and README.md use
DOCUMENTED = ["from_dcp", "to_dcp", "to_torch", "to_safetensors", "from_safetensors", "from_torch", "rank_key"]


def test_bcp_convert_names_the_format_functions():
    import bcp.convert

    for name in [*DOCUMENTED, *bcp.convert.__all__]:
        value = getattr(bcp.convert, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert value.__module__.startswith("bcp.convert."), name


def test_importing_the_cli_and_bcp_convert_loads_neither_safetensors_nor_dcp():
    code = (
        "import sys, bcp.cli, bcp.convert; "
        "print(sorted(m for m in ('safetensors', 'torch.distributed.checkpoint') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]


@pytest.mark.parametrize("package", ["cli", "convert"])
def test_package_modules_are_small_and_share_no_private_names(package):
    files = sorted((ROOT / "bcp" / package).glob("*.py"))
    assert len(files) >= 8
    for path in files:
        text = path.read_text()
        assert text.count("\n") <= 400, f"{path.name}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("bcp")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.name} imports {private} from {node.module}"
